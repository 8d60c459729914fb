"""The main job with the frozen teacher, and configs/fence.py, as a user runs them.

`python -m tg_jax.main --config=configs/tiny.py --config.tg.teacher_params=reference`: the TG
arm's teacher forward runs on the base model's params at every step while the policy moves
(the train metrics tg_teacher_param_norm and tg_teacher_drift); and a smoke run of
`configs/fence.py:runlocal` (SFT, both arms, held-out evaluation, report).
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

from tests.test_pipeline import FAST_PIPELINE
from tg_jax.models import checkpoint_io

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _main(config: str, workdir, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tg_jax.main", f"--config={config}", f"--workdir={workdir}",
           *extra]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _norm(path: str) -> float:
    params, _ = checkpoint_io.load_hf_checkpoint(path)
    return float(optax.tree.norm(jax.tree.map(np.asarray, params)))


@pytest.mark.e2e
def test_tiny_pipeline_with_the_reference_teacher(tmp_path):
    work = tmp_path / "w"
    fast = {**FAST_PIPELINE, "rl_loop.steps": 3}
    overrides = [f"--config.{k}={v}" for k, v in fast.items()]
    _main("configs/tiny.py", work, "--config.stage=pipeline", "--config.pipeline.arms=('tg',)",
          "--config.tg.teacher_params=reference", *overrides)  # fmt: skip
    run = work / "runs" / "tg_seed0"
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    train = [m for m in metrics if m.get("stage") == "train"]
    assert [m["step"] for m in train] == [1, 2, 3]
    assert json.loads((run / "rl_summary.json").read_text())["finished"]
    # The teacher ran on the base model's params at every step...
    base = _norm(str(work / "base_model"))
    for m in train:
        np.testing.assert_allclose(m["tg_teacher_param_norm"], base, rtol=1e-5)
    # ...while the policy moved away from them (drift 0 at step 1: the policy is the base).
    drift = [m["tg_teacher_drift"] for m in train]
    assert drift[0] == 0.0 and 0.0 < drift[1] < drift[2], drift
    assert abs(_norm(str(work / "export" / "tg_seed0")) - base) > 1e-4
    assert all(m["update_skipped"] == 0.0 for m in train)


@pytest.mark.e2e
def test_fence_config_runlocal_smoke(tmp_path):
    work = tmp_path / "w"
    out = _main("configs/fence.py:runlocal", work).stdout
    for arm in ("grpo", "tg"):
        summary = json.loads((work / "runs" / f"{arm}_seed0" / "rl_summary.json").read_text())
        assert summary["finished"] and summary["step"] == 4, summary
        assert (work / "export" / f"{arm}_seed0" / "model.safetensors").exists()
    tg = [json.loads(line) for line in open(work / "runs" / "tg_seed0" / "metrics.jsonl")]
    assert all("tg_kl/fence" in m for m in tg if m.get("stage") == "train")
    assert "held-out" in out and (work / "report" / "report.md").exists()
    # The config's forced fences reached the SFT data (sft.transcripts.p_forced).
    data = json.loads((work / "sft" / "sft_summary.json").read_text())["data"]
    assert data["frac_forced"] > 0, data
