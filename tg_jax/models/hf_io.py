"""Conversion between Hugging Face Qwen3 / Qwen3-MoE `config.json` dicts and `ModelConfig`.

The weights' names and layouts are `tg_jax.models.checkpoint_io`'s (safetensors import and
export, and `params_from_tensors` for tensors in memory).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tg_jax.models.config import ModelConfig


def model_config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """ModelConfig from a Hugging Face Qwen3 / Qwen3-MoE `config.json` dict.

    Raises for options this model does not implement (rather than importing a checkpoint that
    would compute something else): rope scaling, sliding-window attention, attention biases,
    and MoE checkpoints with dense layers (`mlp_only_layers`, `decoder_sparse_step` > 1).
    """
    rope = dict(hf.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    unsupported = {
        "rope_scaling": hf.get("rope_scaling") not in (None, {}),
        f"rope_type={rope_type!r}": rope_type != "default",
        "use_sliding_window": bool(hf.get("use_sliding_window", False)),
        "attention_bias": bool(hf.get("attention_bias", False)),
        "hidden_act != silu": hf.get("hidden_act", "silu") != "silu",
    }
    num_experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    if num_experts:
        unsupported["mlp_only_layers"] = bool(hf.get("mlp_only_layers"))
        unsupported["decoder_sparse_step != 1"] = hf.get("decoder_sparse_step", 1) != 1
    bad = sorted(name for name, is_bad in unsupported.items() if is_bad)
    if bad:
        raise NotImplementedError(f"Unsupported Qwen3 config options: {bad}")
    fields = dict(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        mlp_dim=hf.get("intermediate_size", 0),
        rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 1e6))),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=hf.get("max_position_embeddings", 4096),
    )
    if num_experts:
        # transformers 5 writes `num_local_experts`; hub checkpoints say `num_experts`.
        fields.update(
            num_experts=num_experts,
            experts_per_token=hf["num_experts_per_tok"],
            moe_mlp_dim=hf["moe_intermediate_size"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)),
        )
    fields.update(overrides)
    return ModelConfig(**fields)


def model_config_to_hf(cfg: ModelConfig, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A Hugging Face `config.json` dict for `cfg`, on top of `base` (e.g. the imported one).

    Keys of `base` that are not architecture (token ids, generation defaults) are kept.
    """
    out = dict(base or {})
    for key in ("rope_scaling", "torch_dtype", "num_local_experts", "num_experts"):
        out.pop(key, None)
    out.update(
        model_type="qwen3_moe" if cfg.is_moe else "qwen3",
        architectures=["Qwen3MoeForCausalLM" if cfg.is_moe else "Qwen3ForCausalLM"],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        rope_theta=cfg.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=cfg.max_seq_len,
        attention_bias=False,
        use_sliding_window=False,
        dtype=cfg.param_dtype,
    )
    if cfg.mlp_dim:
        out["intermediate_size"] = cfg.mlp_dim
    if cfg.is_moe:
        out.update(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.experts_per_token,
            moe_intermediate_size=cfg.moe_mlp_dim,
            norm_topk_prob=cfg.norm_topk_prob,
            router_aux_loss_coef=cfg.router_aux_loss_coef,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return out
