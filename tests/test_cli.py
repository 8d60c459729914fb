"""`python -m tg_jax.main` fails fast on a bad command line: one `error:` line, exit status 2."""

import os
import subprocess
import sys

import pytest

from tg_jax import config_files
from tg_jax.evaluation.report_settings import eval_temperature
from tg_jax.tpu.distributed import cpu_devices_env

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _main(*args: str, devices: int = 1) -> subprocess.CompletedProcess:
    env = {**cpu_devices_env(devices), "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "tg_jax.main", "--config=configs/tiny.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.e2e
@pytest.mark.parametrize(
    "override, line",
    [
        (
            "--config.rl.clip_lo=0.1",
            "error: unknown config field rl.clip_lo (rl has: adv_eps, advantage_mode, agg_mode, "
            "clip_high, clip_low, dual_clip, kl_coef, kl_estimator, max_staleness, "
            "micro_batches, nonfinite, nonfinite_limit, norm_length, num_minibatches, num_updates, "
            "requirement_credit, "
            "reward_norm, reward_weights, temperature, tis_cap; did you mean "
            "clip_low, clip_high?)",
        ),
        ("--config.rll.kl_coef=1", "error: unknown config field rll.kl_coef (config has: "),
        ("--config.optim.lr=abc", "error: --config.optim.lr: expected float, got 'abc'"),
        ("--config.model.num_layers=2.5", "error: --config.model.num_layers: expected int"),
        ("--config.rl.dual_clip=0.5", "error: invalid config: rl.dual_clip must be > 1"),
        ("--config.stage=nope", "error: unknown stage 'nope'"),
        (
            "--config.sampler_mesh.max_rows=-1",
            "error: invalid config: sampler_mesh.max_rows must be >= 0 (0 = all), got -1",
        ),
        (
            "--config.rl_loop.epochs=-1",
            "error: invalid config: rl_loop.epochs must be >= 0 (0 = not checked), got -1",
        ),
        (
            "--config.sft.require.pass_rate=(0.6,0.2)",
            "error: invalid config: sft.require.pass_rate (0.6, 0.2) must satisfy 0 <= low <= "
            "high <= 1",
        ),
        (
            "--config.sft.require.max_format_cost=-2",
            "error: invalid config: sft.require.max_format_cost must be >= -1",
        ),
        (
            "--config.rl_loop.rollout_engine=sglang",
            "error: invalid config: rl_loop.rollout_engine must be one of ('lockstep', 'builtin', "
            "'vllm'), got 'sglang'",
        ),
        (
            "--config.rl_loop.engine_decode_steps=0",
            "error: invalid config: rl_loop.engine_decode_steps must be >= 1, got 0",
        ),
        (
            "--config.eval.temperature=-0.5",
            "error: invalid config: eval.temperature must be >= 0 (-1 = rl.temperature), got -0.5",
        ),
    ],
    ids=[
        "unknown_field",
        "unknown_section",
        "float",
        "int",
        "invalid_value",
        "stage",
        "max_rows",
        "epochs",
        "gate_range",
        "format_cost_gate",
        "rollout_engine",
        "decode_steps",
        "eval_temperature",
    ],
)
def test_bad_override_is_one_line_and_exit_2(tmp_path, override, line):
    result = _main(f"--workdir={tmp_path / 'w'}", override)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.e2e
def test_workdir_that_is_a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("")
    result = _main(f"--workdir={path}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [f"error: --workdir {path} is a file"]


@pytest.mark.e2e
def test_base_model_outside_the_gates_is_a_clear_error_and_exit_3(tmp_path):
    # The tiny config turns the gates off; on, its 6-step base model (pass rate 0) fails them.
    work = tmp_path / "w"
    result = _main(
        f"--workdir={work}", "--config.stage=pipeline", "--config.sft.require.enabled=True"
    )
    assert result.returncode == 3, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "error: the SFT base model is outside the gates of sft.require; no RL was run." in (
        result.stderr
    )
    assert "FAIL pass_rate 0.000 outside [0.2, 0.6]" in result.stderr
    assert "knobs to turn: sft.steps" in result.stderr
    assert os.path.exists(work / "sft_eval.json")
    assert not os.path.exists(work / "runs") and not os.path.exists(work / "report")
    assert not os.path.exists(work / "preregistration.json")


@pytest.mark.e2e
def test_main_job_keeps_its_compiles_in_the_compilation_cache(tmp_path):
    """launch/local.sh's TG_JAX_COMPILATION_CACHE is where the main job's executables persist
    on one CPU device; on 8 (collectives in one process) the job compiles afresh and says so
    (tg_jax.tpu.distributed.no_persistent_cache_on_cpu)."""
    for devices in (1, 8):
        cache = tmp_path / f"cache{devices}"
        env = dict(
            cpu_devices_env(devices), JAX_PLATFORMS="cpu", TG_JAX_COMPILATION_CACHE=str(cache)
        )
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        cmd = [
            sys.executable,
            "-m",
            "tg_jax.main",
            "--config=configs/tiny.py",
            f"--workdir={tmp_path / f'w{devices}'}",
            "--config.stage=forward",
        ]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "forward ok" in proc.stdout
        written = cache.is_dir() and any(cache.iterdir())
        assert written == (devices == 1), (devices, proc.stdout[-2000:])
        notice = f"{devices} CPU devices in one process: no persistent compilation cache"
        assert (notice in proc.stdout) == (devices > 1), proc.stdout[-2000:]


@pytest.mark.e2e
def test_a_repeated_override_is_the_last_one(tmp_path):
    """`--config.mesh.shape` twice (as a launcher appending to a user's command does): the
    last value, not the two tuples joined; the forward stage prints the mesh it built."""
    proc = _main(
        f"--workdir={tmp_path / 'w'}",
        "--config.stage=forward",
        "--config.mesh.shape=(1,4,2,1)",
        "--config.mesh.shape=(1,-1,1,1)",
        devices=8,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "on mesh {'data': 1, 'fsdp': 8, 'tensor': 1, 'expert': 1}" in proc.stdout


def test_the_evaluations_follow_rl_temperature_unless_set():
    """One knob: eval.temperature is -1 by default, which reads rl.temperature; set, it wins
    (0 = greedy)."""
    cfg = config_files.load_config_file(os.path.join(ROOT, "configs/tiny.py"))
    assert cfg.eval.temperature == -1 and eval_temperature(cfg) == cfg.rl.temperature == 1.0
    follows = config_files.apply_overrides(cfg, {"rl.temperature": 0.7})
    assert eval_temperature(follows) == 0.7
    for t in (0.0, 0.5):
        own = config_files.apply_overrides(follows, {"eval.temperature": t})
        assert eval_temperature(own) == t
