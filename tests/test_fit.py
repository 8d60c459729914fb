"""The start-up fit check (tg_jax/tpu/fit.py): programs alone and the async sum against a
device's memory, on 8 simulated CPU devices with a given HBM; main refuses on a TPU backend."""

import os

import jax
import pytest

from tg_jax import cli, config_files, config_lib
from tg_jax.engine import paged
from tg_jax.models import ModelConfig, Transformer
from tg_jax.tpu import aot, aot_steps, fit, hbm

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


def _reports(cfg, what, hosts=None):
    cfg = aot.resolve_architecture(cfg)
    programs = aot.compile_programs(cfg, jax.devices(), what, hosts=hosts)
    return [hbm.memory_report(p.compiled, p.name, BIG, p.resident) for p in programs]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["lockstep", "builtin"])
def test_async_sum_is_the_train_step_plus_the_sampler_call_s_own_bytes(engine):
    """Colocated on one host (lock-step: its weights are the trainer's params, counted once;
    the engine: a copy of its own, counted) and per host (2 hosts of 4: the host's bf16 copy,
    which the train step's figure holds, counted once): the reported sum, and the limits at
    which each program alone fits but the sum does not."""
    devices = jax.devices()
    name = {"lockstep": "sample", "builtin": "engine"}[engine]
    cfg = _config(**{"rl_loop.rollout_engine": engine})
    model = Transformer(ModelConfig.from_config(aot.resolve_architecture(cfg).model))
    for hosts in (None, [devices[:4], devices[4:]]):
        train, call = _reports(cfg, ["train", name], hosts)
        meshes = aot.make_meshes(cfg, devices, hosts)
        if hosts is None:  # the trainer's fp32 params: the lock-step step's weights
            published = aot_steps.abstract_params(model, meshes.trainer, meshes.trainer_rules)
            shared = 0 if engine == "builtin" else hbm.bytes_per_device(published)
        else:  # the host's bf16 copy: all of the lock-step step's weights, part of the engine's
            published = aot_steps.in_dtype(
                aot_steps.abstract_params(model, meshes.sampler, meshes.sampler_rules), "bfloat16"
            )
            held = paged.kept_params(model, published) if engine == "builtin" else published
            shared = hbm.bytes_per_device(held)
        assert shared == fit.shared_bytes(cfg, meshes, name)
        beside = train.total + call.total - call.resident - shared
        assert beside > max(train.total, call.total)
        lines = fit.check(cfg, hosts=hosts, hbm_bytes=beside)
        assert lines[-1].startswith("async sampling") and f"{beside / hbm.GIB:.2f} GiB" in lines[-1]
        with pytest.raises(fit.FitError, match="together .async sampling.") as e:
            fit.check(cfg, hosts=hosts, hbm_bytes=beside - 1)
        assert "does not fit" in str(e.value) and "DOES NOT FIT" in str(e.value)


@pytest.mark.slow
def test_a_program_alone_over_the_memory_and_what_is_not_summed():
    """A program that alone exceeds the memory is named; without async sampling, or with the
    sampler on devices of its own, nothing is summed; vLLM's call is not compiled."""
    cfg = _config()
    train, call = _reports(cfg, ["train", "sample"])
    with pytest.raises(fit.FitError, match=r"train step \(TG") as e:
        fit.check(cfg, hbm_bytes=train.total - 1)
    assert "rl_loop.check_fit=False" in str(e.value)
    sync = _config(**{"rl_loop.async_sampling": False})
    lines = fit.check(sync, hbm_bytes=max(train.total, call.total))
    assert len(lines) == 2 and not any("async" in line for line in lines)
    own = _config(**{"sampler_mesh.num_devices": 4})
    assert not any("async" in line for line in fit.check(own, hbm_bytes=BIG))
    assert fit.sampler_program(_config(**{"rl_loop.rollout_engine": "vllm"})) is None
    assert fit.device_hbm(jax.devices()[0]) is None  # CPU devices report no limit
    with pytest.raises(ValueError, match="memory of .* devices is unknown"):
        fit.check(cfg)


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
