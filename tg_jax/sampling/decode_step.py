"""The sampler's KV cache: prefill with the model, then one token per row per step.

Prefill runs `tg_jax.models` itself (the Qwen3 `Transformer` with its own cache, slot index ==
position). Decode steps run the same layers (the model's `RMSNorm`, `rope`, feed-forward and
unembedding modules, applied to the model's params) over a cache laid out for the decode loop:

  per layer k: [B, K, Dh, P + N], v: [B, K, P + N, Dh]  (batch, kv heads, head dim, slots)
  slots 0..P-1:   the prompt block, slot == position (row b's prompt is slots 0..L_b-1)
  slot  P + i:    generated token i of EVERY row (its position is L_b + i)

so each step writes one shared column with an in-place `dynamic_update_slice`, and a mask says
which slots a row sees (its prompt slots < L_b and generated slots P..P+i). The RoPE cos / sin
of every position 0..P+N-1 are computed once at prefill and a step gathers its rows' entries
(computed inside the step, XLA repeated the trigonometry in every fusion that used them).
Layers are unrolled with one cache array per layer, so nothing copies the cache inside the
`while_loop`. Keys are
stored slot-minor so that q.K is a plain [G, Dh] x [Dh, S] matmul per (row, kv head): with the
model's [.., S, Dh] layout XLA:CPU's batched dot was 2x (S = 192) to 9x (S = 640) slower.

Why not `tg_jax.models.decode` for the steps: it writes each row at its own position (a
per-row scatter), and its layer `scan` slices and restacks the whole cache every step. On a
2-core CPU with the default model at batch 64 that made one step ~4x slower than this one.
Tests check this path against `models.forward` and against Hugging Face `generate`.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from tg_jax.models import Transformer
from tg_jax.models.layers import RMSNorm
from tg_jax.models.qwen3 import init_cache, make_ffn

Array = jax.Array


@flax.struct.dataclass
class DecodeCache:
    """Per-layer keys/values of prompt + generated tokens.

    Attributes:
      k: tuple of num_layers arrays [B, K, Dh, P + N] (compute dtype).
      v: tuple of num_layers arrays [B, K, P + N, Dh].
      prompt_lengths_B: [B] int32 L_b.
      rope_cos, rope_sin: [P + N, Dh / 2] f32 RoPE tables by position (`rope_tables`).
      prompt_slots: P (static).
    """

    k: tuple[Array, ...]
    v: tuple[Array, ...]
    prompt_lengths_B: Array
    rope_cos: Array
    rope_sin: Array
    prompt_slots: int = flax.struct.field(pytree_node=False)


def prefill(
    model: Transformer,
    params: Any,
    prompt_BxP: Array,
    prompt_lengths_B: Array,
    max_new: int,
    slots: int | None = None,
) -> tuple[Array, DecodeCache]:
    """Runs the prompt block through the model and builds the decode cache.

    Args:
      prompt_BxP: [B, P] int32 right-padded prompts.
      prompt_lengths_B: [B] int32, 1 <= L_b <= P.
      max_new: N, generated tokens the cache serves (its RoPE tables cover P + N positions).
      slots: generated-token slots to allocate now (default N; `extend` adds more).
    Returns:
      (fp32 logits [B, V] at each row's last prompt token, DecodeCache with P + slots slots).
    """
    b, p = prompt_BxP.shape
    slots = max_new if slots is None else slots
    positions_BxP = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    hidden_BxPxD, cache = model.apply(
        {"params": params},
        prompt_BxP,
        positions_BxP,
        None,
        init_cache(model.config, b, p),
        return_hidden=True,
    )
    last_B = prompt_lengths_B - 1
    last_Bx1xD = jnp.take_along_axis(hidden_BxPxD, last_B[:, None, None], axis=1)
    logits_Bx1xV = model.apply({"params": params}, last_Bx1xD, method=Transformer.unembed)

    def layout(c_LxBxPxKxH, order):  # -> per layer [B, K, P + N, Dh] or [B, K, Dh, P + N]
        c = jnp.transpose(c_LxBxPxKxH, order)
        slot_axis = order.index(2)
        pad = [(0, slots if a == slot_axis else 0) for a in range(c.ndim)]
        c = jnp.pad(c, pad)
        return tuple(c[i] for i in range(c.shape[0]))

    k, v = layout(cache["k"], (0, 1, 3, 4, 2)), layout(cache["v"], (0, 1, 3, 2, 4))
    cfg = model.config
    all_positions_1xS = jnp.arange(p + max_new, dtype=jnp.int32)[None, :]
    cos, sin = rope_tables(all_positions_1xS, cfg.head_dim, cfg.rope_theta)
    cache = DecodeCache(k, v, prompt_lengths_B, cos[0, :, 0], sin[0, :, 0], prompt_slots=p)
    return logits_Bx1xV[:, 0], cache


def extend(cache: DecodeCache, slots: int) -> DecodeCache:
    """The cache with `slots` generated-token slots (appended empty slots; one copy).

    The sampler's loop runs in segments and grows the cache between them, so that a step
    attends over the slots generated so far (rounded up to its segment), not over all N: the
    attention reads every cache slot, and on CPU it is bound by those reads.
    """
    total = cache.prompt_slots + slots
    grow = total - cache.v[0].shape[2]
    if grow < 0:
        raise ValueError(f"cannot shrink the cache to {slots} generated slots")
    k = tuple(jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, grow))) for x in cache.k)
    v = tuple(jnp.pad(x, ((0, 0), (0, 0), (0, grow), (0, 0))) for x in cache.v)
    return cache.replace(k=k, v=v)


@flax.struct.dataclass
class DecodeWeights:
    """The model's params rearranged once per sampling call for the decode loop.

    Attributes:
      layers: per layer, {"attn_norm", "q_norm", "k_norm", "mlp_norm": RMSNorm params,
        "qkv": [D, (N + 2K) * Dh] fused q/k/v projection, "o": [N * Dh, D], and for a dense
        model "gate_up": [D, 2F] fused and "down": [F, D]; for MoE "mlp": the layer's params}.
      unembed: [D, V] output projection (the embedding transposed when tied).
      params: the full params (embedding, final norm).
    """

    layers: tuple[dict[str, Any], ...]
    unembed: Array
    params: Any


def decode_weights(model: Transformer, params: Any) -> DecodeWeights:
    """Slices the stacked layer params and fuses q/k/v and gate/up into single matmuls.

    Fewer, larger matmuls per step: the decode step is latency-bound on CPU. Called inside the
    jitted sampler, before the loop, so it costs one copy of the weights per call.
    """
    cfg = model.config
    dt = cfg.jnp_dtype
    d = cfg.d_model
    layers = []
    for i in range(cfg.num_layers):
        lp = jax.tree.map(lambda a, i=i: a[i], params["layers"])
        ap = lp["attn"]
        qkv = [ap[name].reshape(d, -1) for name in ("q_proj", "k_proj", "v_proj")]
        w = {
            "attn_norm": lp["attn_norm"],
            "mlp_norm": lp["mlp_norm"],
            "q_norm": ap["q_norm"],
            "k_norm": ap["k_norm"],
            "qkv": jnp.concatenate(qkv, axis=1).astype(dt),
            "o": ap["o_proj"].reshape(-1, d).astype(dt),
        }
        if cfg.is_moe:
            w["mlp"] = lp["mlp"]
        else:
            mp = lp["mlp"]
            w["gate_up"] = jnp.concatenate([mp["gate_proj"], mp["up_proj"]], axis=1).astype(dt)
            w["down"] = mp["down_proj"].astype(dt)
        layers.append(w)
    # [D, V] for `hidden @ unembed`: with the tied [V, D] embedding used transposed, XLA:CPU
    # repacked it every step.
    unembed = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    return DecodeWeights(tuple(layers), unembed.astype(dt), params)


def _write(cache: Array, new: Array, col: Array, slot_axis: int) -> Array:
    """Writes one shared column in place (a dynamic_update_slice, not a scatter)."""
    start = tuple(col if a == slot_axis else 0 for a in range(cache.ndim))
    return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), start)


def rope_tables(positions_BxT: Array, head_dim: int, theta: float) -> tuple[Array, Array]:
    """cos, sin [B, T, 1, Dh/2] of `tg_jax.models.layers.rope` (the same arithmetic)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles_BxTxH2 = positions_BxT.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
    return jnp.cos(angles_BxTxH2)[:, :, None, :], jnp.sin(angles_BxTxH2)[:, :, None, :]


def apply_rope(x_BxTxNxH: Array, cos: Array, sin: Array) -> Array:
    """`tg_jax.models.layers.rope` with precomputed tables (same arithmetic, same results)."""
    x1, x2 = jnp.split(x_BxTxNxH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxNxH.dtype)


def decode_one(
    model: Transformer, weights: DecodeWeights, tokens_B: Array, index: Array, cache: DecodeCache
) -> tuple[Array, DecodeCache]:
    """Feeds generated token `index` of every row (position L_b + index, slot P + index).

    Same math as the model's `DecoderLayer` (pre-norm GQA attention with q/k RMSNorm and RoPE,
    SwiGLU or MoE feed-forward); only the cache layout and the fused matmuls differ.

    Args:
      weights: `decode_weights(model, params)`.
      tokens_B: [B] int32 tokens to feed.
      index: [] int32, which generated token they are (0 = the first one).
      cache: the decode cache (slots P + index are overwritten).
    Returns:
      (fp32 logits [B, V] for the next token, updated cache).
    """
    cfg = model.config
    dt, pdt = cfg.jnp_dtype, cfg.jnp_param_dtype
    n, n_kv, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    b = tokens_B.shape[0]
    p = cache.prompt_slots
    slots = cache.v[0].shape[2]
    positions_Bx1 = (cache.prompt_lengths_B + index)[:, None]
    col = p + index
    slot_S = jnp.arange(slots, dtype=jnp.int32)
    in_prompt_BxS = slot_S[None, :] < cache.prompt_lengths_B[:, None]
    generated_1xS = ((slot_S >= p) & (slot_S <= col))[None, :]
    visible_Bx1x1xS = (in_prompt_BxS | generated_1xS)[:, None, None, :]
    cos = cache.rope_cos[positions_Bx1][:, :, None, :]  # [B, 1, 1, Dh/2]
    sin = cache.rope_sin[positions_Bx1][:, :, None, :]

    def norm(x, norm_params):
        return RMSNorm(cfg.rms_norm_eps, pdt).apply({"params": norm_params}, x)

    params = weights.params
    x_BxD = model.apply({"params": params}, tokens_B[:, None], method=Transformer.embed_tokens)
    x_BxD = x_BxD[:, 0]
    new_k, new_v = list(cache.k), list(cache.v)
    for i, w in enumerate(weights.layers):
        hid_BxD = norm(x_BxD, w["attn_norm"]).astype(dt)
        qkv_BxE = hid_BxD @ w["qkv"]
        q_Bx1xNxH = qkv_BxE[:, : n * h].reshape(b, 1, n, h)
        k_Bx1xKxH = qkv_BxE[:, n * h : (n + n_kv) * h].reshape(b, 1, n_kv, h)
        v_BxKx1xH = qkv_BxE[:, (n + n_kv) * h :].reshape(b, n_kv, 1, h)
        q_Bx1xNxH = apply_rope(norm(q_Bx1xNxH, w["q_norm"]), cos, sin)
        k_Bx1xKxH = apply_rope(norm(k_Bx1xKxH, w["k_norm"]), cos, sin)
        new_k[i] = _write(new_k[i], jnp.transpose(k_Bx1xKxH, (0, 2, 3, 1)), col, slot_axis=3)
        new_v[i] = _write(new_v[i], v_BxKx1xH, col, slot_axis=2)
        q_BxKxGxH = q_Bx1xNxH.reshape(b, n_kv, n // n_kv, h)
        scores_BxKxGxS = jnp.einsum("bkgh,bkhs->bkgs", q_BxKxGxH, new_k[i].astype(dt))
        scores_BxKxGxS = scores_BxKxGxS.astype(jnp.float32) * (h**-0.5)
        scores_BxKxGxS = jnp.where(visible_Bx1x1xS, scores_BxKxGxS, jnp.finfo(jnp.float32).min)
        probs_BxKxGxS = jax.nn.softmax(scores_BxKxGxS, axis=-1).astype(dt)
        out_BxKxGxH = jnp.einsum("bkgs,bksh->bkgh", probs_BxKxGxS, new_v[i].astype(dt))
        x_BxD = x_BxD + out_BxKxGxH.reshape(b, n * h) @ w["o"]
        hid_BxD = norm(x_BxD, w["mlp_norm"])
        if cfg.is_moe:
            ffn = make_ffn(cfg, "mlp").apply({"params": w["mlp"]}, hid_BxD[:, None])[:, 0]
        else:
            gate_up_Bx2F = hid_BxD.astype(dt) @ w["gate_up"]
            gate_BxF, up_BxF = jnp.split(gate_up_Bx2F, 2, axis=-1)
            ffn = (jax.nn.silu(gate_BxF) * up_BxF) @ w["down"]
        x_BxD = x_BxD + ffn

    x_BxD = norm(x_BxD, params["final_norm"]).astype(dt)
    logits_BxV = (x_BxD @ weights.unembed).astype(jnp.float32)
    return logits_BxV, cache.replace(k=tuple(new_k), v=tuple(new_v))


__all__ = [
    "DecodeCache",
    "DecodeWeights",
    "apply_rope",
    "decode_one",
    "decode_weights",
    "extend",
    "prefill",
    "rope_tables",
]
