"""Self-tests before an RL run's first step (tg_jax.train.self_tests, `rl_loop.self_tests`).

A fresh tiny TG run (in this process, 8 devices) passes them with its figures far below the
tolerances and logs them at step 0; then each check is broken on purpose on that run's first
rollout group: a padding bug in the batch (student), a hint spliced after the assistant header
or one turn early (teacher), shifted behaviour log-probs (behaviour). Through the user's
command, the padding bug stops the run with one `error:` line, exit 2, before any step.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import rl_loop_driver as driver
from tests.test_pipeline import FAST_PIPELINE
from tg_jax import testing
from tg_jax.errors import SelfTestError
from tg_jax.metrics import read_metrics
from tg_jax.models import ModelConfig
from tg_jax.rl import batch as batch_mod
from tg_jax.rl.tg import compact
from tg_jax.train import rl, self_tests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS = ("student", "teacher", "behaviour")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A one-step tiny TG run, and what its self-tests were given (params copied: the step
    donates them)."""
    seen = {}
    run = self_tests.run

    def spy(parts, params, trajectories, batch, teacher_params=None):
        seen.update(parts=parts, params=jax.tree.map(jnp.copy, params), group=trajectories)
        seen["batch"] = batch
        return run(parts, params, trajectories, batch, teacher_params)

    config = driver.make_config(arm="tg", steps=1)
    config.rl_loop.eval_every = 0
    workdir = tmp_path_factory.mktemp("selftest")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(self_tests, "run", spy)
        result = rl.run_rl(
            config, str(workdir), driver.initial_params(config), arm_name="tg", seed=0,
            sources=driver.make_sources(),
        )  # fmt: skip
    assert result.finished
    return {**seen, "workdir": workdir}


def _check(run, trajectories=None, parts=None):
    """self_tests.run on the run's first group (or `trajectories`), its batch built anew."""
    parts = parts or run["parts"]
    trajectories = run["group"] if trajectories is None else trajectories
    batch = rl._build_batch(parts, trajectories, 1)
    return self_tests.run(parts, run["params"], trajectories, batch)


def _refused(run, check, **kw):
    with pytest.raises(SelfTestError) as e:
        _check(run, **kw)
    msg = str(e.value)
    assert msg.startswith(f"{check} log-probs: max |diff| "), msg
    assert "\n" not in msg and msg.endswith("Turn the self-tests off with rl_loop.self_tests=False")
    return msg


def test_a_fresh_run_passes_and_logs_its_figures(tiny_run):
    rows = read_metrics(tiny_run["workdir"])
    (figures,) = [r for r in rows if r["stage"] == self_tests.STAGE]
    assert figures["step"] == 0 and [r["step"] for r in rows if r["stage"] == "train"] == [1]
    for check in CHECKS:
        key = f"selftest/{check}_lp"
        assert figures[f"{key}_tokens"] > 0, check
        assert figures[f"{key}_max_diff"] <= 1e-5 < figures[f"{key}_max_tol"], check
        assert figures[f"{key}_mean_diff"] <= 1e-5 < figures[f"{key}_mean_tol"], check
    # The behaviour figure is the train step's own mismatch at step 1 (same params, tokens).
    (step1,) = [r for r in rows if r["stage"] == "train"]
    assert figures["selftest/behaviour_lp_max_diff"] == pytest.approx(
        step1["logprob_mismatch_max"], abs=1e-6
    )
    assert 0 < figures["time/selftest_s"] < 60


def test_a_padding_bug_fails_the_student_check(tiny_run, monkeypatch):
    """Positions counted from the end of the padding (a left-padding habit on right-padded
    rows): the row's log-probs move with its padded length."""
    fill = batch_mod._fill_row

    def bad_fill(dst, row, seq, length, src=None, b=0):
        fill(dst, row, seq, length, src, b)
        dst["positions"][row] = np.maximum(np.arange(length) - (length - len(seq)), 0)

    monkeypatch.setattr(batch_mod, "_fill_row", bad_fill)
    msg = _refused(tiny_run, "student")
    assert "row 3 of the step's batch (T=208)" in msg, msg


def _misplace(monkeypatch, shift):
    """Teacher rows with each hint spliced at shift(traj) instead of the turn's start."""
    hinted = batch_mod.hinted

    def bad(traj, hints, turns, begin, end):
        moved = dataclasses.replace(traj, turn_starts=shift(traj))
        return hinted(moved, hints, turns, begin, end)

    monkeypatch.setattr(batch_mod, "hinted", bad)
    monkeypatch.setattr(compact, "hinted", bad)


def test_a_hint_after_the_assistant_header_fails_the_teacher_check(tiny_run, monkeypatch):
    header = len(tiny_run["parts"].renderer.assistant_header())
    _misplace(monkeypatch, lambda t: np.asarray(t.turn_starts) + header)
    msg = _refused(tiny_run, "teacher")
    assert "before turn 0's assistant header at token 60" in msg, msg


def test_a_hint_one_turn_early_fails_the_teacher_check(tiny_run, monkeypatch):
    """Three-turn trajectories (random tokens: their behaviour log-probs are no model's, so
    with the teacher right the behaviour check is the one that fails)."""
    group = testing.synthetic_trajectories(np.random.default_rng(0), 4, 160, num_turns=3)
    _refused(tiny_run, "behaviour", trajectories=group)
    _misplace(monkeypatch, lambda t: np.concatenate([t.turn_starts[:1], t.turn_starts[:-1]]))
    msg = _refused(tiny_run, "teacher", trajectories=group)
    assert "before turn 2's assistant header" in msg, msg


def test_shifted_behaviour_logprobs_fail_the_behaviour_check(tiny_run):
    shifted = [
        dataclasses.replace(t, behaviour_logprobs=np.roll(t.behaviour_logprobs, 1))
        for t in tiny_run["group"]
    ]
    _refused(tiny_run, "behaviour", trajectories=shifted)


def test_the_grpo_arm_has_no_teacher_check(tiny_run):
    parts = tiny_run["parts"]
    config = parts.config.copy_and_resolve_references()
    config.tg.enabled = False
    figures = _check(tiny_run, parts=dataclasses.replace(parts, config=config))
    assert not any(k.startswith("selftest/teacher") for k in figures)
    assert figures["selftest/student_lp_max_diff"] <= 1e-5


def test_tolerances_follow_the_compute_dtype_and_backend():
    cfg = ModelConfig.from_config(driver.make_config().model)
    assert self_tests.tolerance(cfg, "cpu") == ("float32", self_tests.TOLERANCES["float32"])
    bf16 = dataclasses.replace(cfg, dtype="bfloat16")
    assert self_tests.tolerance(bf16, "cpu")[1] is self_tests.TOLERANCES["bfloat16"]
    name, tol = self_tests.tolerance(cfg, "tpu")  # float32 matmuls there round like bfloat16
    assert name == "float32 on tpu, as bfloat16" and tol is self_tests.TOLERANCES["bfloat16"]
    for row in self_tests.TOLERANCES.values():
        assert set(row) == set(CHECKS)


# The user's command, with a padding bug in the batch builder.
MAIN = """
import runpy, sys
import numpy as np
from tg_jax.rl import batch
fill = batch._fill_row
def bad_fill(dst, row, seq, length, src=None, b=0):
    fill(dst, row, seq, length, src, b)
    dst["positions"][row] = np.maximum(np.arange(length) - (length - len(seq)), 0)
batch._fill_row = bad_fill
sys.argv = ["tg_jax.main", *sys.argv[1:]]
runpy.run_module("tg_jax.main", run_name="__main__")
"""


@pytest.mark.e2e
def test_the_command_refuses_to_train_on_a_padding_bug(tmp_path):
    work = tmp_path / "w"
    overrides = [f"--config.{k}={v}" for k, v in FAST_PIPELINE.items()]
    cmd = [sys.executable, "-c", MAIN, "--config=configs/tiny.py", f"--workdir={work}",
           "--config.stage=pipeline", "--config.pipeline.arms=('tg',)", *overrides]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("error: self-test failed: student log-probs: max |diff| ")
    assert "rl_loop.self_tests=False" in errors[0] and "Traceback" not in proc.stderr
    run = work / "runs" / "tg_seed0"  # no step trained, nothing logged or saved
    assert not (run / "metrics.jsonl").exists() and not (run / "rl_summary.json").exists()
    assert not [p for p in (run / "checkpoints").glob("*") if p.name.isdigit()]
    assert json.loads((work / "sft_eval.json").read_text())  # the stages before RL ran
