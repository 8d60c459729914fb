"""The start-up fit check (tg_jax/tpu/fit.py): every program and sized buffer of a run, alone
and the async sum, against a device's memory, on 8 simulated CPU devices with a given HBM;
main refuses on a TPU backend."""

import os
import pickle

import jax
import numpy as np
import pytest

from tg_jax import cli, config_files, config_lib, multihost
from tg_jax.engine import paged
from tg_jax.models import ModelConfig, Transformer
from tg_jax.sampling.trajectory import Trajectory
from tg_jax.tpu import aot, aot_sampling, aot_steps, fit, hbm

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "configs")
BIG = 2.0**40


def _config(**extra):
    cfg = config_files.load_config_file(os.path.join(CONFIG_DIR, "default.py"))
    tiny = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, max_seq_len=64, mlp_dim=32, dtype="bfloat16")  # fmt: skip
    overrides = {f"model.{k}": v for k, v in tiny.items()}
    return config_files.apply_overrides(cfg, {
        **overrides, "mesh.shape": (1, -1, 1, 1), "rl_loop.seq_len": 32,
        "sampler_mesh.shape": (-1, 2), "rl_loop.async_sampling": True, "rl.micro_batches": 2,
        **extra,
    })  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["lockstep", "builtin"])
def test_every_program_is_listed_and_the_async_sum_is_the_largest_call_s_own_bytes(engine):
    """Lock-step colocated on one host (its weights are the trainer's params, counted once) and
    the built-in engine per host (2 hosts of 4: the host's bf16 copy, part of which the
    engine's weights hold, counted once): every program the run compiles is listed (train
    step, the sampler's calls, the evaluation's call; with 2 hosts the trajectory gather); the
    reported sum is the train step plus the largest call's own bytes, and at that limit each
    program alone fits but the sum does not one byte below."""
    devices = jax.devices()
    hosts = None if engine == "lockstep" else [devices[:4], devices[4:]]
    small_eval = {"eval.num_tasks": 8, "rl_loop.eval_tasks": 4}  # under the async sum
    cfg = aot.resolve_architecture(_config(**{"rl_loop.rollout_engine": engine, **small_eval}))
    measured = fit.measure(cfg, hosts=hosts)
    names = [r.name for r in measured.reports]
    calls = {"lockstep": ["prompt"], "builtin": ["engine_prefill", "engine"]}[engine]
    assert measured.calls == calls and measured.beside_trainer
    assert names[0].startswith("train step (TG")
    if engine == "lockstep":
        assert names[1].startswith("sampler call (32 rows")
        assert names[2].startswith("periodic and final evaluation: sampler call")
        assert len(names) == 3
    else:
        assert names[1].startswith("engine prefill call") and names[2].startswith("engine decode")
        assert names[3].startswith("periodic and final evaluation: engine decode call")
        assert names[4].startswith("trajectory gather (2 hosts'") and len(names) == 5
    meshes = aot.make_meshes(cfg, devices, hosts)
    model = Transformer(ModelConfig.from_config(cfg.model))
    for name, shared in zip(calls, measured.shared, strict=True):
        if hosts is None:  # the trainer's fp32 params: the lock-step call's weights
            published = aot_steps.abstract_params(model, meshes.trainer, meshes.trainer_rules)
            assert shared == hbm.bytes_per_device(published)
        else:  # the host's bf16 copy: the part the engine's weights hold by reference
            published = aot_steps.in_dtype(
                aot_steps.abstract_params(model, meshes.sampler, meshes.sampler_rules), "bfloat16"
            )
            assert shared == hbm.bytes_per_device(paged.kept_params(model, published))
        assert shared == fit.shared_bytes(cfg, meshes, name)
    train, own = measured.reports[0], measured.reports[1 : 1 + len(calls)]
    beside = train.total + max(
        c.total - c.resident - s for c, s in zip(own, measured.shared, strict=True)
    )
    assert beside > max(r.total for r in measured.reports)
    lines = fit.judge(measured, beside)
    assert lines[-1].startswith("async sampling") and f"{beside / hbm.GIB:.2f} GiB" in lines[-1]
    with pytest.raises(fit.FitError, match="together .async sampling.") as e:
        fit.judge(measured, beside - 1)
    assert "does not fit" in str(e.value) and "DOES NOT FIT" in str(e.value)
    with pytest.raises(fit.FitError, match=r"train step \(TG") as e:
        fit.judge(measured, train.total - 1)
    assert "rl_loop.check_fit=False" in str(e.value)


def test_what_is_summed_and_what_is_not():
    """Nothing is summed without async sampling, with the sampler on devices of its own, or
    for vLLM (no program of ours; its reservation is a line of its own); CPU devices report no
    memory limit."""
    devices = jax.devices()
    cfg = _config()
    assert fit.beside_trainer(cfg, aot.make_meshes(cfg, devices))
    sync = _config(**{"rl_loop.async_sampling": False})
    assert not fit.beside_trainer(sync, aot.make_meshes(sync, devices))
    own = _config(**{"sampler_mesh.num_devices": 4})
    assert not fit.beside_trainer(own, aot.make_meshes(own, devices))
    vllm = _config(**{"rl_loop.rollout_engine": "vllm"})
    assert fit.sampler_programs(vllm) == [] and not fit.beside_trainer(
        vllm, aot.make_meshes(cfg, devices)
    )
    assert fit.device_hbm(jax.devices()[0]) is None  # CPU devices report no limit
    with pytest.raises(ValueError, match="memory of .* devices is unknown"):
        fit.check(cfg)


@pytest.mark.slow
def test_vllm_s_reservation_and_the_trajectory_gather_are_sized_by_hand():
    """vLLM (2 hosts of 4): the train step, then vLLM's weights in bf16 + the KV cache it
    reserves, beside the trainer's state; the trajectory gather: per chip, every host's
    pickled share of the step's longest trajectories in a power-of-two buffer, as
    `multihost.allgather_objects` allocates it (with router replay, the routing records),
    never more than a chunk a host."""
    devices = jax.devices()
    hosts = [devices[:4], devices[4:]]
    cfg = aot.resolve_architecture(_config(**{"rl_loop.rollout_engine": "vllm"}))
    measured = fit.measure(cfg, hosts=hosts)
    names = [r.name for r in measured.reports]
    assert names[1] == "vLLM engine (weights + KV cache)" and names[2].startswith("trajectory")
    m = cfg.model
    params = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2) + m.d_model  # embed, head
    per_layer = m.d_model * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)  # q, o, k, v
    per_layer += 3 * m.d_model * m.mlp_dim + 2 * m.d_model + 2 * m.head_dim  # mlp, norms
    weights = 2 * params + 2 * m.num_layers * per_layer  # bf16
    slots = cfg.rl_loop.groups_per_step * cfg.rl_loop.rollouts_per_group
    tokens = slots * m.max_seq_len * 5 // 4 + 16 * 128
    kv = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 2 * tokens
    vllm = measured.reports[1]
    assert vllm.estimated and vllm.arguments == weights + kv
    meshes = aot.make_meshes(cfg, devices, hosts)
    assert vllm.resident == aot_steps.state_bytes(cfg, meshes.trainer, meshes.trainer_rules)
    gather = measured.reports[2]
    shapes = aot.train_shapes(cfg, 1)
    share = [_longest_trajectory(shapes.seq_len) for _ in range(shapes.rows // 2)]
    size = len(pickle.dumps(share, protocol=pickle.HIGHEST_PROTOCOL))
    buffer = 1 << max(12, (size - 1).bit_length())  # allgather_objects' bucket (< a chunk)
    assert buffer < multihost.GATHER_CHUNK_BYTES and gather.arguments == 2 * buffer
    routed = aot.resolve_architecture(
        _config(**{"rl_loop.rollout_engine": "vllm", "model.num_experts": 4,
                   "model.experts_per_token": 2, "model.moe_mlp_dim": 16,
                   "model.router_replay": True})
    )  # fmt: skip
    with_routes = aot_sampling.gather_bytes(routed, shapes.rows, shapes.seq_len, 2)
    routes = shapes.rows // 2 * shapes.seq_len * m.num_layers * 2 * 2  # a share's [n, L, J] int16
    assert with_routes >= 2 * (size + routes) and with_routes > gather.arguments
    # 16 hosts' shares of 8192 rows of 8192 tokens (88 MB a host) go a chunk at a time.
    pod = aot_sampling.gather_bytes(routed, 8192, 8192, 16)
    assert pod == 16 * multihost.GATHER_CHUNK_BYTES


def _longest_trajectory(n):
    return Trajectory(
        tokens=np.zeros((n,), np.int32), roles=np.zeros((n,), np.int8),
        turn_ids=np.zeros((n,), np.int32), turn_starts=np.zeros((1,), np.int32),
        behaviour_logprobs=np.zeros((n,), np.float32), turn_verdicts=[{}], rewards={},
        hint_tokens={}, group_id=0, policy_version=0, task_id="",
    )  # fmt: skip


@pytest.mark.slow
def test_main_refuses_a_config_that_does_not_fit_on_a_tpu_backend(monkeypatch, capsys):
    """tg_jax.main on a TPU backend: the figures on stderr and one error line, exit 2; off
    with rl_loop.check_fit=False, and never on other backends."""
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(fit, "device_hbm", lambda device: 4096.0)
    cfg = _config()
    with pytest.raises(SystemExit) as e, cli.exit_on_error():
        config_lib.check_fit(cfg)
    assert e.value.code == cli.USAGE_ERROR
    err = capsys.readouterr().err
    assert "error: the config does not fit its devices' memory" in err
    assert "train step (TG" in err and "DOES NOT FIT" in err
    config_lib.check_fit(_config(**{"rl_loop.check_fit": False}))  # skipped: no exit
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    config_lib.check_fit(cfg)
