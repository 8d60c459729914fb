"""`python -m tg_jax.soak`: the main job N times under contention, with a SIGTERM and the
resuming rerun; one line per run, `soak: K/N ok`, exit 0 only when K == N."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _soak(workdir, *args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("TG_JAX_FAULTS", None)
    return subprocess.run(
        [sys.executable, "-m", "tg_jax.soak", "--config=configs/tiny.py",
         f"--workdir={workdir}", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip


@pytest.mark.e2e
def test_soak_two_runs_one_preempted_and_resumed(tmp_path):
    proc = _soak(
        tmp_path, "--runs=2", "--kill_every=2", "--busy=1", "--seed=3",
        "--config.pipeline.arms=('tg',)",  # one arm a run: the soak's logic, not the arms'
    )  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert lines[-1] == "soak: 2/2 ok", lines
    assert lines[0].startswith("run 0: ok exit 0 in ")
    assert lines[1].startswith("run 1: ok exit 0 in ") and "SIGTERM at" in lines[1], lines[1]
    assert lines[1].endswith("-> exit 143, resumed"), lines[1]  # stopped as a preemption
    for i in range(2):
        assert (tmp_path / f"run_{i}" / "report" / "results.json").exists()
    assert (tmp_path / "run_1" / "soak_1.log").exists()  # the resuming rerun's log
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "itertools.count" not in ps  # the busy process is gone


@pytest.mark.e2e
def test_soak_counts_failed_runs_and_exits_1(tmp_path):
    proc = _soak(tmp_path, "--runs=2", "--kill_every=0", "--busy=0", "--config.rl.nonfinite=no")
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert lines[0].startswith("run 0: FAIL exit 2 in ") and "no report" in lines[0], lines[0]
    assert "error: invalid config: rl.nonfinite" in lines[0], lines[0]
    assert lines[-1] == "soak: 0/2 ok"


@pytest.mark.e2e
def test_soak_rejects_arguments_it_does_not_know(tmp_path):
    proc = _soak(tmp_path, "--runs=0")
    assert proc.returncode == 2 and "--runs must be >= 1" in proc.stderr
    proc = _soak(tmp_path, "--bogus=1")
    assert proc.returncode == 2 and "unrecognized arguments: --bogus=1" in proc.stderr


def test_a_sigtermed_run_counts_only_when_it_stopped_as_a_preemption():
    """A rerun after a SIGTERM is called resumed only when the first command saved and exited
    143; one killed outright (-15) or failing (1) fails the run even if the rerun finished."""
    from tg_jax.soak import RunOutcome

    def outcome(first):
        return RunOutcome(1, [first, 0], 9.0, 4.0, report=True)

    assert outcome(143).ok and outcome(143).line().endswith("-> exit 143, resumed")
    assert outcome(0).ok and outcome(0).line().endswith("-> exit 0, rerun")  # done before it
    for first in (-15, 1):
        assert not outcome(first).ok
        assert (
            outcome(first).line()
            == f"run 1: FAIL exit 0 in 9.0 s, SIGTERM at 4.0 s -> exit {first}, rerun"
        )
    assert RunOutcome(0, [0], 9.0, None, report=True).line() == "run 0: ok exit 0 in 9.0 s"
    assert not RunOutcome(0, [0], 9.0, None, report=False).ok
