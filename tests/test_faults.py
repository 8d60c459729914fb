"""Faults through the user's command (`python -m tg_jax.main` on configs/tiny.py, the tg arm
from a base model trained once per module): each ends in a clear message with nothing lost, or
does not stop the run at all. Faults are injected with TG_JAX_FAULTS (tg_jax.faults).
"""

import json
import os
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
ARM = ["--config.pipeline.arms=('tg',)", "--config.rl_loop.eval_every=0"]


def _cmd(workdir, *args):
    return [sys.executable, "-m", "tg_jax.main", "--config=configs/tiny.py",
            f"--workdir={workdir}", *args]  # fmt: skip


def _env(faults=""):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("TG_JAX_FAULTS", None)
    if faults:
        env["TG_JAX_FAULTS"] = faults
    return env


def _run(workdir, *args, faults=""):
    return subprocess.run(
        _cmd(workdir, "--config.stage=pipeline", *ARM, *args), cwd=ROOT, env=_env(faults),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.fixture(scope="module")
def base_workdir(tmp_path_factory):
    """A workdir whose data and SFT stages are done (the pipeline then goes straight to RL)."""
    work = tmp_path_factory.mktemp("base") / "w"
    proc = subprocess.run(
        _cmd(work, "--config.stage=sft"), cwd=ROOT, env=_env(), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work


@pytest.fixture
def workdir(base_workdir, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(base_workdir, work)
    return work


def _metrics(workdir):
    path = workdir / "runs" / "tg_seed0" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _train_rows(workdir):
    return [r for r in _metrics(workdir) if "loss" in r]


def _checkpoint_steps(workdir):
    ckpts = workdir / "runs" / "tg_seed0" / "checkpoints"
    return sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())


@pytest.mark.e2e
def test_an_environment_that_raises_fails_its_episode_and_the_run_goes_on(workdir):
    proc = _run(workdir, faults="env.step@2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "environment error, episode failed: InjectedFault" in proc.stderr
    ended = [r.get("rollout/end/env_error", 0.0) for r in _train_rows(workdir)]
    assert len(ended) == 4 and sum(ended) == pytest.approx(1 / 4)  # one of 4 episodes, once
    assert (workdir / "report" / "report.md").exists()


@pytest.mark.e2e
def test_a_sandbox_killed_mid_call_is_a_crashed_tool_call_and_the_run_goes_on(workdir):
    # Every sandboxed run after the first (the start-up probe) is killed.
    proc = _run(workdir, faults="sandbox.kill@2+")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _train_rows(workdir)
    assert len(rows) == 4 and (workdir / "report" / "report.md").exists()
    # No episode failed on it. (The 6-step tiny policy seldom writes a well-formed tool call,
    # so the crash count itself is checked in-process, in the next test.)
    assert all(r["rollout/end/env_error"] == 0.0 and "rollout/tool_crashed" in r for r in rows)


def test_a_killed_sandbox_run_is_a_crashed_tool_call_in_the_step_info(monkeypatch):
    from tg_jax import faults
    from tg_jax.envs.coding import CodingEnv, CodingEnvConfig
    from tg_jax.envs.ns_sandbox import check_available
    from tg_jax.envs.tasks import generate_tasks

    check_available()  # the probe runs before the fault is armed
    env = CodingEnv(CodingEnvConfig(max_turns=3, sandbox="namespace"))
    env.reset(generate_tasks("heldout", 1, seed=0)[0])
    run = '```python\ndef f(x): return x\n```\n<tool_call>{"name": "run_tests"}</tool_call>'
    monkeypatch.setenv(faults.ENV_VAR, "sandbox.kill@1")
    faults.reset()
    res = env.step(run)
    assert res.info["tool_error"] == "crashed" and res.observation == "error: crashed"
    assert not res.done
    monkeypatch.delenv(faults.ENV_VAR)
    assert env.step(run).info["tool_error"] is None  # the next run is not killed


@pytest.mark.e2e
def test_a_sandbox_that_cannot_start_is_one_error_line(workdir):
    """The probe itself killed: the namespace sandbox is unusable, said in one line (raised in
    the sampling thread, reported by the command)."""
    proc = _run(workdir, faults="sandbox.kill@1")
    assert proc.returncode == 4, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: namespace sandbox probe failed: killed"), last
    assert "env.sandbox='audit'" in last


@pytest.mark.e2e
def test_nonfinite_steps_are_skipped_then_stop_the_run_with_finite_checkpoints(workdir):
    """Steps 2, 3 and 4 have NaN rewards, so NaN losses and gradients."""
    proc = _run(workdir, faults="step.nan@2+")
    assert proc.returncode == 4, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rl step 4: non-finite loss or gradient (3 in a row"), last
    assert "Latest checkpoint: step 3" in last
    assert "non-finite loss or gradient, update skipped" in proc.stderr
    skipped = [r["update_skipped"] for r in _train_rows(workdir)]
    assert skipped[:3] == [0.0, 1.0, 1.0], skipped
    state = ocp.PyTreeCheckpointer().restore(
        str(workdir / "runs" / "tg_seed0" / "checkpoints" / "3" / "state")
    )
    leaves = jax.tree.leaves(state["params"])
    assert leaves and all(np.isfinite(np.asarray(x)).all() for x in leaves)


@pytest.mark.e2e
def test_nonfinite_stop_ends_the_run_at_the_first(workdir):
    proc = _run(workdir, "--config.rl.nonfinite=stop", faults="step.nan@2")
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "error: rl step 2: non-finite loss or gradient (rl.nonfinite=stop)" in proc.stderr


@pytest.mark.e2e
def test_disk_full_while_checkpointing_keeps_the_previous_one_and_the_rerun_resumes(workdir):
    proc = _run(workdir, faults="checkpoint.save@3")
    assert proc.returncode == 4, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "saving step 3" in last and "No space left on device" in last, last
    assert "latest complete step: 2" in last, last
    assert _checkpoint_steps(workdir) == [1, 2]
    proc = _run(workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _checkpoint_steps(workdir)[-1] == 4 and (workdir / "report" / "report.md").exists()


@pytest.mark.e2e
def test_a_corrupt_latest_checkpoint_resumes_from_the_one_before(workdir):
    proc = _run(workdir, faults="checkpoint.save@4")  # stops after step 3's checkpoint
    assert proc.returncode == 4 and _checkpoint_steps(workdir) == [2, 3], proc.stderr[-2000:]
    state = workdir / "runs" / "tg_seed0" / "checkpoints" / "3" / "state"
    for root, _, files in os.walk(state):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"\x00garbage")
    proc = _run(workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoints/3 is unreadable" in proc.stderr and "falling back" in proc.stderr
    assert (state.parent.parent / "3.corrupt").is_dir()  # kept for a post-mortem
    steps = [r["step"] for r in _train_rows(workdir)]
    assert steps[-2:] == [3, 4] and (workdir / "report" / "report.md").exists()


@pytest.mark.e2e
def test_the_workdir_removed_during_the_run_is_one_clear_error(workdir):
    proc = subprocess.Popen(
        _cmd(workdir, "--config.stage=pipeline", *ARM, "--config.rl_loop.steps=50"),
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    first = workdir / "runs" / "tg_seed0" / "checkpoints" / "1"
    deadline = time.time() + 300
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    gone = workdir.parent / "gone"
    os.rename(workdir, gone)  # at once, as `mv` or `rm` seen from the run
    shutil.rmtree(gone)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 4, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(f"error: the workdir {workdir} was removed")


def test_a_malformed_fault_plan_is_one_error_line(tmp_path):
    proc = subprocess.run(
        _cmd(tmp_path / "w", "--config.stage=forward"), cwd=ROOT, env=_env("env.step@0"),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: TG_JAX_FAULTS: bad entry 'env.step@0' (want POINT@N or POINT@N+, N >= 1, POINT "
        "one of env.step, env.slow, sandbox.kill, checkpoint.save, step.nan)"
    )


def test_slow_tools_sleep_heavy_tailed_times_seeded_per_process(monkeypatch):
    """env.slow@2+: every environment step from the second sleeps before it runs, the next of
    the process's draws: at least SLOW_SCALE_S, at most SLOW_MAX_S, a Pareto(1.5) tail (about
    1 in 100 over 1.1 s), another sequence on another process."""
    from tg_jax import faults
    from tg_jax.sampling import env_step

    draws = faults.slow_seconds("env.slow", 0, 4000)
    assert min(draws) >= faults.SLOW_SCALE_S and max(draws) <= faults.SLOW_MAX_S
    assert 0.005 < np.mean([d > 1.1 for d in draws]) < 0.02  # P(X > 22) = 22 ** -1.5 = 0.0097
    assert np.median(draws) == pytest.approx(faults.SLOW_SCALE_S * 2 ** (1 / 1.5), rel=0.1)
    assert faults.slow_seconds("env.slow", 1, 5) != draws[:5]  # seeded per process

    slept = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setenv(faults.ENV_VAR, "env.slow@2+")
    faults.reset()

    class Env:
        def step(self, text):
            return f"ran {text}"

    ep = type("Ep", (), {"env": Env()})()
    assert [env_step._step(ep, str(i)) for i in range(4)] == [f"ran {i}" for i in range(4)]
    assert slept == faults.slow_seconds("env.slow", 1, 3)  # calls 2, 3 and 4
    faults.reset()
    monkeypatch.delenv(faults.ENV_VAR)
    assert faults.pause("env.slow") == 0.0 and len(slept) == 3  # unset: no sleep


def test_a_malformed_task_record_names_the_file_and_line(tmp_path):
    good = {
        "instance_id": "repo__1",
        "files": {"pkg/__init__.py": "", "pkg/ops.py": "def add(a, b):\n    return a - b\n"},
        "problem_statement": "Fix add.",
        "test_cmd": "pytest -rA tests/",
        "hidden_tests": {"tests/test_h.py": "from pkg.ops import add\n\n\ndef test_h():\n"
                                            "    assert add(2, 2) == 4\n"},
    }  # fmt: skip
    tasks = tmp_path / "tasks.jsonl"
    text = json.dumps(good) + "\n" + json.dumps({**good, "instance_id": "b", "files": {}}) + "\n"
    tasks.write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "tg_jax.main", "--config=configs/hf_swe.py:runlocal",
         f"--workdir={tmp_path / 'w'}", "--config.stage=data",
         f"--config.tasks.train_source={tasks}"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: cannot import tasks: {tasks}:2: field 'files'"), line
    assert tasks.read_text() == text  # the user's file is untouched


def _one_line_error(*args):
    proc = subprocess.run(
        [sys.executable, "-m", "tg_jax.main", *args],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if not ln.startswith(("W", "I"))]
    assert len(errors) == 1, proc.stderr[-3000:]  # one line, besides library log lines
    return errors[0]


@pytest.mark.slow
def test_one_epoch_that_is_not_one_epoch_is_refused_at_start_up(tmp_path):
    """The 1.7B config declares one epoch (200 steps x 32 groups = its 6400 train tasks): half
    the steps is refused before anything runs."""
    line = _one_line_error(
        "--config=configs/qwen3_1p7b_tg.py", f"--workdir={tmp_path / 'w'}",
        "--config.rl_loop.steps=100",
    )  # fmt: skip
    assert line == (
        "error: invalid config: rl_loop.epochs=1 over 6400 train tasks is 6400 tasks, but "
        "rl_loop.steps=100 x groups_per_step=32 draws 3200 (0.5 epochs); change the steps or "
        "the tasks, or set rl_loop.epochs=0 to leave it unchecked"
    )
    assert not list((tmp_path / "w").iterdir())  # nothing written


@pytest.mark.slow
def test_epochs_over_a_task_file_are_checked_once_it_is_read(tmp_path):
    """A user's task file of 3 tasks, 2 steps x 2 groups declared as one epoch: refused by the
    data stage, the first stage of the run, with the counts."""
    record = {
        "files": {"pkg/__init__.py": "", "pkg/ops.py": "def add(a, b):\n    return a - b\n"},
        "problem_statement": "Fix add.", "test_cmd": "pytest -rA tests/",
        "hidden_tests": {"tests/test_h.py": "from pkg.ops import add\n\n\ndef test_h():\n"
                                            "    assert add(2, 2) == 4\n"},
    }  # fmt: skip
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(json.dumps({**record, "instance_id": f"r__{i}"}) + "\n" for i in range(3))
    )
    line = _one_line_error(
        "--config=configs/hf_swe.py:runlocal", f"--workdir={tmp_path / 'w'}",
        "--config.stage=data", f"--config.tasks.train_source={tasks}",
        "--config.rl_loop.steps=2", "--config.rl_loop.groups_per_step=2",
        "--config.rl_loop.epochs=1",
    )  # fmt: skip
    assert line.startswith("error: invalid config: rl_loop.epochs=1 over 3 train tasks is 3 "), line
    assert "draws 4 (1.33 epochs)" in line
