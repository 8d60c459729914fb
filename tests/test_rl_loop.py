"""RL loop acceptance: SIGKILL at a random step + resume == an uninterrupted run; clear errors.

The uninterrupted and the resumed runs run in this process (deterministic mode: sampling in
the trainer thread); the killed run is a subprocess (tests/rl_loop_driver.py, slowed by 1 s per
step) that gets SIGKILL a random 0-1.5 s after a random step's checkpoint is committed, so the
kill lands while waiting, sampling, training or writing the next checkpoint. TG_KILL_STEP=k
fixes the step. All runs share the persistent compilation cache.
"""

import os
import random
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests import compile_settings
from tests import rl_loop_driver as driver
from tg_jax import checkpointing, metrics
from tg_jax.metrics import last_per_step, read_metrics
from tg_jax.tpu.distributed import cpu_devices_env
from tg_jax.train import rl, rl_setup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(workdir, config=None, **kw):
    config = config or driver.make_config()
    return rl.run_rl(
        config, str(workdir), driver.initial_params(config), arm_name=kw.pop("arm", "tg"),
        seed=0, sources=driver.make_sources(), **kw,
    )  # fmt: skip


# The rollout engine's prefill count depends on its prefix cache, process state that a resumed
# process starts empty (the tokens sampled do not: each episode has its own random stream).
_PROCESS_STATE = {"time", "rollout/prefill_tokens"}


def _comparable(workdir):
    """(stage, step) -> metrics without wall-clock timings and the engine's cache state."""
    out = {}
    for r in last_per_step(read_metrics(workdir)):
        out[(r["stage"], r["step"])] = {
            k: v for k, v in r.items() if k not in _PROCESS_STATE and not k.startswith("time/")
        }
    return out


def _committed_steps(ckpt_dir):
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())


def _kill_at(workdir, step, timeout_s=600):
    """Starts the driver and SIGKILLs it once checkpoint `step` is committed."""
    # The devices and compile settings of this process: the resumed run here must end bit for
    # bit as the full one (tests/compile_settings.py).
    env = compile_settings.with_quick_flags(cpu_devices_env(jax.device_count()))
    env["JAX_COMPILATION_CACHE_DIR"] = jax.config.jax_compilation_cache_dir or ""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.rl_loop_driver", str(workdir), "--slow", "1.0"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    ckpt_dir = os.path.join(workdir, rl.CHECKPOINT_DIR)
    while time.monotonic() < deadline:
        if any(s >= step for s in _committed_steps(ckpt_dir)):
            # Lands somewhere in the next step: rollouts, train step or an async save.
            time.sleep(random.uniform(0.0, 1.5))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return proc.returncode
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace")
            pytest.fail(f"driver exited with {proc.returncode} before step {step}:\n{out[-3000:]}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"driver did not reach step {step} in {timeout_s} s")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("full")
    result = _run(workdir)
    return workdir, result


@pytest.mark.slow
def test_sigkill_and_resume_matches_uninterrupted(full_run, tmp_path):
    full_dir, full = full_run
    assert full.finished and full.step == driver.STEPS
    kill_step = int(os.environ.get("TG_KILL_STEP", 0)) or random.randint(1, driver.STEPS - 2)
    workdir = tmp_path / "killed"
    rc = _kill_at(workdir, kill_step)
    assert rc == -signal.SIGKILL, f"kill_step={kill_step}"
    before = _committed_steps(workdir / rl.CHECKPOINT_DIR)
    assert before and before[-1] < driver.STEPS, f"kill_step={kill_step}, steps {before}"

    resumed = _run(workdir)
    assert resumed.finished and resumed.step == driver.STEPS
    summary = metrics.read_rl_summary(str(workdir))
    assert summary["sessions"][-1]["start_step"] == before[-1]
    a, b = driver.flat_params(full.state.params), driver.flat_params(resumed.state.params)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"{k} (kill_step={kill_step})")
    assert _comparable(full_dir) == _comparable(workdir), f"kill_step={kill_step}"
    for key in ("sampled_tokens", "teacher_tokens", "teacher_forward_flops"):
        assert full.costs[key] == resumed.costs[key], key
    # The training really moved the params, and TG really ran a teacher.
    init = driver.flat_params(driver.initial_params(driver.make_config()))
    assert any(not np.array_equal(init[k], a[k]) for k in a)
    assert full.costs["teacher_forward_flops"] > 0


def test_finished_run_returns_at_once(full_run):
    full_dir, full = full_run
    again = _run(full_dir)
    assert again.finished and again.step == full.step
    a, b = driver.flat_params(full.state.params), driver.flat_params(again.state.params)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def _copy_ckpts(full_dir, dst):
    shutil.copytree(full_dir / rl.CHECKPOINT_DIR, dst / rl.CHECKPOINT_DIR)
    return dst


@pytest.mark.slow
def test_wrong_arm_shape_mismatch_and_corrupt_checkpoint(full_run, tmp_path):
    full_dir, _ = full_run
    work = _copy_ckpts(full_dir, tmp_path / "a")
    with pytest.raises(checkpointing.CheckpointError, match="holds arm 'tg'"):
        _run(work, arm="grpo")
    bigger = driver.make_config()
    bigger.model.d_model = 48
    with pytest.raises(checkpointing.CheckpointError, match="does not match the restore target"):
        _run(work, config=bigger)

    def truncate(step):  # every state file of the step emptied
        for root, _, files in os.walk(work / rl.CHECKPOINT_DIR / str(step) / "state"):
            for f in files:
                if not f.endswith(".json") and "metadata" not in f:
                    open(os.path.join(root, f), "wb").close()

    # The newest step corrupt: set aside, the run resumes from the one before and finishes.
    steps = _committed_steps(work / rl.CHECKPOINT_DIR)
    assert len(steps) >= 2, steps
    truncate(steps[-1])
    resumed = _run(work)
    assert resumed.finished and resumed.step == driver.STEPS
    assert (work / rl.CHECKPOINT_DIR / f"{steps[-1]}.corrupt").is_dir()
    summary = metrics.read_rl_summary(str(work))
    assert summary["sessions"][-1]["start_step"] == steps[-2]
    # Every step corrupt: an error, not a silent fresh start.
    for step in _committed_steps(work / rl.CHECKPOINT_DIR):
        truncate(step)
    with pytest.raises(checkpointing.CheckpointError, match="unreadable"):
        _run(work)


@pytest.mark.slow
def test_sigterm_then_failed_save_then_resume(full_run, tmp_path, monkeypatch):
    """SIGTERM: the step in flight completes, is checkpointed, run_rl returns. A later save that
    raises (disk full, ...) leaves that checkpoint intact; the rerun resumes from it and ends
    exactly where the uninterrupted run ended."""
    _, full = full_run
    work = tmp_path / "sigterm"
    assert checkpointing.install_sigterm_handler()
    # (a clear failure, not a killed test process, if anything replaced the handler)
    assert checkpointing.sigterm_handler_installed(), signal.getsignal(signal.SIGTERM)
    try:
        signal.raise_signal(signal.SIGTERM)  # arrives before the first step ends
        stopped = _run(work)
    finally:
        checkpointing.clear_preemption_request()
    assert not stopped.finished and stopped.step == 1
    assert _committed_steps(work / rl.CHECKPOINT_DIR) == [1]

    real_save = checkpointing.TrainingCheckpointer.save

    def failing_save(self, step, state, **kw):
        if step == 2:
            raise checkpointing.CheckpointError("simulated: no space left on device")
        return real_save(self, step, state, **kw)

    monkeypatch.setattr(checkpointing.TrainingCheckpointer, "save", failing_save)
    with pytest.raises(checkpointing.CheckpointError, match="simulated"):
        _run(work)
    assert _committed_steps(work / rl.CHECKPOINT_DIR) == [1]
    monkeypatch.undo()

    resumed = _run(work)
    assert (
        resumed.finished and metrics.read_rl_summary(str(work))["sessions"][-1]["start_step"] == 1
    )
    a, b = driver.flat_params(full.state.params), driver.flat_params(resumed.state.params)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_the_train_task_order_follows_the_run_seed_with_a_periodic_evaluation(tmp_path):
    """rl_setup.train_tasks: the train iterator's seed is rl_loop.data_seed * 100003 + the
    run's seed, whatever the periodic evaluation's dev tasks use (rl_loop.eval_task_seed)."""
    from tg_jax import config_files
    from tg_jax.data import task_data

    config = config_files.load_config_file(os.path.join(ROOT, "configs", "tiny.py"))
    assert int(config.rl_loop.eval_every) > 0
    sources = task_data.prepare_tasks(config, str(tmp_path))
    for seed in (0, 3):
        tasks, dev = rl_setup.train_tasks(config, str(tmp_path), seed, sources, None, None)
        want = int(config.rl_loop.data_seed) * 100_003 + seed
        assert tasks.get_state()["settings"]["seed"] == want
        assert len(dev) == int(config.rl_loop.eval_tasks)
        assert all(t.task_id.startswith("dev/9/") for t in dev)  # rl_loop.eval_task_seed
