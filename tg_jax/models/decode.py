"""The model's decode path: prefill of a prompt block, then one token per row per step.

This is the one KV-cache implementation (the sampler's loop drives it): the layer math of
`tg_jax.models.fused_layers` (the model's layers on its params, q/k/v and gate/up fused into
single matmuls by `decode_weights`; shared with the engine's paged calls) and the model's one
attention core (`tg_jax.models.attention.attend`, on the cache's slot-minor layout).
`models.forward` is the cache-free full-sequence path; tests check this one against it and
against Hugging Face `generate`. Shape letters: the legend in `tg_jax.models`.

Keys and values are produced directly in the layout of the decode loop:

  per layer k: [B, K, H, P + R], v: [B, K, P + R, H]  (batch, kv heads, head dim, slots)
  slots 0..P-1:   the prompt block, slot == position (row b's prompt is slots 0..L_b-1)
  slot  P + i:    generated token i of EVERY row (its position is L_b + i)

so each step writes one shared column with an in-place `dynamic_update_slice` (not a per-row
scatter), and a mask says which slots a row sees (its prompt slots < L_b and generated slots
P..P+i). The RoPE cos / sin of every position 0..P+R-1 are computed once at prefill and a step
gathers its rows' entries (computed inside the step, XLA repeated the trigonometry in every
fusion that used them). Layers are unrolled with one cache array per layer, so nothing slices
or restacks the cache inside the `while_loop`. Keys are stored slot-minor so that q.K is a
plain [G, H] x [H, S] matmul per (row, kv head): XLA:CPU's batched dot over the [.., S, H]
layout was much slower.

    weights = decode_weights(model, params)
    logits_BxV, cache = prefill(model, params, prompt_BxP, prompt_lengths_B, r, weights=weights)
    logits_BxV, cache = decode_one(model, weights, tokens_B, index, cache)

Multi-turn sampling keeps the cache between calls: `keep_context` makes each row's context
contiguous again (prompt and generated tokens, slot == position) and `prefill_append` prefills
only the tokens appended to it.

`forward_from_prefix` runs a block of tokens that continues a prefix whose keys and values
another pass computed (the TG teacher after its first hint, on the student's prefix).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from tg_jax.models.attention import attend
from tg_jax.models.fused_layers import (
    DecodeWeights,
    attention_inputs,
    attention_output_and_ffn,
    decode_weights,
    embed,
    ffn_recording,
    output_logits,
    rms_norm,
    stacked_layer_weights,
)
from tg_jax.models.layers import apply_rope, rope_tables
from tg_jax.models.qwen3 import Transformer

Array = jax.Array
_PREFILL_QUERY_BLOCK = 128  # prefill attention in causal query blocks of this many tokens
_PREFIX_QUERY_BLOCK = 64  # the same for `forward_from_prefix` (faster there on CPU than 128)


@flax.struct.dataclass
class DecodeCache:
    """Per-layer keys/values of prompt + generated tokens.

    Attributes:
      k: tuple of num_layers arrays [B, K, H, P + R] (compute dtype).
      v: tuple of num_layers arrays [B, K, P + R, H].
      prompt_lengths_B: [B] int32 L_b.
      rope_cos, rope_sin: [P + R, H / 2] f32 RoPE tables by position (`rope_tables`).
      prompt_slots: P (static).
      routes: MoE routing record, or None: [B, P + R, L, J] int16, per slot the experts each
        layer routed its token to when it was fed (router replay), -1 where none was fed;
        kept like the keys and values by every function here (`prefill(routes=True)`).
    """

    k: tuple[Array, ...]
    v: tuple[Array, ...]
    prompt_lengths_B: Array
    rope_cos: Array
    rope_sin: Array
    prompt_slots: int = flax.struct.field(pytree_node=False)
    routes: Array | None = None


def prefill(
    model: Transformer,
    params: Any,
    prompt_BxP: Array,
    prompt_lengths_B: Array,
    max_new: int,
    slots: int | None = None,
    weights: DecodeWeights | None = None,
    routes: bool = False,
) -> tuple[Array, DecodeCache]:
    """Runs the prompt block through the layers and builds the decode cache.

    The same layer math as `decode_one` (fused q/k/v and gate/up matmuls), with causal
    attention inside the block; keys and values are produced in the cache's layout. The last
    layer, past its keys and values, runs for each row's last prompt token only (the only
    output used).

    Args:
      prompt_BxP: [B, P] int32 right-padded prompts.
      prompt_lengths_B: [B] int32, 1 <= L_b <= P.
      max_new: R, generated tokens the cache serves (its RoPE tables cover P + R positions).
      slots: generated-token slots to allocate now (default R; `extend` adds more).
      weights: `decode_weights(model, params)` when the caller has them.
      routes: MoE: the cache keeps the routing record (`DecodeCache.routes`; the last layer
        then runs for every prompt token).
    Returns:
      (fp32 logits [B, V] at each row's last prompt token, DecodeCache with P + slots slots).
    """
    cfg = model.config
    p = prompt_BxP.shape[1]
    slots = max_new if slots is None else slots
    weights = decode_weights(model, params) if weights is None else weights
    cos_SxH2, sin_SxH2 = _rope_by_position(cfg, p + max_new)
    t_P = jnp.arange(p)
    causal_1xPxP = (t_P[None, :] <= t_P[:, None])[None]  # [query, key]: key at or before it
    last_Bx1x1 = (prompt_lengths_B - 1)[:, None, None]
    x_Bx1xD, ks, vs, ids = _prefill_layers(
        cfg,
        weights,
        embed(model, weights, prompt_BxP),
        (cos_SxH2[None, :p, None, :], sin_SxH2[None, :p, None, :]),
        lambda i, k_BxKxHxP, v_BxKxPxH: (k_BxKxHxP, v_BxKxPxH),  # the block is the cache
        causal_1xPxP,
        (t_P[None, :] <= last_Bx1x1[:, 0])[:, None, :],
        last_Bx1x1,
        record=routes,
        causal_keys=0,  # the masked upper triangle beyond a query block is never computed
    )
    cache = DecodeCache(
        tuple(ks),
        tuple(vs),
        prompt_lengths_B,
        cos_SxH2,
        sin_SxH2,
        prompt_slots=p,
        routes=jnp.stack(ids, axis=2).astype(jnp.int16) if routes else None,
    )
    return output_logits(cfg, weights, x_Bx1xD[:, 0]), extend(cache, slots)


def _rope_by_position(cfg, n: int) -> tuple[Array, Array]:
    """RoPE cos, sin [n, H / 2] of positions 0..n-1 (`DecodeCache.rope_cos`, `rope_sin`)."""
    cos_1xSx1xH2, sin_1xSx1xH2 = rope_tables(
        jnp.arange(n, dtype=jnp.int32)[None, :], cfg.head_dim, cfg.rope_theta
    )
    return cos_1xSx1xH2[0, :, 0], sin_1xSx1xH2[0, :, 0]


def _prefill_layers(
    cfg,
    weights: DecodeWeights,
    x_BxTxD: Array,
    rope: tuple[Array, Array],
    store,
    visible_BxTxS: Array,
    visible_last_Bx1xS: Array,
    last_Bx1x1: Array,
    record: bool,
    causal_keys: int | None = None,
) -> tuple[Array, list[Array], list[Array], list[Array] | None]:
    """A block of T tokens a row through the layers (`prefill`, `prefill_append`).

    Per layer: the block's keys and values in the cache's layout ([B, K, H, T], [B, K, T, H]),
    `store(i, k, v)` makes the layer's cache entries of S slots from them, then the block
    attends over those (`visible_BxTxS`, in causal query blocks) and runs the rest of the layer.
    The last layer, past its keys and values, runs for each row's last token (`last_Bx1x1`, the
    only output used; it sees `visible_last_Bx1xS`) alone, as a decode step would (about half
    the prefill FLOPs of a 2-layer model), unless `record` keeps the routing (MoE: every layer
    then runs for every token).

    Returns:
      (hidden state [B, 1, D] at each row's last token, per-layer keys and values, the
      layers' routing [B, T, J] when recorded, else None).
    """
    dt = cfg.jnp_dtype
    ks, vs, ids = [], [], [] if record else None
    for i, w in enumerate(weights.layers):
        q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = attention_inputs(cfg, w, x_BxTxD, *rope)
        k_BxKxHxT = jnp.transpose(k_BxTxKxH, (0, 2, 3, 1)).astype(dt)
        v_BxKxTxH = jnp.transpose(v_BxTxKxH, (0, 2, 1, 3)).astype(dt)
        k_BxKxHxS, v_BxKxSxH = store(i, k_BxKxHxT, v_BxKxTxH)
        ks.append(k_BxKxHxS)
        vs.append(v_BxKxSxH)
        if i < len(weights.layers) - 1 or record:
            out_BxTxNxH = attend(
                q_BxTxNxH,
                k_BxKxHxS,
                v_BxKxSxH,
                visible_BxTxS,
                dtype=dt,
                slot_minor=True,
                query_block=_PREFILL_QUERY_BLOCK,
                causal_keys=causal_keys,
            )
            x_BxTxD = ffn_recording(cfg, w, x_BxTxD, out_BxTxNxH, ids)
        else:
            q_Bx1xNxH = jnp.take_along_axis(q_BxTxNxH, last_Bx1x1[..., None], axis=1)
            out_Bx1xNxH = attend(
                q_Bx1xNxH, k_BxKxHxS, v_BxKxSxH, visible_last_Bx1xS, dtype=dt, slot_minor=True
            )
            x_Bx1xD = jnp.take_along_axis(x_BxTxD, last_Bx1x1, axis=1)
            x_Bx1xD = attention_output_and_ffn(cfg, w, x_Bx1xD, out_Bx1xNxH)
    if record:  # every layer ran for every token: the last token's outputs
        x_Bx1xD = jnp.take_along_axis(x_BxTxD, last_Bx1x1, axis=1)
    return x_Bx1xD, ks, vs, ids


def extend(cache: DecodeCache, slots: int) -> DecodeCache:
    """The cache with `slots` generated-token slots (appended empty slots; one copy).

    The sampler's loop runs in segments and grows the cache between them, so that a step
    attends over the slots generated so far (rounded up to its segment), not over all R: the
    attention reads every cache slot, and on CPU it is bound by those reads.
    """
    total = cache.prompt_slots + slots
    grow = total - cache.v[0].shape[2]
    if grow < 0:
        raise ValueError(f"cannot shrink the cache to {slots} generated slots")
    k = tuple(jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, grow))) for x in cache.k)
    v = tuple(jnp.pad(x, ((0, 0), (0, 0), (0, grow), (0, 0))) for x in cache.v)
    routes = cache.routes
    if routes is not None:
        routes = jnp.pad(routes, ((0, 0), (0, grow), (0, 0), (0, 0)), constant_values=-1)
    return cache.replace(k=k, v=v, routes=routes)


def keep_context(
    cache: DecodeCache, rows_B: Array, generated_B: Array, prompt_slots: int
) -> DecodeCache:
    """Rows of a cache after a decode loop, each row's context contiguous again (one gather).

    Row b's context is its prompt (slots 0..L-1) and its first g_b generated tokens (slots
    P0..P0+g_b-1): they move to slots 0..L+g_b-1 of a prompt block of `prompt_slots` slots, so
    slot == position as after `prefill`; slots past a row's context hold stale entries that
    nothing sees. `prefill_append` then adds the next tokens (multi-turn sampling).

    Args:
      cache: a cache of B0 rows with P0 prompt slots and any number of generated slots.
      rows_B: [B] int32 rows of `cache` to keep (repeats allowed).
      generated_B: [B] int32 g_b, generated tokens of each kept row whose keys and values are
        in the cache (a row's last drawn token was never fed: it is not).
      prompt_slots: P of the new block (>= L + g_b of every row).
    Returns:
      DecodeCache of B rows and P slots, prompt_lengths_B = L + g_b (RoPE tables unchanged).
    """
    total = cache.v[0].shape[2]
    lengths_B = cache.prompt_lengths_B[rows_B]
    slot_1xS = jnp.arange(prompt_slots, dtype=jnp.int32)[None, :]
    from_generated_BxS = cache.prompt_slots + slot_1xS - lengths_B[:, None]
    src_BxS = jnp.where(slot_1xS < lengths_B[:, None], slot_1xS, from_generated_BxS)
    src_BxS = jnp.clip(src_BxS, 0, total - 1)
    k = tuple(jnp.take_along_axis(x[rows_B], src_BxS[:, None, None, :], axis=3) for x in cache.k)
    v = tuple(jnp.take_along_axis(x[rows_B], src_BxS[:, None, :, None], axis=2) for x in cache.v)
    routes = None
    if cache.routes is not None:
        routes = _context(cache.routes[rows_B], src_BxS, lengths_B + generated_B)
    return cache.replace(
        k=k,
        v=v,
        prompt_lengths_B=lengths_B + generated_B,
        prompt_slots=prompt_slots,
        routes=routes,
    )


def _context(routes_BxSxLxJ: Array, src_BxS: Array, context_B: Array) -> Array:
    """Routing record slots src_BxS of each row, -1 from position context_b on."""
    routes = jnp.take_along_axis(routes_BxSxLxJ, src_BxS[:, :, None, None], axis=1)
    in_context_BxS = jnp.arange(src_BxS.shape[1])[None, :] < context_B[:, None]
    return jnp.where(in_context_BxS[:, :, None, None], routes, jnp.int16(-1))


def context_routes(cache: DecodeCache, fed_B: Array) -> Array:
    """Each row's routing record by position [B, P + R, L, J]: its prompt (slots < L_b), then
    its first fed_b generated tokens (slots P..), -1 after (the layout `keep_context` makes)."""
    total = cache.routes.shape[1]
    slot_1xS = jnp.arange(total, dtype=jnp.int32)[None, :]
    lengths_B = cache.prompt_lengths_B
    src_BxS = jnp.where(
        slot_1xS < lengths_B[:, None], slot_1xS, cache.prompt_slots + slot_1xS - lengths_B[:, None]
    )
    return _context(cache.routes, jnp.clip(src_BxS, 0, total - 1), lengths_B + fed_B)


def routes_window(routes_BxSxLxJ: Array, start_B: Array, width: int) -> Array:
    """Positions start_b .. start_b + width - 1 of each row's routing record by position
    (`context_routes`), -1 past its end."""
    pos_BxW = start_B[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    inside = pos_BxW < routes_BxSxLxJ.shape[1]
    src = jnp.where(inside, pos_BxW, 0)[:, :, None, None]
    window = jnp.take_along_axis(routes_BxSxLxJ, src, axis=1)
    return jnp.where(inside[:, :, None, None], window, jnp.int16(-1))


def _place(new: Array, j_BxP: Array, is_new_BxP: Array, old: Array, axis: int) -> Array:
    """`old` (rows first, slots on `axis`) with each slot where is_new_BxP holds taken from
    `new`'s entry j_BxP along the same axis."""
    shape = [1] * new.ndim
    shape[0], shape[axis] = j_BxP.shape
    placed = jnp.take_along_axis(new, j_BxP.reshape(shape), axis=axis)
    return jnp.where(is_new_BxP.reshape(shape), placed, old)


def prefill_append(
    model: Transformer,
    weights: DecodeWeights,
    cache: DecodeCache,
    tokens_BxA: Array,
    lengths_B: Array,
    max_new: int,
    slots: int | None = None,
) -> tuple[Array, DecodeCache]:
    """`prefill` of a block of tokens appended to each row's context already in the cache.

    Row b's context fills slots 0..C_b-1 (C_b = cache.prompt_lengths_B, slot == position, as
    `prefill` and `keep_context` leave it); its new tokens tokens_BxA[b, :A_b] take positions
    and slots C_b..C_b+A_b-1 and attend to the context and causally to each other. Same layer
    math as `prefill` (the last layer runs for each row's last new token only).

    Args:
      weights: `decode_weights(model, params)`.
      cache: P prompt slots and no generated slots, C_b + A_b <= P.
      tokens_BxA: [B, A] int32 right-padded new tokens.
      lengths_B: [B] int32 A_b, 1 <= A_b <= A.
      max_new, slots: as in `prefill`.
    Returns:
      (fp32 logits [B, V] at each row's last new token, DecodeCache with prompt lengths
      C_b + A_b and P + slots slots).
    """
    cfg = model.config
    a = tokens_BxA.shape[1]
    p = cache.prompt_slots
    if cache.v[0].shape[2] != p:
        raise ValueError("prefill_append needs a cache without generated slots (keep_context)")
    slots = max_new if slots is None else slots
    start_B = cache.prompt_lengths_B
    cos_SxH2, sin_SxH2 = _rope_by_position(cfg, p + max_new)
    # Padding tokens past the block take any position in it: nothing reads their outputs.
    positions_BxA = jnp.minimum(start_B[:, None] + jnp.arange(a, dtype=jnp.int32)[None, :], p - 1)
    slot_P = jnp.arange(p, dtype=jnp.int32)
    # Cache slot s of row b takes new token s - C_b when that is one of the row's A_b tokens.
    j_BxP = slot_P[None, :] - start_B[:, None]
    is_new_BxP = (j_BxP >= 0) & (j_BxP < lengths_B[:, None])
    j_BxP = jnp.clip(j_BxP, 0, a - 1)
    end_B = start_B + lengths_B
    record = cache.routes is not None
    x_Bx1xD, ks, vs, ids = _prefill_layers(
        cfg,
        weights,
        embed(model, weights, tokens_BxA),
        (cos_SxH2[positions_BxA][:, :, None, :], sin_SxH2[positions_BxA][:, :, None, :]),
        lambda i, k_BxKxHxA, v_BxKxAxH: (
            _place(k_BxKxHxA, j_BxP, is_new_BxP, cache.k[i], axis=3),
            _place(v_BxKxAxH, j_BxP, is_new_BxP, cache.v[i], axis=2),
        ),
        slot_P[None, None, :] <= positions_BxA[:, :, None],  # causal by position
        (slot_P[None, :] < end_B[:, None])[:, None, :],
        (lengths_B - 1)[:, None, None],
        record=record,
    )
    routes = None
    if record:  # the new tokens' routing at their slots
        ids_BxAxLxJ = jnp.stack(ids, axis=2).astype(jnp.int16)
        routes = _place(ids_BxAxLxJ, j_BxP, is_new_BxP, cache.routes, axis=1)
    out = DecodeCache(
        tuple(ks), tuple(vs), end_B, cos_SxH2, sin_SxH2, prompt_slots=p, routes=routes
    )
    return output_logits(cfg, weights, x_Bx1xD[:, 0]), extend(out, slots)


def _write(cache: Array, new: Array, col: Array, slot_axis: int) -> Array:
    """Writes one shared column in place (a dynamic_update_slice, not a scatter)."""
    start = tuple(col if a == slot_axis else 0 for a in range(cache.ndim))
    return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), start)


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
    dt = cfg.jnp_dtype
    p = cache.prompt_slots
    slots = cache.v[0].shape[2]
    positions_Bx1 = (cache.prompt_lengths_B + index)[:, None]
    col = p + index
    slot_S = jnp.arange(slots, dtype=jnp.int32)
    in_prompt_BxS = slot_S[None, :] < cache.prompt_lengths_B[:, None]
    generated_1xS = ((slot_S >= p) & (slot_S <= col))[None, :]
    visible_Bx1xS = (in_prompt_BxS | generated_1xS)[:, None, :]
    cos = cache.rope_cos[positions_Bx1][:, :, None, :]  # [B, 1, 1, H / 2]
    sin = cache.rope_sin[positions_Bx1][:, :, None, :]

    x_Bx1xD = embed(model, weights, tokens_B[:, None])
    new_k, new_v, ids = list(cache.k), list(cache.v), []
    record = cache.routes is not None
    for i, w in enumerate(weights.layers):
        q_Bx1xNxH, k_Bx1xKxH, v_Bx1xKxH = attention_inputs(cfg, w, x_Bx1xD, cos, sin)
        new_k[i] = _write(new_k[i], jnp.transpose(k_Bx1xKxH, (0, 2, 3, 1)), col, slot_axis=3)
        new_v[i] = _write(new_v[i], jnp.transpose(v_Bx1xKxH, (0, 2, 1, 3)), col, slot_axis=2)
        out_Bx1xNxH = attend(
            q_Bx1xNxH, new_k[i], new_v[i], visible_Bx1xS, dtype=dt, slot_minor=True
        )
        x_Bx1xD = ffn_recording(cfg, w, x_Bx1xD, out_Bx1xNxH, ids if record else None)
    routes = _write(cache.routes, jnp.stack(ids, axis=2), col, slot_axis=1) if record else None
    new = cache.replace(k=tuple(new_k), v=tuple(new_v), routes=routes)
    return output_logits(cfg, weights, x_Bx1xD[:, 0]), new


def forward_from_prefix(
    model: Transformer,
    params: Any,
    tokens_BxT: Array,
    positions_BxT: Array,
    segment_ids_BxT: Array,
    prefix_k_LxBxSxKxH: Array,
    prefix_v_LxBxSxKxH: Array,
    prefix_lengths_B: Array,
    replay_BxTxLxJ: Array | None = None,
) -> Array:
    """Final-norm hidden states [B, T, D] of a block that continues a prefix already computed.

    Row b's block follows a prefix of `prefix_lengths_B[b]` tokens whose per-layer keys (after
    q/k norm and RoPE) and values are given, in the full-sequence model's [B, S, K, H] layout;
    a block token sees the prefix slots s < prefix_lengths_B[b] and the block tokens at or
    before it with a non-zero segment id. Same layer math as `prefill` (fused matmuls), in
    causal query blocks (keys past a block's last query are never scored), the layers under a
    `lax.scan` unrolled `model.config.scan_unroll` at a time, as the model's own layer loop
    (so a 48-layer model compiles one layer body). The teacher of targeted guidance runs only
    the tokens from its first hint on this way, the prefix's keys and values coming from the
    student's pass.

    Args:
      tokens_BxT, positions_BxT, segment_ids_BxT: the block (positions continue the prefix).
      prefix_k_LxBxSxKxH, prefix_v_LxBxSxKxH: per-layer prefix keys and values, S slots.
      prefix_lengths_B: [B] int32 valid prefix slots of each row (0 <= L_b <= S).
      replay_BxTxLxJ: MoE router replay of the block's tokens (as `models.forward`'s).
    Returns:
      [B, T, D] hidden states after the final norm (the input of `unembed`).
    """
    cfg = model.config
    s, t = prefix_k_LxBxSxKxH.shape[2], tokens_BxT.shape[1]
    cos_BxTx1xH2, sin_BxTx1xH2 = rope_tables(positions_BxT, cfg.head_dim, cfg.rope_theta)
    # visible [B, T, S + T]: slots 0..S-1 the prefix, S + j block token j.
    slot_1x1xS = jnp.arange(s + t)[None, None, :]
    block_seg_BxS = jnp.pad(segment_ids_BxT, ((0, 0), (s, 0)))
    in_block_BxTxS = (slot_1x1xS - s <= jnp.arange(t)[None, :, None]) & (
        block_seg_BxS[:, None, :] != 0
    )
    visible_BxTxS = jnp.where(
        slot_1x1xS < s, slot_1x1xS < prefix_lengths_B[:, None, None], in_block_BxTxS
    )

    def layer(x_BxTxD, xs):
        w, prefix_k_BxSxKxH, prefix_v_BxSxKxH, replay_BxTxJ = xs
        q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = attention_inputs(
            cfg, w, x_BxTxD, cos_BxTx1xH2, sin_BxTx1xH2
        )
        out_BxTxNxH = _prefix_block_attention(
            cfg,
            q_BxTxNxH,
            k_BxTxKxH,
            v_BxTxKxH,
            prefix_k_BxSxKxH,
            prefix_v_BxSxKxH,
            visible_BxTxS,
        )
        return attention_output_and_ffn(cfg, w, x_BxTxD, out_BxTxNxH, replay_BxTxJ), None

    if replay_BxTxLxJ is not None and not cfg.is_moe:
        raise ValueError("router replay (replay_BxTxLxJ) needs a mixture-of-experts model")
    replay = None if replay_BxTxLxJ is None else jnp.moveaxis(replay_BxTxLxJ, 2, 0)
    x_BxTxD = model.apply({"params": params}, tokens_BxT, method=Transformer.embed_tokens)
    xs = (stacked_layer_weights(model, params), prefix_k_LxBxSxKxH, prefix_v_LxBxSxKxH, replay)
    if cfg.scan_unroll >= cfg.num_layers:  # all layers unrolled: a plain loop (faster on CPU)
        for i in range(cfg.num_layers):
            x_BxTxD, _ = layer(x_BxTxD, jax.tree.map(lambda a, i=i: a[i], xs))
    else:
        x_BxTxD, _ = jax.lax.scan(layer, x_BxTxD, xs, unroll=cfg.scan_unroll)
    return rms_norm(cfg, x_BxTxD, params["final_norm"])


def _prefix_block_attention(
    cfg, q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, prefix_k_BxSxKxH, prefix_v_BxSxKxH, visible_BxTxS
) -> Array:
    """One layer's attention of a block over the prefix slots and its own keys: [B, T, N, H]
    (the decode layout, keys slot-minor; query block [lo, hi) scores the prefix and the block
    keys [0, hi) only)."""
    dt = cfg.jnp_dtype
    k_all = jnp.concatenate([prefix_k_BxSxKxH.astype(dt), k_BxTxKxH.astype(dt)], 1)
    v_all = jnp.concatenate([prefix_v_BxSxKxH.astype(dt), v_BxTxKxH.astype(dt)], 1)
    k_BxKxHxS = jnp.transpose(k_all, (0, 2, 3, 1))
    v_BxKxSxH = jnp.transpose(v_all, (0, 2, 1, 3))
    s = prefix_k_BxSxKxH.shape[1]
    return attend(
        q_BxTxNxH,
        k_BxKxHxS,
        v_BxKxSxH,
        visible_BxTxS,
        dtype=dt,
        slot_minor=True,
        query_block=_PREFIX_QUERY_BLOCK,
        causal_keys=s,
    )


__all__ = [
    "DecodeCache",
    "DecodeWeights",
    "apply_rope",
    "context_routes",
    "routes_window",
    "decode_one",
    "decode_weights",
    "extend",
    "forward_from_prefix",
    "keep_context",
    "prefill",
    "prefill_append",
    "rope_tables",
]
