"""The attention core: softmax attention of query tokens over the key / value slots each sees.

Every path of the model runs this one function: the full-sequence layer (`layers.Attention`,
training and the teacher), the decode path's prefill, append, decode step and prefix block
(`models.decode`), and the engine's paged prefill and decode (`engine.paged`). The paths differ
only in where the keys and values come from and which slots each query may see (the mask); the
arithmetic is this:

    scores = (q . k) * H^-0.5 in fp32;  a slot the query must not see scores float32's minimum
    probs  = softmax(scores over the slots), cast to the compute dtype
    out    = probs . v

Grouped-query heads: query head n reads kv head n // G (G = N / K), as Qwen3 does.

Two key layouts, chosen by the cache that holds them:
  [B, S, K, H] keys and values: the model's own (a full sequence) and the paged pool's rows;
  slot-minor, keys [B, K, H, S] and values [B, K, S, H] (`slot_minor=True`): the decode cache,
  where q . K is a plain [G, H] x [H, S] matmul per (row, kv head), which XLA:CPU runs much
  faster than its batched dot over [.., S, H].

Query blocks (`query_block`): the T queries in blocks of that many, which bounds the scores'
size ([B, N, block, S] instead of [B, N, T, S]). With `causal_keys=S0` a block [lo, hi) scores
only keys [0, S0 + hi): the keys after its last query (slot S0 + j holds query j's own key),
which a causal mask hides anyway, are never computed.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

Array = jax.Array
MASKED = jnp.finfo(jnp.float32).min  # the score of a slot a query must not see
# A mask: bool [B or 1, T, S] (what each query sees), or a function (lo, hi, s) -> its rows
# [lo, hi) over the first s slots, built per query block (no [T, S] mask is materialised).
Visible = Array | Callable[[int, int, int], Array]


def attend(
    q_BxTxNxH: Array,
    keys: Array,
    values: Array,
    visible: Visible,
    *,
    dtype,
    slot_minor: bool = False,
    query_block: int = 0,
    causal_keys: int | None = None,
) -> Array:
    """Softmax attention: [B, T, N, H] in `dtype`.

    Args:
      q_BxTxNxH: queries (after q-norm and RoPE).
      keys, values: [B, S, K, H] each, or with slot_minor keys [B, K, H, S] and values
        [B, K, S, H].
      visible: bool [B or 1, T, S], or a function (lo, hi, s) -> bool [B or 1, hi - lo, s].
      dtype: the compute dtype (q, k, v and the probabilities; scores are fp32).
      slot_minor: the decode cache's layout.
      query_block: queries per block (0 or >= T: one block).
      causal_keys: S0, when block [lo, hi) may score keys [0, S0 + hi) only (None: all S).
    """
    b, t, n, h = q_BxTxNxH.shape
    s = keys.shape[-1] if slot_minor else keys.shape[1]
    n_kv = keys.shape[1] if slot_minor else keys.shape[2]
    q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, n_kv, n // n_kv, h).astype(dtype)
    keys, values = keys.astype(dtype), values.astype(dtype)
    if slot_minor:  # queries [B, K, G, T, H]: T is axis 3
        q_blocks, t_axis = jnp.transpose(q_BxTxKxGxH, (0, 2, 3, 1, 4)), 3
    else:
        q_blocks, t_axis = q_BxTxKxGxH, 1
    block = query_block if 0 < query_block < t else t
    outs = []
    for lo in range(0, t, block):
        hi = min(lo + block, t)
        s_blk = s if causal_keys is None else min(s, causal_keys + hi)
        mask_BxTxS = visible(lo, hi, s_blk) if callable(visible) else visible[:, lo:hi, :s_blk]
        q_blk = jax.lax.slice_in_dim(q_blocks, lo, hi, axis=t_axis)
        if slot_minor:
            scores = jnp.einsum("bkgth,bkhs->bkgts", q_blk, keys[..., :s_blk])
        else:
            scores = jnp.einsum("btkgh,bskh->bkgts", q_blk, keys[:, :s_blk])
        scores = scores.astype(jnp.float32) * (h**-0.5)
        scores = jnp.where(mask_BxTxS[:, None, None], scores, MASKED)
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
        if slot_minor:
            outs.append(jnp.einsum("bkgts,bksh->bkgth", probs, values[:, :, :s_blk]))
        else:
            outs.append(jnp.einsum("bkgts,bskh->btkgh", probs, values[:, :s_blk]))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=t_axis)
    if slot_minor:
        out = jnp.transpose(out, (0, 3, 1, 2, 4))  # back to [B, T, K, G, H]
    return out.reshape(b, t, n, h)


__all__ = ["MASKED", "Visible", "attend"]
