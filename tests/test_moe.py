"""Qwen3-MoE block: numpy reference, both dispatch modes, HF aux loss, sharded values and grads."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.hf_checkpoints import make_hf_model
from tg_jax import config_files, config_lib, sharding
from tg_jax.models import ModelConfig, Transformer, init_params
from tg_jax.models import moe as moe_lib
from tg_jax.models.checkpoint_io import load_hf_checkpoint

CFG = dict(
    vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    mlp_dim=0, max_seq_len=32, num_experts=8, experts_per_token=2, moe_mlp_dim=16,
)  # fmt: skip


def _numpy_moe(x_XxD, p, k, norm):
    """Token-by-token reference, as HF's Qwen3MoeSparseMoeBlock (fp64)."""
    x = np.asarray(x_XxD, np.float64)
    logits = x @ np.asarray(p["router"], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        top = np.argsort(-probs[n], kind="stable")[:k]
        w = probs[n, top] / (probs[n, top].sum() if norm else 1.0)
        for e, we in zip(top, w, strict=True):
            g = x[n] @ np.asarray(p["gate_proj"][e], np.float64)
            u = x[n] @ np.asarray(p["up_proj"][e], np.float64)
            h = g / (1 + np.exp(-g)) * u
            out[n] += we * (h @ np.asarray(p["down_proj"][e], np.float64))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["dense", "ragged"])
@pytest.mark.parametrize("norm", [True, False], ids=["norm_topk", "raw_topk"])
def test_block_matches_numpy(dispatch, norm):
    cfg = ModelConfig(**CFG, norm_topk_prob=norm)
    block = moe_lib.MoE(cfg, dispatch=dispatch)
    x = jax.random.normal(jax.random.key(0), (3, 7, cfg.d_model))
    params = block.init(jax.random.key(1), x)["params"]
    params = jax.tree.map(lambda v: v * 10.0, jax.tree.map(np.asarray, nn_unbox(params)))
    y = np.asarray(block.apply({"params": params}, x))
    ref = _numpy_moe(np.asarray(x).reshape(21, -1), params, cfg.experts_per_token, norm)
    assert np.abs(ref).max() > 0.1
    np.testing.assert_allclose(y.reshape(21, -1), ref, atol=2e-5, rtol=1e-5)


def nn_unbox(tree):
    import flax.linen as nn

    return nn.unbox(tree)


def test_invalid_dispatch():
    with pytest.raises(ValueError, match="dispatch"):
        moe_lib.experts(*(jnp.zeros((1, 1)),) * 3, *(jnp.zeros((1, 1, 1)),) * 3, 0, "sparse")


def test_aux_loss_matches_transformers(tmp_path):
    import torch

    cfg = ModelConfig(**CFG, norm_topk_prob=True, router_aux_loss_coef=0.02)
    hf_model = make_hf_model(cfg, seed=2)
    hf_model.save_pretrained(tmp_path)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 11))
    with torch.no_grad():
        out = hf_model(input_ids=torch.from_numpy(tokens), output_router_logits=True)
    params, cfg = load_hf_checkpoint(str(tmp_path))
    apply = jax.jit(lambda p, t: Transformer(cfg).apply({"params": p}, t, mutable=True))
    _, state = apply(params, jnp.asarray(tokens, jnp.int32))
    inter = state["intermediates"]
    assert inter["layers"]["mlp"]["router_load"][0].shape == (cfg.num_layers, 2, cfg.num_experts)
    ours = float(moe_lib.load_balancing_loss(inter, cfg))
    np.testing.assert_allclose(ours, 0.02 * float(out.aux_loss), rtol=1e-5)
    # The per-layer losses are HF's formula on one layer: >= 1 * k with equality iff balanced.
    per_layer = np.asarray(inter["layers"]["mlp"]["router_aux_loss"][0])
    assert per_layer.shape == (cfg.num_layers,) and np.all(per_layer >= 0.99 * 2)


def _grads(cfg, params, tokens, mesh=None, rules=None):
    model = Transformer(cfg)

    def loss(p):
        logits, state = model.apply({"params": p}, tokens, mutable=["intermediates"])
        aux = moe_lib.load_balancing_loss(state["intermediates"], cfg)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0]) + aux

    fn = jax.jit(jax.value_and_grad(loss))
    if mesh is None:
        return fn(params)
    with sharding.activation_sharding(mesh, rules):
        return fn(params)


@pytest.mark.slow
def test_sharded_values_and_grads_equal_single_device():
    """shard_map expert parallelism = one device, with every collective of the sharded path.

    Mesh data=1, fsdp=2, tensor=2, expert=2 with the batch split over (fsdp, expert): expert
    weights are all-gathered over fsdp (embed), tokens over expert (the axis shared with the
    batch), partial outputs psum'd over tensor (moe_mlp) and reduce-scattered over expert.
    (Forward values with tokens replicated over the expert axis: tests/test_checkpoint_io.py.)
    """
    shape, batch_rule = (1, 2, 2, 2), ("data", "fsdp", "expert")
    cfg = ModelConfig(**CFG, router_aux_loss_coef=0.1, remat_policy="full")
    model = Transformer(cfg)
    params = init_params(model, jax.random.key(3))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (8, 9)), jnp.int32)
    ref_v, ref_g = _grads(cfg, params, tokens)
    mesh_cfg = config_lib.mesh_config(shape)
    rules = tuple((n, batch_rule if n == "batch" else t) for n, t in mesh_cfg.rules)
    mesh = sharding.make_mesh(mesh_cfg)
    shardings = sharding.param_partition_specs(model, mesh, rules)
    sharded = jax.device_put(params, shardings)
    v, g = _grads(cfg, sharded, tokens, mesh, rules)
    np.testing.assert_allclose(float(v), float(ref_v), rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4), g, ref_g)
    assert float(jnp.abs(g["layers"]["mlp"]["router"]).max()) > 0  # router gets gradients


# (config changes, mesh (data, fsdp, tensor, expert), the experts' [E, D, F] mesh axes as
# placed): what does not divide is replicated (`sharding.fit_spec`) and the experts' shard_map
# takes the weights as placed. The batch is split over (data, fsdp, expert) in both.
UNEVEN = {
    # E 6 over "expert" 4: whole experts on every device, each running its 2 rows through all
    # of them; F split over "tensor" 2 and psum'd.
    "6 experts over expert 4": (dict(num_experts=6), (1, 1, 2, 4), ((), ("fsdp",), ("tensor",))),
    # D 33 over "fsdp" 2 and F 15 over "tensor" 2 whole (no all-gather, no psum over tensor);
    # E 6 over "expert" 2 split, tokens all-gathered over it and the sum reduce-scattered.
    "d_model 33 over fsdp 2, moe_mlp_dim 15 over tensor 2": (
        dict(num_experts=6, d_model=33, moe_mlp_dim=15),
        (1, 2, 2, 2),
        (("expert",), (), ()),
    ),
}


def _shard_map_in_specs(jaxpr, out):
    """The in_specs of every shard_map in `jaxpr` and the jaxprs inside it (scan, remat)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            out.append(eqn.params["in_specs"])
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    _shard_map_in_specs(sub, out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(UNEVEN))
def test_experts_that_do_not_divide_the_mesh_run_as_on_one_device(case):
    """Issue 70: a MoE whose E, D or F does not divide its mesh axis runs (no preflight
    refusal): logits, loss and every gradient on 8 devices equal one device's, and the
    experts' shard_map takes the weights in the shardings they were placed with (no
    reshard)."""
    changes, shape, want = UNEVEN[case]
    cfg = ModelConfig(**{**CFG, **changes}, router_aux_loss_coef=0.1, remat_policy="full")
    model = Transformer(cfg)
    params = init_params(model, jax.random.key(3))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (8, 9)), jnp.int32)
    mesh_cfg = config_lib.mesh_config(shape)
    batch_rule = ("data", "fsdp", "expert")
    rules = tuple((n, batch_rule if n == "batch" else t) for n, t in mesh_cfg.rules)
    mesh = sharding.make_mesh(mesh_cfg)
    shardings = sharding.param_partition_specs(model, mesh, rules)
    placed = {k: v.spec[1:] for k, v in shardings["layers"]["mlp"].items()}  # [L, ...] stacked
    assert [moe_lib._entry_axes(a) for a in placed["gate_proj"]] == list(want)
    sharded = jax.device_put(params, shardings)
    with sharding.activation_sharding(mesh, rules):
        jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, tokens))(sharded)
    specs = _shard_map_in_specs(jaxpr.jaxpr, [])
    assert len(specs) == 1, specs  # the scanned layers' one MoE block
    got = [[moe_lib._entry_axes(a) for a in s] for s in specs[0][3:]]
    names = ("gate_proj", "up_proj", "down_proj")  # shard_map's weight arguments, in order
    assert got == [[moe_lib._entry_axes(a) for a in placed[k]] for k in names]

    ref_logits = jax.jit(lambda p: model.apply({"params": p}, tokens))(params)
    ref_v, ref_g = _grads(cfg, params, tokens)
    with sharding.activation_sharding(mesh, rules):
        logits = jax.jit(lambda p: model.apply({"params": p}, tokens))(sharded)
    v, g = _grads(cfg, sharded, tokens, mesh, rules)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(float(v), float(ref_v), rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), g, ref_g)
    assert float(jnp.abs(g["layers"]["mlp"]["gate_proj"]).max()) > 0


@pytest.mark.slow
def test_router_aux_loss_enters_the_rl_loss_with_its_coefficient():
    """model.router_aux_loss_coef > 0: the RL loss gains coef x the load-balancing loss of the
    student forward (weighted by the batch's token share), and the routers get its gradient."""
    from tg_jax.rl import train_step as ts
    from tg_jax.rl.batch import build_batch
    from tg_jax.rl.step_config import StepConfig
    from tg_jax.testing import synthetic_trajectories

    trajs = synthetic_trajectories(np.random.default_rng(0), 4, 24, vocab_size=64, hint_len=4)
    batch = build_batch(trajs, max_len=32, teacher_max_len=32, requirement_names=("fence",))
    cfg = config_files.apply_overrides(
        ml_collections_config(), {"tg.enabled": False, "rl.reward_weights": {"task": 1.0}}
    )
    typed = StepConfig.from_config(cfg)

    def run(coef):
        model = Transformer(ModelConfig(**CFG, router_aux_loss_coef=coef))
        fn = functools.partial(ts.loss_fn, model=model, rl_cfg=typed.rl, tg_cfg=typed.tg)
        return jax.value_and_grad(fn, has_aux=True)(params, batch), model

    params = init_params(Transformer(ModelConfig(**CFG)), jax.random.key(0))
    ((loss0, _), g0), _ = run(0.0)
    ((loss1, (sums, _)), g1), model = run(0.5)
    _, state = model.apply(
        {"params": params}, batch.tokens_BxT, batch.positions_BxT, batch.segment_ids_BxT,
        mutable=["intermediates"],
    )  # fmt: skip
    want = moe_lib.load_balancing_loss(state["intermediates"], model.config)  # whole batch
    assert float(want) > 0
    np.testing.assert_allclose(float(loss1 - loss0), float(want), rtol=1e-5)
    np.testing.assert_allclose(float(sums["router_aux_loss"]), float(want), rtol=1e-5)
    diff = g1["layers"]["mlp"]["router"] - g0["layers"]["mlp"]["router"]
    assert float(jnp.abs(diff).max()) > 0  # the routers are pulled toward balance


def ml_collections_config():
    import ml_collections

    c = ml_collections.ConfigDict()
    c.rl = config_lib.rl_config()
    c.tg = config_lib.tg_config()
    c.optim = config_lib.optim_config()
    return c
