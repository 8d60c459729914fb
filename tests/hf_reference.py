"""Builds small random Hugging Face Qwen3 models and the matching tg_jax params (tests only)."""

from __future__ import annotations

import numpy as np

from tg_jax.models import ModelConfig
from tg_jax.models.checkpoint_io import params_from_tensors


def make_hf_qwen3(cfg: ModelConfig, seed: int = 0, std: float = 0.1):
    """A random `Qwen3ForCausalLM` in fp32 with the architecture of `cfg`, plus our params."""
    import torch
    import transformers

    hf_cfg = transformers.Qwen3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.mlp_dim,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=cfg.max_seq_len,
        attention_bias=False,
        use_sliding_window=False,
    )
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(hf_cfg).eval().to(torch.float32)
    # Random norms too, so that a wrong norm placement cannot hide behind weights of 1.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    params = params_from_tensors(state, cfg)
    return model, params


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(np.asarray(tokens, np.int64)))
    return out.logits.numpy()
