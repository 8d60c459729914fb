"""Issue 70's three failures as a new user met them, from the same kinds of input: small
transformers Qwen3 / Qwen3-MoE checkpoints saved by `save_pretrained` with a tokenizer trained
here (its vocabulary not rounded: 373 tokens; 5 experts) and public chat templates. Each now
runs, or is refused at start-up: exit 2, one `error:` line, well under a minute, nothing in the
workdir.

The shapes across many checkpoints, without training: tests/test_preflight.py.
"""

import dataclasses
import os
import subprocess
import sys
import time

import pytest

from tests.hf_checkpoints import chat_template, make_hf_model, make_tokenizer
from tg_jax.models import ModelConfig
from tg_jax.tpu.distributed import cpu_devices_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DENSE = ModelConfig(
    vocab_size=8, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    mlp_dim=64, max_seq_len=512, tie_embeddings=False,
)  # fmt: skip
MOE = dataclasses.replace(
    DENSE, d_model=64, num_experts=5, experts_per_token=2, moe_mlp_dim=32
)  # Qwen3-MoE, the Qwen3-Coder format; 5 experts divide no expert axis


def model_dir(path, cfg: ModelConfig, template: str, vocab: int = 373) -> ModelConfig:
    """A checkpoint directory as a user brings it (tests/hf_checkpoints.make_model_dir's),
    its vocabulary the tokenizer's own size, not rounded up to a multiple of 8."""
    import transformers

    tok = make_tokenizer(vocab)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=chat_template(template),
    ).save_pretrained(str(path))  # fmt: skip
    cfg = dataclasses.replace(cfg, vocab_size=tok.get_vocab_size(with_added_tokens=True))
    model = make_hf_model(cfg, std=0.02)
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    model.generation_config = transformers.GenerationConfig(eos_token_id=eos, pad_token_id=eos[1])
    model.save_pretrained(str(path))
    return cfg


def _main(config: str, workdir, ckpt, *extra: str, devices: int = 1):
    cmd = [sys.executable, "-m", "tg_jax.main", f"--config={config}", f"--workdir={workdir}",
           f"--config.model.hf_checkpoint={ckpt}", *extra]  # fmt: skip
    env = {**cpu_devices_env(devices), "PYTHONPATH": REPO}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    return proc, time.perf_counter() - t0


def _refused(proc, seconds: float, workdir) -> str:
    """The one error line of a start-up refusal (exit 2, under a minute, nothing written)."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and proc.stderr.rstrip().endswith(errors[0]), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert seconds < 60, seconds
    assert os.listdir(workdir) == []  # the workdir is made, nothing written in it
    return errors[0]


@pytest.mark.e2e
def test_a_users_requirement_in_place_of_the_defaults_is_refused_naming_the_weight(tmp_path):
    """`--config.env.requirements="('my_rules:no_shouting',)"` on configs/hf_tg.py:runlocal
    died in the first train step (KeyError in combine_rewards); now refused at start-up,
    naming the weight and the requirement set (the weights' test: test_preflight)."""
    ckpt, work = tmp_path / "ckpt", tmp_path / "work"
    model_dir(ckpt, DENSE, "qwen3")
    proc, seconds = _main(
        "configs/hf_tg.py:runlocal", work, ckpt,
        "--config.env.requirements=('tests.plugin_example:no_shouting',)",
    )  # fmt: skip
    error = _refused(proc, seconds, work)
    assert error.startswith("error: invalid config: rl.reward_weights weighs 'tool_json'")
    assert "('no_shouting',)" in error and "set rl.reward_weights.tool_json=0" in error


@pytest.mark.e2e
def test_head_dim_16_on_vllm_is_refused_naming_the_engine(tmp_path):
    """A ChatML checkpoint with head_dim 16 and rollout_engine=vllm died in its first
    sampling call (vLLM's CPU attention runs 32..512); now refused at start-up."""
    pytest.importorskip("vllm")
    ckpt, work = tmp_path / "ckpt", tmp_path / "work"
    model_dir(ckpt, DENSE, "qwen3")
    proc, seconds = _main(
        "configs/hf_tg.py:runlocal", work, ckpt, "--config.rl_loop.rollout_engine=vllm"
    )
    error = _refused(proc, seconds, work)
    assert "the checkpoint's head_dim is 16" in error
    assert "set rl_loop.rollout_engine=builtin" in error


@pytest.mark.e2e
@pytest.mark.slow
def test_a_vocabulary_of_373_and_5_experts_run_the_split_layout_to_its_export(tmp_path):
    """A Qwen3-MoE checkpoint (Qwen3-Coder template) with 373 tokens and 5 experts through
    `:runlocal_split` (trainer 4 + sampler 4 devices, the sampler's "tensor" 2), the trainer's
    mesh fsdp 2 x expert 2: the sampler's copy of the [373, 64] embedding raised
    IndivisibleError, and 5 experts over "expert" 2 were refused at start-up (the experts'
    shard_map took even slices only); the vocabulary is now replicated over "tensor", the
    experts over "expert", and the run reaches its export (26 s here, 2 cores; 47-55 s while
    they were shared, as long as the 4-expert, default-mesh run it replaced then)."""
    ckpt, work = tmp_path / "ckpt", tmp_path / "work"
    assert model_dir(ckpt, MOE, "qwen3_coder").vocab_size == 373
    proc, _ = _main(
        "configs/qwen3_coder_30b_a3b_tg.py:runlocal_split", work, ckpt,
        "--config.mesh.shape=(1, 2, 1, 2)", devices=8,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "does not divide mesh axis 'tensor' (2): replicated over it" in proc.stderr
    assert (
        "the trainer: ['layers']['mlp']['gate_proj'] dimension 1 (5) does not divide mesh axis "
        "'expert' (2): replicated over it (model.num_experts 5"
    ) in proc.stderr
    assert (work / "export" / "tg_seed0" / "model.safetensors").exists()
    assert (work / "report" / "report.md").exists()
