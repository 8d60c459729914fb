"""Sharded model on 8 simulated CPU devices equals the single-device model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from tg_jax import config_lib, sharding
from tg_jax.mesh_settings import DEFAULT_RULES
from tg_jax.models import ModelConfig, Transformer, forward, init_params


def _model():
    return Transformer(
        ModelConfig(
            vocab_size=64,
            d_model=32,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            mlp_dim=64,
        )  # fmt: skip
    )


def test_resolve_mesh_shape():
    assert sharding.resolve_mesh_shape((2, -1, 2), 8) == (2, 2, 2)
    assert sharding.resolve_mesh_shape((1, -1, 1, 1), 8) == (1, 8, 1, 1)
    with pytest.raises(ValueError, match="at most one -1"):
        sharding.resolve_mesh_shape((-1, -1), 8)
    with pytest.raises(ValueError, match="sizes >= 1"):
        sharding.resolve_mesh_shape((0, -1), 8)
    with pytest.raises(ValueError, match="needs 4 devices"):
        sharding.resolve_mesh_shape((2, 2), 8)
    with pytest.raises(ValueError, match="does not divide"):
        sharding.resolve_mesh_shape((3, -1), 8)


@pytest.mark.slow
def test_sharded_forward_equals_single_device_and_placement():
    assert len(jax.devices()) == 8
    model = _model()
    mesh = sharding.make_mesh(config_lib.mesh_config((2, 2, 2, 1)))
    rules = sharding.logical_rules(config_lib.mesh_config())
    params, shardings = sharding.create_sharded_params(
        model, jax.random.key(0), mesh, rules, check=False
    )
    # Placement follows the rules: embed -> fsdp, heads/mlp/vocab -> tensor, layers unsplit.
    lay = params["layers"]
    assert lay["attn"]["q_proj"].sharding.spec == PartitionSpec(None, "fsdp", "tensor", None)
    assert lay["attn"]["o_proj"].sharding.spec == PartitionSpec(None, "tensor", None, "fsdp")
    assert lay["mlp"]["gate_proj"].sharding.spec == PartitionSpec(None, "fsdp", "tensor")
    assert params["embed"].sharding.spec == PartitionSpec("tensor", "fsdp")
    shard_shape = lay["mlp"]["gate_proj"].addressable_shards[0].data.shape
    assert shard_shape == (2, 16, 32)  # [layers, embed / fsdp, mlp / tensor]

    single = init_params(model, jax.random.key(0))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-7),
                 params, single)  # fmt: skip
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 12)), jnp.int32)
    ref = forward(model, single, tokens)
    tok_sharded = jax.device_put(tokens, sharding.data_sharding(mesh, rules))
    with sharding.activation_sharding(mesh, rules):
        out = jax.jit(lambda p, t: forward(model, p, t))(params, tok_sharded)
    assert isinstance(out.sharding, NamedSharding)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5)


@pytest.mark.slow
def test_replicated_large_params_fail_loudly():
    model = _model()
    mesh = sharding.make_mesh(config_lib.mesh_config((2, 2, 2, 1)))
    no_rules = tuple((name, None) for name, _ in DEFAULT_RULES)
    params, _ = sharding.create_sharded_params(
        model, jax.random.key(0), mesh, no_rules, check=False
    )
    with pytest.raises(ValueError, match="fully replicated"):
        sharding.check_params_sharded(params, mesh, min_size=1000)
    sharding.check_params_sharded(params, mesh, min_size=10**9)  # nothing that large: passes
