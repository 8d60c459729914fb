"""The sampler's KV cache: prefill with the model, then one token per row per step.

Prefill runs `tg_jax.models` itself (the Qwen3 `Transformer` with its own cache, slot index ==
position). Decode steps run the same layers (the model's `RMSNorm`, `rope`, feed-forward and
unembedding modules, applied to the model's params) over a cache laid out for the decode loop:

  per layer k, v: [B, K, P + N, Dh]  (batch, kv heads, slots, head dim)
  slots 0..P-1:   the prompt block, slot == position (row b's prompt is slots 0..L_b-1)
  slot  P + i:    generated token i of EVERY row (its position is L_b + i)

so each step writes one shared column with an in-place `dynamic_update_slice`, and a mask says
which slots a row sees (its prompt slots < L_b and generated slots P..P+i). Layers are unrolled
with one cache array per layer, so nothing copies the cache inside the `while_loop`.

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
from tg_jax.models.layers import RMSNorm, rope
from tg_jax.models.qwen3 import init_cache, make_ffn

Array = jax.Array


@flax.struct.dataclass
class DecodeCache:
    """Per-layer keys/values of prompt + generated tokens.

    Attributes:
      k, v: tuples of num_layers arrays [B, K, P + N, Dh] (compute dtype).
      prompt_lengths_B: [B] int32 L_b.
      prompt_slots: P (static).
    """

    k: tuple[Array, ...]
    v: tuple[Array, ...]
    prompt_lengths_B: Array
    prompt_slots: int = flax.struct.field(pytree_node=False)


def prefill(
    model: Transformer, params: Any, prompt_BxP: Array, prompt_lengths_B: Array, max_new: int
) -> tuple[Array, DecodeCache]:
    """Runs the prompt block through the model and builds the decode cache.

    Args:
      prompt_BxP: [B, P] int32 right-padded prompts.
      prompt_lengths_B: [B] int32, 1 <= L_b <= P.
      max_new: N, generated-token slots to reserve.
    Returns:
      (fp32 logits [B, V] at each row's last prompt token, DecodeCache with P + N slots).
    """
    b, p = prompt_BxP.shape
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

    def layout(c_LxBxPxKxH):  # -> per layer [B, K, P + N, Dh]
        c = jnp.pad(jnp.swapaxes(c_LxBxPxKxH, 2, 3), ((0, 0), (0, 0), (0, 0), (0, max_new), (0, 0)))
        return tuple(c[i] for i in range(c.shape[0]))

    k, v = layout(cache["k"]), layout(cache["v"])
    return logits_Bx1xV[:, 0], DecodeCache(k, v, prompt_lengths_B, prompt_slots=p)


def _layer_params(params: Any, i: int) -> Any:
    return jax.tree.map(lambda a: a[i], params["layers"])


def decode_one(
    model: Transformer, params: Any, tokens_B: Array, index: Array, cache: DecodeCache
) -> tuple[Array, DecodeCache]:
    """Feeds generated token `index` of every row (position L_b + index, slot P + index).

    Args:
      tokens_B: [B] int32 tokens to feed.
      index: [] int32, which generated token they are (0 = the first one).
      cache: the decode cache (slots P + index are overwritten).
    Returns:
      (fp32 logits [B, V] for the next token, updated cache).
    """
    cfg = model.config
    dt, pdt = cfg.jnp_dtype, cfg.jnp_param_dtype
    n_kv, h = cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // n_kv
    b = tokens_B.shape[0]
    p = cache.prompt_slots
    slots = cache.k[0].shape[2]
    positions_Bx1 = (cache.prompt_lengths_B + index)[:, None]
    col = p + index
    slot_S = jnp.arange(slots, dtype=jnp.int32)
    in_prompt_BxS = slot_S[None, :] < cache.prompt_lengths_B[:, None]
    generated_1xS = ((slot_S >= p) & (slot_S <= col))[None, :]
    visible_Bx1x1xS = (in_prompt_BxS | generated_1xS)[:, None, None, :]

    x_Bx1xD = model.apply({"params": params}, tokens_B[:, None], method=Transformer.embed_tokens)
    new_k, new_v = list(cache.k), list(cache.v)
    for i in range(cfg.num_layers):
        lp = _layer_params(params, i)
        ap = lp["attn"]
        hid = RMSNorm(cfg.rms_norm_eps, pdt).apply({"params": lp["attn_norm"]}, x_Bx1xD).astype(dt)
        q_Bx1xNxH = jnp.einsum("btd,dnh->btnh", hid, ap["q_proj"].astype(dt))
        k_Bx1xKxH = jnp.einsum("btd,dkh->btkh", hid, ap["k_proj"].astype(dt))
        v_Bx1xKxH = jnp.einsum("btd,dkh->btkh", hid, ap["v_proj"].astype(dt))
        q_Bx1xNxH = RMSNorm(cfg.rms_norm_eps, pdt).apply({"params": ap["q_norm"]}, q_Bx1xNxH)
        k_Bx1xKxH = RMSNorm(cfg.rms_norm_eps, pdt).apply({"params": ap["k_norm"]}, k_Bx1xKxH)
        q_Bx1xNxH = rope(q_Bx1xNxH, positions_Bx1, cfg.rope_theta)
        k_Bx1xKxH = rope(k_Bx1xKxH, positions_Bx1, cfg.rope_theta)

        def write(c_BxKxSxH, new_Bx1xKxH):
            new = jnp.swapaxes(new_Bx1xKxH, 1, 2).astype(c_BxKxSxH.dtype)
            return jax.lax.dynamic_update_slice(c_BxKxSxH, new, (0, 0, col, 0))

        new_k[i] = write(new_k[i], k_Bx1xKxH)
        new_v[i] = write(new_v[i], v_Bx1xKxH)
        q_BxKxGxH = q_Bx1xNxH.reshape(b, n_kv, g, h)
        scores_BxKxGxS = jnp.einsum("bkgh,bksh->bkgs", q_BxKxGxH, new_k[i].astype(dt))
        scores_BxKxGxS = scores_BxKxGxS.astype(jnp.float32) * (h**-0.5)
        scores_BxKxGxS = jnp.where(visible_Bx1x1xS, scores_BxKxGxS, jnp.finfo(jnp.float32).min)
        probs_BxKxGxS = jax.nn.softmax(scores_BxKxGxS, axis=-1).astype(dt)
        out_BxKxGxH = jnp.einsum("bkgs,bksh->bkgh", probs_BxKxGxS, new_v[i].astype(dt))
        out_Bx1xNxH = out_BxKxGxH.reshape(b, 1, n_kv * g, h)
        x_Bx1xD = x_Bx1xD + jnp.einsum("btnh,nhd->btd", out_Bx1xNxH, ap["o_proj"].astype(dt))
        hid = RMSNorm(cfg.rms_norm_eps, pdt).apply({"params": lp["mlp_norm"]}, x_Bx1xD)
        x_Bx1xD = x_Bx1xD + make_ffn(cfg, "mlp").apply({"params": lp["mlp"]}, hid)

    x_Bx1xD = RMSNorm(cfg.rms_norm_eps, pdt).apply({"params": params["final_norm"]}, x_Bx1xD)
    logits_Bx1xV = model.apply({"params": params}, x_Bx1xD, method=Transformer.unembed)
    return logits_Bx1xV[:, 0], cache.replace(k=tuple(new_k), v=tuple(new_v))


__all__ = ["DecodeCache", "decode_one", "prefill"]
