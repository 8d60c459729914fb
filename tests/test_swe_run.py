"""The main job on the SWE environment from a tiny random Hugging Face checkpoint.

`python -m tg_jax.main --config=configs/hf_swe.py:runlocal --config.model.hf_checkpoint=DIR`
on 8 simulated devices (fsdp 4 x tensor 2): the data stage writes SWE task records, two TG
steps run with repository episodes (file tools, sandboxed test runs), then the held-out
evaluation, the report and the export.
"""

import json
import subprocess
import sys

import pytest

from tests.hf_checkpoints import make_model_dir
from tests.test_hf_run import REPO, _command, _run
from tg_jax.models import ModelConfig
from tg_jax.tpu.distributed import cpu_devices_env

# Repository prompts and tool outputs need a longer context than the coding tasks.
SWE_DENSE = ModelConfig(
    vocab_size=8, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    mlp_dim=64, max_seq_len=2048, tie_embeddings=False,
)  # fmt: skip


@pytest.mark.e2e
def test_hf_swe_runlocal_two_tg_steps(tmp_path):
    ckpt, work = tmp_path / "ckpt", tmp_path / "work"
    make_model_dir(ckpt, SWE_DENSE)
    out = _run(_command("configs/hf_swe.py:runlocal", work, ckpt)).stdout
    run_dir = work / "runs" / "tg_seed0"
    summary = json.loads((run_dir / "rl_summary.json").read_text())
    assert summary["step"] == 2 and summary["finished"], summary
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    train = [m for m in metrics if m.get("stage") == "train"]
    assert [m["step"] for m in train] == [1, 2]
    # The episodes were SWE episodes: the tool actions and SWE requirements were counted.
    assert any("rollout/actions/malformed" in m for m in train), sorted(train[0])
    assert any(k.startswith("rollout/compliance/tool_protocol") for k in train[0]), sorted(train[0])
    assert (work / "tfds" / "task_dataset").exists()
    assert "held-out" in out and (work / "report" / "report.md").exists()
    assert (work / "export" / "tg_seed0" / "model.safetensors").exists()


@pytest.mark.e2e
def test_the_byte_model_s_main_job_on_the_swe_environment(tmp_path):
    """`python -m tg_jax.main --config=configs/swe.py:runlocal` on one CPU device, as a user's
    CPU run (8 devices on the SWE environment: the test above): the base model's SFT on the SWE
    expert's transcripts (some hinted), both arms on repository episodes, and the report's
    side-effect table per arm (the scenarios of the third tier: approved tasks, explaining)."""
    work = tmp_path / "w"
    cmd = [
        sys.executable, "-m", "tg_jax.main", "--config=configs/swe.py:runlocal",
        f"--workdir={work}", "--config.rl_loop.steps=1", "--config.eval.num_tasks=2",
    ]  # fmt: skip
    env = {**cpu_devices_env(1), "PYTHONPATH": REPO}  # the arms share their compiled programs
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    data = json.loads((work / "sft" / "sft_summary.json").read_text())["data"]
    assert data["num_transcripts"] == 24 and 0 < data["frac_hinted"] < 1, data
    base = json.loads((work / "sft_eval.json").read_text())
    assert {"unprompted_compliance/explain_change", "hinted_compliance/ask_first"} <= set(base)
    for arm in ("grpo", "tg"):
        metrics = [
            json.loads(line) for line in open(work / "runs" / f"{arm}_seed0" / "metrics.jsonl")
        ]
        train = [m for m in metrics if m.get("stage") == "train"]
        assert [m["step"] for m in train] == [1]
        assert "rollout/actions/malformed" in train[0], sorted(train[0])
    report = (work / "report" / "report.md").read_text()
    table = report.split("## Side effects: actions per held-out episode")[1].split("\n## ")[0]
    head = next(line for line in table.splitlines() if line.startswith("| arm |"))
    assert {"asked_when_approved", "stopped_after_ask", "stopped_after_explain"} <= {
        c.strip() for c in head.split("|")
    }
    assert [
        r.split("|")[1].strip() for r in table.splitlines() if r.startswith(("| grpo", "| tg"))
    ] == ["grpo", "tg"]
    assert "held-out" in out
