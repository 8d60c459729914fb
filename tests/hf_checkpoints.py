"""Random tiny Hugging Face Qwen3 / Qwen3-MoE models for checkpoint and MoE tests."""

from __future__ import annotations

import numpy as np

from tg_jax.models import ModelConfig


def make_hf_model(cfg: ModelConfig, seed: int = 0, std: float = 0.1):
    """A random fp32 `Qwen3ForCausalLM` or `Qwen3MoeForCausalLM` with the architecture of cfg.

    Norm weights are random too, so that a wrong norm mapping cannot hide behind ones.
    """
    import torch
    import transformers

    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
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
    if cfg.is_moe:
        hf_cfg = transformers.Qwen3MoeConfig(
            **common,
            intermediate_size=4 * cfg.moe_mlp_dim,
            moe_intermediate_size=cfg.moe_mlp_dim,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.experts_per_token,
            norm_topk_prob=cfg.norm_topk_prob,
            router_aux_loss_coef=cfg.router_aux_loss_coef,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        model_cls = transformers.Qwen3MoeForCausalLM
    else:
        hf_cfg = transformers.Qwen3Config(**common, intermediate_size=cfg.mlp_dim)
        model_cls = transformers.Qwen3ForCausalLM
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(hf_cfg).eval().to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(np.asarray(tokens, np.int64)))
    return out.logits.numpy()
