"""The main job from a user's Hugging Face checkpoint, as a user runs it.

Tiny random Qwen3 / Qwen3-MoE checkpoints saved by transformers' `save_pretrained`, with a
tokenizer trained here and Qwen3's chat template, go through `python -m tg_jax.main
--config=configs/hf_tg.py:runlocal --config.model.hf_checkpoint=DIR` on 8 simulated devices
(fsdp 4 x tensor 2): TG steps, a SIGTERM and a resume, the held-out evaluation, the report and
the export, which transformers loads with logits equal to ours.
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests.hf_checkpoints import hf_logits, make_model_dir
from tg_jax.models import ModelConfig, Transformer, checkpoint_io, hf_dir
from tg_jax.tpu.distributed import cpu_devices_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DENSE = ModelConfig(
    vocab_size=8, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    mlp_dim=64, max_seq_len=512, tie_embeddings=False,
)  # fmt: skip
MOE = ModelConfig(
    vocab_size=8, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    mlp_dim=64, max_seq_len=512, num_experts=4, experts_per_token=2, moe_mlp_dim=32,
    tie_embeddings=True,
)  # fmt: skip
MESH = "--config.mesh.shape=(1,4,2,1)"  # fsdp 4 x tensor 2 on the 8 simulated devices


def _command(config: str, workdir, ckpt, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "tg_jax.main", f"--config={config}", f"--workdir={workdir}",
        f"--config.model.hf_checkpoint={ckpt}", MESH, *extra,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    # 8 CPU devices: :runlocal_split trains on 4 and samples on the other 4.
    return {**cpu_devices_env(8), "PYTHONPATH": REPO}


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _check_export(export: str, source: str, trained_from: str) -> None:
    """transformers loads the export, its logits equal ours, its tokenizer round-trips, and
    the weights moved away from the starting checkpoint."""
    import transformers

    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert os.path.exists(os.path.join(export, name)), name
    params, cfg = checkpoint_io.load_hf_checkpoint(export)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12))
    ours = np.asarray(jax.jit(Transformer(cfg).apply)({"params": params}, tokens))
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype="float32").eval()
    np.testing.assert_allclose(hf_logits(model, tokens), ours, atol=1e-4, rtol=1e-4)
    tok = transformers.AutoTokenizer.from_pretrained(export)
    text = 'def f(x):\n    return 2 * x  # ünïcode <tool_call>{"name": "submit"}</tool_call>'
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    src = transformers.AutoTokenizer.from_pretrained(source)
    assert tok.encode(text, add_special_tokens=False) == src.encode(text, add_special_tokens=False)
    start, _ = checkpoint_io.load_hf_checkpoint(trained_from)
    moved = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - b))), params, start)
    assert max(jax.tree.leaves(moved)) > 0, "the exported policy equals the starting checkpoint"


def _wait_for(path: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    t0 = time.time()
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() - t0 < timeout, f"{path} did not appear"
        time.sleep(0.2)


@pytest.mark.e2e
def test_hf_tg_runlocal_sigterm_resume_export(tmp_path):
    """configs/hf_tg.py:runlocal from a dense checkpoint: SIGTERM after the first checkpoint,
    the same command resumes, the export loads in transformers (a Qwen3-MoE checkpoint through
    a SIGTERM and resume: tests/test_gcs.py's pods; its export in transformers: below)."""
    ckpt, work = tmp_path / "ckpt", tmp_path / "work"
    make_model_dir(ckpt, DENSE)
    # 6 steps: the SIGTERM after the first checkpoint lands well before the last step (with 3,
    # a fast run could finish its steps first: then the pipeline stops before the evaluation
    # and the rerun only evaluates, a valid path but not the resume this test is about).
    cmd = _command("configs/hf_tg.py:runlocal", work, ckpt, "--config.rl_loop.steps=6",
                   "--config.optim.total_steps=6")  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    run_dir = work / "runs" / "tg_seed0"
    _wait_for(str(run_dir / "checkpoints" / "1"), proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 143, err[-3000:]
    assert "preempted during RL run tg seed 0" in err
    assert not (work / "export").exists() and not (work / "report").exists()
    out = _run(cmd).stdout  # the same command resumes and finishes
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    train_steps = [m["step"] for m in metrics if m.get("stage") == "train"]
    assert train_steps == [1, 2, 3, 4, 5, 6], train_steps  # resumed, no step lost or repeated
    sessions = json.loads((run_dir / "rl_summary.json").read_text())["sessions"]
    assert len(sessions) == 2 and sessions[1]["start_step"] >= 1, sessions
    assert "held-out" in out and (work / "report" / "report.md").exists()
    report = (work / "report" / "report.md").read_text()
    assert "One arm, no comparison" in report
    _check_export(str(work / "export" / "tg_seed0"), str(ckpt), str(ckpt))


@pytest.mark.e2e
@pytest.mark.parametrize(
    "config,arch",
    [("configs/qwen3_1p7b_tg.py:runlocal", DENSE),
     ("configs/qwen3_coder_30b_a3b_tg.py:runlocal_split", MOE)],
)  # fmt: skip
def test_qwen3_configs_one_step_from_checkpoint(tmp_path, config, arch):
    """One TG step of each TPU config's tiny variant (the 30B one in its split layout: the
    trainer on 4 devices, the sampler on the other 4, 2 data x 2 tensor, at most 2 rows per
    sampler call; its colocated `:runlocal`: tests/test_chat_format_runs.py)."""
    ckpt, work = tmp_path / "ckpt", tmp_path / "work"
    make_model_dir(ckpt, arch)
    extra = [
        "--config.rl_loop.steps=1",
        "--config.optim.total_steps=1",
        "--config.eval.num_tasks=2",
    ]
    cmd = _command(config, work, ckpt, *extra)
    if config.endswith("_split"):  # the trainer's 4 devices: fsdp 2 x tensor 2
        cmd[cmd.index(MESH)] = "--config.mesh.shape=(1,2,2,1)"
        cmd.append("--config.sampler_mesh.max_rows=2")  # a step's 4 rows in 2 sampler calls
    _run(cmd)
    summary = json.loads((work / "runs" / "tg_seed0" / "rl_summary.json").read_text())
    assert summary["step"] == 1 and summary["finished"]
    _check_export(str(work / "export" / "tg_seed0"), str(ckpt), str(ckpt))


@pytest.mark.e2e
def test_checkpoint_that_does_not_match_the_config_is_a_clear_error(tmp_path):
    ckpt = tmp_path / "ckpt"
    make_model_dir(ckpt, DENSE)
    # The 1.7B config expects Qwen3-1.7B's architecture: a tiny checkpoint is refused.
    proc = subprocess.run(
        _command("configs/qwen3_1p7b_tg.py", tmp_path / "w", ckpt), cwd=REPO, env=_env(),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "model.vocab_size = 151936" in proc.stderr and "config.json" in proc.stderr
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(hf_dir.ModelDirError, match="tokenizer.json: missing"):
        hf_dir.open_model_dir(str(ckpt))
