"""Conversion between Hugging Face Qwen3 state dicts and tg_jax params.

HF stores per-layer 2-D torch Linear weights ([out, in]); tg_jax stores per-head 3-D
kernels ([in, heads, head_dim]) stacked over layers (the scanned "layers" axis). These
functions convert name by name on host numpy arrays; `tg_jax.models.checkpoint_io` (HF
safetensors import/export) builds on them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from tg_jax.models.config import ModelConfig


def model_config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """ModelConfig from a Hugging Face Qwen3 / Qwen3-MoE `config.json` dict."""
    fields = dict(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        mlp_dim=hf.get("intermediate_size", 0),
        rope_theta=float(
            hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 1e6))
        ),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=hf.get("max_position_embeddings", 4096),
    )
    if hf.get("num_experts"):
        fields.update(
            num_experts=hf["num_experts"],
            experts_per_token=hf["num_experts_per_tok"],
            moe_mlp_dim=hf["moe_intermediate_size"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)),
        )
    fields.update(overrides)
    return ModelConfig(**fields)


def _layer(i: int) -> str:
    return f"model.layers.{i}."


def params_from_hf(
    get: Callable[[str], np.ndarray], cfg: ModelConfig, dtype=np.float32
) -> dict[str, Any]:
    """Builds the (dense) tg_jax param tree from `get(hf_name) -> array`.

    `get` lets callers read tensors lazily (one safetensors slice at a time).
    """
    if cfg.is_moe:
        raise NotImplementedError("Use tg_jax.models.checkpoint_io for MoE checkpoints.")
    d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def stack(fn):
        return np.stack([fn(i) for i in range(cfg.num_layers)]).astype(dtype)

    def w(name):
        return np.asarray(get(name))

    layers = {
        "attn": {
            "q_proj": stack(lambda i: w(_layer(i) + "self_attn.q_proj.weight").T.reshape(d, n, h)),
            "k_proj": stack(lambda i: w(_layer(i) + "self_attn.k_proj.weight").T.reshape(d, k, h)),
            "v_proj": stack(lambda i: w(_layer(i) + "self_attn.v_proj.weight").T.reshape(d, k, h)),
            "o_proj": stack(lambda i: w(_layer(i) + "self_attn.o_proj.weight").T.reshape(n, h, d)),
            "q_norm": {"scale": stack(lambda i: w(_layer(i) + "self_attn.q_norm.weight"))},
            "k_norm": {"scale": stack(lambda i: w(_layer(i) + "self_attn.k_norm.weight"))},
        },
        "attn_norm": {"scale": stack(lambda i: w(_layer(i) + "input_layernorm.weight"))},
        "mlp_norm": {"scale": stack(lambda i: w(_layer(i) + "post_attention_layernorm.weight"))},
        "mlp": {
            "gate_proj": stack(lambda i: w(_layer(i) + "mlp.gate_proj.weight").T),
            "up_proj": stack(lambda i: w(_layer(i) + "mlp.up_proj.weight").T),
            "down_proj": stack(lambda i: w(_layer(i) + "mlp.down_proj.weight").T),
        },
    }
    params = {
        "embed": w("model.embed_tokens.weight").astype(dtype),
        "layers": layers,
        "final_norm": {"scale": w("model.norm.weight").astype(dtype)},
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = w("lm_head.weight").T.astype(dtype)
    return params


def params_to_hf(params: Mapping[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The inverse of `params_from_hf` (dense models): HF name -> numpy array."""
    if cfg.is_moe:
        raise NotImplementedError("Use tg_jax.models.checkpoint_io for MoE checkpoints.")
    d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    lay = params["layers"]
    out = {"model.embed_tokens.weight": np.asarray(params["embed"])}
    for i in range(cfg.num_layers):
        p = _layer(i)
        a = lay["attn"]
        out[p + "self_attn.q_proj.weight"] = np.asarray(a["q_proj"][i]).reshape(d, n * h).T
        out[p + "self_attn.k_proj.weight"] = np.asarray(a["k_proj"][i]).reshape(d, k * h).T
        out[p + "self_attn.v_proj.weight"] = np.asarray(a["v_proj"][i]).reshape(d, k * h).T
        out[p + "self_attn.o_proj.weight"] = np.asarray(a["o_proj"][i]).reshape(n * h, d).T
        out[p + "self_attn.q_norm.weight"] = np.asarray(a["q_norm"]["scale"][i])
        out[p + "self_attn.k_norm.weight"] = np.asarray(a["k_norm"]["scale"][i])
        out[p + "input_layernorm.weight"] = np.asarray(lay["attn_norm"]["scale"][i])
        out[p + "post_attention_layernorm.weight"] = np.asarray(lay["mlp_norm"]["scale"][i])
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[p + f"mlp.{name}.weight"] = np.asarray(lay["mlp"][name][i]).T
    out["model.norm.weight"] = np.asarray(params["final_norm"]["scale"])
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = np.asarray(params["lm_head"]).T
    return {name: np.ascontiguousarray(v) for name, v in out.items()}
