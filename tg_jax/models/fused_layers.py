"""The model's layer math on fused weights: what every cached path runs per layer.

The decode path (`tg_jax.models.decode`: prefill, decode steps, `forward_from_prefix`) and the
engine's paged calls (`tg_jax.engine.paged`) differ only in where keys and values live; the
math of a layer is this module's, on `DecodeWeights` (the model's params with q/k/v and
gate/up fused into single matmuls: fewer, larger matmuls, the decode step being latency-bound
on CPU). It is the model's `DecoderLayer` math (`tg_jax.models.qwen3`: its `RMSNorm`, RoPE
tables and feed-forward modules applied to the same params), split where a path puts its
cache in between:

  embed                     token embedding [B, T, D]
  attention_inputs          pre-norm, fused q/k/v, q/k RMSNorm and RoPE: q, k, v
  (the path's cache write and attention, `tg_jax.models.attention.attend`)
  attention_output_and_ffn  output projection, residual, pre-norm feed-forward, residual
                            (`ffn_recording`: the same, appending an MoE layer's routing)
  output_logits             final norm and unembedding: fp32 logits [B, V]

Shape letters: the legend in `tg_jax.models`.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from tg_jax.models.layers import RMSNorm, apply_rope
from tg_jax.models.qwen3 import Transformer, make_ffn

Array = jax.Array


@flax.struct.dataclass
class DecodeWeights:
    """The model's params rearranged once per sampling call for the decode loop.

    Attributes:
      layers: per layer, {"attn_norm", "q_norm", "k_norm", "mlp_norm": RMSNorm params,
        "qkv": [D, Q] fused q/k/v projection, "o": [N * H, D], and for a dense
        model "gate_up": [D, 2F] fused and "down": [F, D]; for MoE "mlp": the layer's params}.
      unembed: [D, V] output projection (the embedding transposed when tied).
      params: the full params (embedding, final norm).
    """

    layers: tuple[dict[str, Any], ...]
    unembed: Array
    params: Any


def stacked_layer_weights(model: Transformer, params: Any) -> dict[str, Any]:
    """The layers' weights in `DecodeWeights.layers`' per-layer form, stacked [L, ...] (q/k/v
    and gate/up fused): what a `lax.scan` over the layers takes."""
    cfg = model.config
    dt = cfg.jnp_dtype
    d, n_layers = cfg.d_model, cfg.num_layers
    lp = params["layers"]
    ap = lp["attn"]
    qkv = [ap[name].reshape(n_layers, d, -1) for name in ("q_proj", "k_proj", "v_proj")]
    w = {
        "attn_norm": lp["attn_norm"],
        "mlp_norm": lp["mlp_norm"],
        "q_norm": ap["q_norm"],
        "k_norm": ap["k_norm"],
        "qkv": jnp.concatenate(qkv, axis=2).astype(dt),
        "o": ap["o_proj"].reshape(n_layers, -1, d).astype(dt),
    }
    if cfg.is_moe:
        w["mlp"] = lp["mlp"]
    else:
        mp = lp["mlp"]
        w["gate_up"] = jnp.concatenate([mp["gate_proj"], mp["up_proj"]], axis=2).astype(dt)
        w["down"] = mp["down_proj"].astype(dt)
    return w


def decode_weights(model: Transformer, params: Any) -> DecodeWeights:
    """Slices the stacked layer params and fuses q/k/v and gate/up into single matmuls.

    Fewer, larger matmuls per step: the decode step is latency-bound on CPU. Called inside the
    jitted sampler, before the loop, so it costs one copy of the weights per call.
    """
    cfg = model.config
    stacked = stacked_layer_weights(model, params)
    layers = [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(cfg.num_layers)]
    # [D, V] for `hidden @ unembed`: with the tied [V, D] embedding used transposed, XLA:CPU
    # repacked it every step.
    unembed = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    return DecodeWeights(tuple(layers), unembed.astype(cfg.jnp_dtype), params)


def rms_norm(cfg, x: Array, norm_params: Any) -> Array:
    """The model's `RMSNorm` with the given params."""
    return RMSNorm(cfg.rms_norm_eps, cfg.jnp_param_dtype).apply({"params": norm_params}, x)


def embed(model: Transformer, weights: DecodeWeights, tokens_BxT: Array) -> Array:
    """Token embedding [B, T, D] (the model's `embed_tokens`)."""
    return model.apply({"params": weights.params}, tokens_BxT, method=Transformer.embed_tokens)


def attention_inputs(cfg, w: dict[str, Any], x_BxTxD: Array, cos: Array, sin: Array):
    """Pre-norm, fused q/k/v projection, q/k RMSNorm and RoPE (`rope_tables`' cos, sin) of one
    layer: (q [B, T, N, H], k [B, T, K, H], v [B, T, K, H])."""
    n, n_kv, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    b, t = x_BxTxD.shape[:2]
    qkv_BxTxQ = rms_norm(cfg, x_BxTxD, w["attn_norm"]).astype(cfg.jnp_dtype) @ w["qkv"]
    q_BxTxNxH = qkv_BxTxQ[..., : n * h].reshape(b, t, n, h)
    k_BxTxKxH = qkv_BxTxQ[..., n * h : (n + n_kv) * h].reshape(b, t, n_kv, h)
    v_BxTxKxH = qkv_BxTxQ[..., (n + n_kv) * h :].reshape(b, t, n_kv, h)
    q_BxTxNxH = apply_rope(rms_norm(cfg, q_BxTxNxH, w["q_norm"]), cos, sin)
    k_BxTxKxH = apply_rope(rms_norm(cfg, k_BxTxKxH, w["k_norm"]), cos, sin)
    return q_BxTxNxH, k_BxTxKxH, v_BxTxKxH


def attention_output_and_ffn(
    cfg,
    w: dict[str, Any],
    x_BxTxD: Array,
    attn_BxTxNxH: Array,
    replay_BxTxJ: Array | None = None,
    routes: bool = False,
):
    """The rest of one layer: output projection and residual, pre-norm feed-forward and
    residual (SwiGLU with fused gate/up, or the MoE block, routed by `replay_BxTxJ` where
    given: `tg_jax.models.moe.replay`). routes (MoE): (x, the experts each token was routed to
    [B, T, J] int32) instead of x."""
    dt = cfg.jnp_dtype
    b, t = attn_BxTxNxH.shape[:2]
    x_BxTxD = x_BxTxD + attn_BxTxNxH.reshape(b, t, -1) @ w["o"]
    hid_BxTxD = rms_norm(cfg, x_BxTxD, w["mlp_norm"])
    if cfg.is_moe and routes:  # the router's choices are sown only where they are asked for
        ffn, state = make_ffn(cfg, "mlp").apply(
            {"params": w["mlp"]}, hid_BxTxD, replay_BxTxJ, mutable=["intermediates"]
        )
        return x_BxTxD + ffn, state["intermediates"]["router_ids"][0]
    if cfg.is_moe:
        ffn = make_ffn(cfg, "mlp").apply({"params": w["mlp"]}, hid_BxTxD, replay_BxTxJ)
    else:
        gate_BxTxF, up_BxTxF = jnp.split(hid_BxTxD.astype(dt) @ w["gate_up"], 2, axis=-1)
        ffn = (jax.nn.silu(gate_BxTxF) * up_BxTxF) @ w["down"]
    return x_BxTxD + ffn


def ffn_recording(cfg, w, x_BxTxD: Array, out_BxTxNxH: Array, ids: list | None) -> Array:
    """`attention_output_and_ffn`; with a list `ids`, the layer's routing [B, T, J] appended."""
    if ids is None:
        return attention_output_and_ffn(cfg, w, x_BxTxD, out_BxTxNxH)
    x_BxTxD, ids_BxTxJ = attention_output_and_ffn(cfg, w, x_BxTxD, out_BxTxNxH, routes=True)
    ids.append(ids_BxTxJ)
    return x_BxTxD


def output_logits(cfg, weights: DecodeWeights, x_BxD: Array) -> Array:
    """Final norm and unembedding: fp32 logits [B, V]."""
    x_BxD = rms_norm(cfg, x_BxD, weights.params["final_norm"]).astype(cfg.jnp_dtype)
    return (x_BxD @ weights.unembed).astype(jnp.float32)


__all__ = [
    "DecodeWeights",
    "attention_inputs",
    "attention_output_and_ffn",
    "decode_weights",
    "embed",
    "ffn_recording",
    "output_logits",
    "rms_norm",
    "stacked_layer_weights",
]
