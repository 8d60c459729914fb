"""The main job on the SWE environment from a tiny random Hugging Face checkpoint.

`python -m tg_jax.main --config=configs/hf_swe.py:runlocal --config.model.hf_checkpoint=DIR`
on 8 simulated devices (fsdp 4 x tensor 2): the data stage writes SWE task records, two TG
steps run with repository episodes (file tools, sandboxed test runs), then the held-out
evaluation, the report and the export.
"""

import json

from tests.hf_checkpoints import make_model_dir
from tests.test_hf_run import _command, _run
from tg_jax.models import ModelConfig

# Repository prompts and tool outputs need a longer context than the coding tasks.
SWE_DENSE = ModelConfig(
    vocab_size=8, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    mlp_dim=64, max_seq_len=2048, tie_embeddings=False,
)  # fmt: skip


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
