"""RL runs in worker processes (`pipeline.workers`): the same results as in turn, failures and
SIGTERM lose nothing, and the user's command runs it."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tg_jax import checkpointing, config_lib
from tg_jax.train import pipeline, workers

from .test_pipeline import FAST_PIPELINE, _config

ROOT = os.path.join(os.path.dirname(__file__), "..")
BASE_FILES = ("tfds", "sft", "sft_eval.json", "base_model")


def _runs_metrics(workdir):
    """Per run: the held-out file's text and the training metrics without wall-clock fields."""
    out = {}
    for run in sorted(os.listdir(os.path.join(workdir, "runs"))):
        d = os.path.join(workdir, "runs", run)
        with open(os.path.join(d, "heldout.jsonl")) as f:
            heldout = f.read()
        with open(os.path.join(d, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        keep = [{k: v for k, v in r.items() if "time" not in k and not k.startswith("perf/")
                 and "per_s" not in k and "memory" not in k} for r in rows]  # fmt: skip
        out[run] = (heldout, keep)
    return out


def _copy_base(src, dst):
    for name in BASE_FILES:
        p = os.path.join(src, name)
        (shutil.copytree if os.path.isdir(p) else shutil.copy)(p, os.path.join(dst, name))


def test_workers_give_the_results_of_runs_in_turn(tmp_path):
    config = config_lib.apply_overrides(_config(), {"rl_loop.steps": 2})
    seq, par = str(tmp_path / "seq"), str(tmp_path / "par")
    res_seq = pipeline.run_pipeline(config, seq)
    os.makedirs(par)
    _copy_base(seq, par)  # the same base model: only the RL runs differ in how they ran
    res_par = pipeline.run_pipeline(
        config_lib.apply_overrides(config, {"pipeline.workers": 2}), par
    )
    a, b = _runs_metrics(seq), _runs_metrics(par)
    assert sorted(a) == ["grpo_seed0", "tg_seed0"] and a == b
    assert any("loss" in k for k in a["tg_seed0"][1][-1])  # metrics compared, not empty rows
    for arm in ("grpo", "tg"):
        assert res_par["arms"][arm]["heldout"] == res_seq["arms"][arm]["heldout"]
        assert os.path.exists(os.path.join(par, "runs", f"{arm}_seed0", workers.LOG_FILE))
    ctx = res_par["context"]
    assert ctx["workers"] == 2 and ctx["parallel_rl_wall_s"] > 0
    assert res_seq["context"]["parallel_rl_wall_s"] is None
    with open(os.path.join(par, "report", "report.md")) as f:
        assert "RL runs in 2 worker processes" in f.read()


def test_a_failed_worker_stops_the_others_and_a_rerun_resumes(tmp_path):
    config = config_lib.apply_overrides(_config(), {"pipeline.workers": 2})
    workdir = str(tmp_path)
    pipeline.run_base_model(config, workdir)  # SFT in this process
    pipeline.base_model_dir(config, workdir, pipeline.run_data(config, workdir))
    # tg's checkpoint directory is a file: its worker fails when it saves.
    tg_dir = os.path.join(workdir, "runs", "tg_seed0")
    os.makedirs(tg_dir)
    with open(os.path.join(tg_dir, "checkpoints"), "w") as f:
        f.write("not a directory")
    with pytest.raises(workers.WorkerError, match=r"RL run tg_seed0 failed .* Last lines of"):
        pipeline.run_pipeline(config, workdir)
    assert not os.path.exists(os.path.join(tg_dir, "heldout.jsonl"))
    assert not os.path.exists(os.path.join(workdir, "report"))
    os.remove(os.path.join(tg_dir, "checkpoints"))
    res = pipeline.run_pipeline(config, workdir)
    assert set(res["arms"]) == {"grpo", "tg"}


def test_multihost_job_refuses_workers(monkeypatch):
    import jax

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match="pipeline.workers=1"):
        workers.run_parallel(_config(), "/nonexistent", [("tg", 0)], 2)


def _main(workdir, *extra):
    args = [f"--config.{k}={v}" for k, v in FAST_PIPELINE.items() if k != "rl_loop.steps"]
    return [sys.executable, "-m", "tg_jax.main", f"--config={ROOT}/configs/tiny.py",
            f"--workdir={workdir}", "--config.stage=pipeline", "--config.pipeline.workers=2",
            "--config.rl_loop.steps=6", *args, *extra]  # fmt: skip


def test_user_command_sigterm_during_workers_then_rerun_finishes(tmp_path):
    workdir = str(tmp_path / "w")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    out_path = tmp_path / "out.txt"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(_main(workdir), stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 300
    while "pipeline: started tg_seed0" not in out_path.read_text():
        assert proc.poll() is None, out_path.read_text()
        assert time.time() < deadline, out_path.read_text()
        time.sleep(0.2)
    time.sleep(3)  # the workers under way
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 143, out_path.read_text()
    text = out_path.read_text()
    assert "preempted during" in text and "Rerun the same command to resume" in text
    assert not os.path.exists(os.path.join(workdir, "report"))
    # No worker left behind, and whatever a worker had done is kept.
    for arm in ("grpo", "tg"):
        assert os.path.exists(os.path.join(workdir, "runs", f"{arm}_seed0", workers.JOB_FILE))
    rerun = subprocess.run(_main(workdir), capture_output=True, text=True, env=env, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "RL runs in 2 worker processes" in rerun.stdout
    with open(os.path.join(workdir, "report", "results.json")) as f:
        assert set(json.load(f)["arms"]) == {"grpo", "tg"}
    for arm in ("grpo", "tg"):
        with open(os.path.join(workdir, "runs", f"{arm}_seed0", "rl_summary.json")) as f:
            summary = json.load(f)
        assert summary["step"] == 6 and summary["finished"]


@pytest.fixture(autouse=True)
def _clear_preemption():
    checkpointing.clear_preemption_request()
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)
    checkpointing.clear_preemption_request()
