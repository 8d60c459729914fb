"""The built-in engine on several devices (`Engine(mesh=...)`, tg_jax/engine/placement.py):
8 simulated CPU devices == 1 device, the pool split on its KV heads, and its decode call
compiled ahead of time for a config (`python -m tg_jax.tpu.aot --what=engine`)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tg_jax import config_files, sharding
from tg_jax.engine import Engine, Request, paged
from tg_jax.engine.placement import engine_mesh, for_sampler
from tg_jax.models import ModelConfig, Transformer, init_params
from tg_jax.tpu import aot, aot_steps, engine_fit, hbm

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "configs")


def _model(kv_heads):
    cfg = ModelConfig(
        vocab_size=96, d_model=48, num_layers=2, num_heads=4, num_kv_heads=kv_heads,
        head_dim=16, mlp_dim=80, rope_theta=10_000.0, max_seq_len=128,
    )  # fmt: skip
    model = Transformer(cfg)
    params = init_params(model, jax.random.key(3))
    # Larger weights: peaked next-token distributions, so greedy draws have no near-ties.
    return model, jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x, params)


def _requests(temperature):
    rng = np.random.default_rng(0)
    lengths = (5, 13, 1, 9, 20, 3, 7)
    # Requests 7 and 8 repeat request 1's prompt: shared pages, copied on write.
    prompts = [[int(t) for t in rng.integers(1, 96, n)] for n in lengths]
    prompts += [prompts[1], prompts[1]]
    return [Request(i, p, 12, temperature=temperature) for i, p in enumerate(prompts)]


# Slots refill (9 requests, 4 slots); 12 pages of 4 tokens cannot hold 4 sequences of up to 32
# tokens: kept sequences lose their pages, the newest running one is preempted and requeued.
GEOMETRY = dict(max_slots=4, page_size=4, max_pages_per_seq=12, prefill_chunk=8, prefill_rows=2,
                num_pages=13)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads, shape", [(2, (4, 2)), (4, (2, 4)), (1, (8, 1))])
def test_engine_on_8_devices_equals_one_device(kv_heads, shape):
    """Greedy and sampled completions (tokens; log-probs within 1e-5) on 8 devices equal one
    device's, through slot refills, prefix sharing with copy-on-write and preemption; each
    device holds 1/tensor of the pool's keys and values; nothing recompiles after warmup."""
    model, params = _model(kv_heads)
    mesh = engine_mesh(jax.devices(), kv_heads)
    assert dict(mesh.shape) == {"data": shape[0], "tensor": shape[1]}
    for temperature in (0.0, 1.0):
        ref_engine = Engine(model, params, rng=jax.random.key(7), **GEOMETRY)
        ref = ref_engine.generate(_requests(temperature))
        engine = Engine(model, params, rng=jax.random.key(7), mesh=mesh, **GEOMETRY)
        k = engine.pool.k[0]
        assert k.sharding.mesh == mesh and len(k.addressable_shards) == 8
        assert k.addressable_shards[0].data.shape == (13, 4, kv_heads // shape[1], 16)
        engine.warmup()
        traces = engine.num_traces
        out = engine.generate(_requests(temperature))
        assert engine.num_traces == traces  # the warmup compiled every shape
        assert engine.stats["preemptions"] > 0 and engine.stats["cow_copies"] > 0
        assert engine.stats["preemptions"] == ref_engine.stats["preemptions"]
        for c, r in zip(out, ref, strict=True):
            assert c.token_ids == r.token_ids and c.finish_reason == r.finish_reason
            np.testing.assert_allclose(c.logprobs, r.logprobs, atol=1e-5)
        if temperature:
            assert min(np.min(c.logprobs) for c in out) < -0.5  # real draws
        assert engine.pool.k[0].sharding.is_equivalent_to(k.sharding, 4)  # the writes kept it


@pytest.mark.slow
def test_the_engine_takes_a_trainer_mesh_and_a_sampler_mesh():
    """A trainer's mesh (four axes) becomes an engine mesh over its devices; a sampler's
    ("data", "tensor") mesh is taken as it is; weights land with the sampler's rules."""
    model, params = _model(2)
    grid = np.asarray(jax.devices(), dtype=object)
    trainer = Mesh(grid.reshape(1, 4, 2, 1), ("data", "fsdp", "tensor", "expert"))
    mesh = for_sampler(trainer, 2)
    assert mesh.axis_names == ("data", "tensor") and dict(mesh.shape) == {"data": 4, "tensor": 2}
    assert set(mesh.devices.flat) == set(trainer.devices.flat)
    sampler = Mesh(grid[:2].reshape(1, 2), ("data", "tensor"))
    assert for_sampler(sampler, 2) is sampler
    assert for_sampler(None, 2) is None
    engine = Engine(model, params, mesh=sampler, **GEOMETRY)
    assert engine._weights.layers[0]["qkv"].sharding.spec == P(None, "tensor")
    out = engine.generate(_requests(0.0)[:2])
    ref = Engine(model, params, **GEOMETRY).generate(_requests(0.0)[:2])
    assert [c.token_ids for c in out] == [c.token_ids for c in ref]


def _config(**loop):
    cfg = config_files.load_config_file(os.path.join(CONFIG_DIR, "default.py"))
    tiny = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, max_seq_len=64, mlp_dim=32, dtype="bfloat16")  # fmt: skip
    overrides = {f"model.{k}": v for k, v in tiny.items()}
    overrides.update({f"rl_loop.{k}": v for k, v in loop.items()})
    return config_files.apply_overrides(cfg, {
        **overrides, "mesh.shape": (1, -1, 1, 1), "rl_loop.seq_len": 32,
        "sampler_mesh.shape": (-1, 2),
    })  # fmt: skip


@pytest.mark.slow
def test_aot_engine_program_has_the_configs_geometry():
    """`--what=engine`: the engine's decode call as a run makes it, colocated (the trainer's
    8 devices) and per host (2 hosts of 4): rows, pool pages and table width from
    rl_loop.engine_*; the pool is an argument, 1/tensor of it per device (by hand); the
    trainer's params and moments beside it when colocated, a host's bf16 weights."""
    devices = jax.devices()
    cfg = _config(engine_kv_tokens=100, engine_page_size=8)
    (prog,) = aot.compile_programs(cfg, devices, ["engine"], rows=8)
    # 8 episodes (rows); 100 tokens in pages of 8 -> 13 pages + the scratch page; a context
    # of 32 tokens -> tables of 4 pages.
    assert prog.name.startswith("engine decode call (8 slots, 1 token(s) a call, 13 pages of 8 ")
    assert prog.name.endswith("tokens, tables 4 pages)")
    assert dict(prog.mesh.shape) == {"data": 4, "tensor": 2}
    pool_bytes = 14 * 8 * 2 * 2 * 2 * 16 * 2  # pages x slots x layers x (k, v) x K x H x bf16
    assert pool_bytes == paged.pool_bytes(Transformer(ModelConfig.from_config(cfg.model)), 14, 8)
    report = hbm.memory_report(prog.compiled, "engine", 2.0**30, prog.resident)
    assert report.aliased == pool_bytes // 2  # the pool, donated: half of it per device
    geometry = engine_fit.engine_shape(aot.resolve_architecture(cfg), 8, 1, 32)
    assert engine_fit.pool_bytes_per_device(cfg, prog.mesh, geometry) == pool_bytes // 2
    model = Transformer(ModelConfig.from_config(aot.resolve_architecture(cfg).model))
    trainer = aot.make_meshes(cfg, devices).trainer
    params = aot_steps.abstract_params(model, trainer, sharding.logical_rules(cfg.mesh))
    state = aot_steps.state_bytes(cfg, trainer, sharding.logical_rules(cfg.mesh))
    assert 0 <= state - 3 * hbm.bytes_per_device(params) < 64  # params, moments, counters
    assert prog.resident == state
    # Per host: half the episodes each, 0 = every slot at its whole context (4 pages each).
    hosts = [devices[:4], devices[4:]]
    (prog,) = aot.compile_programs(_config(), devices, ["engine"], rows=8, hosts=hosts)
    assert prog.name.startswith("engine decode call (4 slots, 1 token(s) a call, 8 pages of 16")
    assert set(prog.mesh.devices.flat) == set(devices[:4])
    weights = jax.tree.leaves(prog.compiled.args_info[0][0])  # the call's first argument
    assert {a.dtype for a in weights if len(a.shape) >= 2} == {jnp.dtype("bfloat16")}
    meshes = aot.make_meshes(_config(), devices, hosts)
    host_copy = aot_steps.in_dtype(
        aot_steps.abstract_params(model, prog.mesh, sharding.SAMPLER_RULES), "bfloat16"
    )
    trainer = aot_steps.abstract_params(model, meshes.trainer, meshes.trainer_rules)
    outside = hbm.bytes_per_device(host_copy) - hbm.bytes_per_device(
        {k: v for k, v in host_copy.items() if k != "layers"}  # held by the engine's weights
    )
    state = aot_steps.state_bytes(_config(), meshes.trainer, meshes.trainer_rules)
    assert 0 <= state - 3 * hbm.bytes_per_device(trainer) < 64
    assert prog.resident == state + outside > 0
