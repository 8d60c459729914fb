"""The model's decode path: prefill of a prompt block, then one token per row per step.

This is the one KV-cache implementation (the sampler's loop drives it): the model's layers (its
`RMSNorm`, RoPE tables, feed-forward and embedding modules, applied to the model's params) with
q/k/v and gate/up fused into single matmuls by `decode_weights`, and the model's one attention
core (`tg_jax.models.attention.attend`, on the cache's slot-minor layout). `models.forward` is
the cache-free full-sequence path; tests check this one against it and against Hugging Face
`generate`. Shape letters: the legend in `tg_jax.models`.

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
from tg_jax.models.layers import RMSNorm, apply_rope, rope_tables
from tg_jax.models.qwen3 import Transformer, make_ffn

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
    dt = cfg.jnp_dtype
    h = cfg.head_dim
    b, p = prompt_BxP.shape
    slots = max_new if slots is None else slots
    weights = decode_weights(model, params) if weights is None else weights
    all_positions_1xS = jnp.arange(p + max_new, dtype=jnp.int32)[None, :]
    cos_1xSx1xH2, sin_1xSx1xH2 = rope_tables(all_positions_1xS, h, cfg.rope_theta)
    rope_P = (cos_1xSx1xH2[:, :p], sin_1xSx1xH2[:, :p])
    t_P = jnp.arange(p)
    causal_1xPxP = (t_P[None, :] <= t_P[:, None])[None]  # [query, key]: key at or before it

    x_BxPxD = _embed(model, weights, prompt_BxP)
    last_Bx1x1 = (prompt_lengths_B - 1)[:, None, None]
    ks, vs, ids = [], [], []
    for i, w in enumerate(weights.layers):
        q_BxPxNxH, k_BxPxKxH, v_BxPxKxH = _attention_inputs(cfg, w, x_BxPxD, *rope_P)
        k_BxKxHxP = jnp.transpose(k_BxPxKxH, (0, 2, 3, 1)).astype(dt)
        v_BxKxPxH = jnp.transpose(v_BxPxKxH, (0, 2, 1, 3)).astype(dt)
        ks.append(k_BxKxHxP)
        vs.append(v_BxKxPxH)
        if i < len(weights.layers) - 1 or routes:
            # Causal attention of the prompt block over its own keys, in causal query blocks
            # (the masked upper triangle beyond a block is never computed).
            out_BxPxNxH = attend(
                q_BxPxNxH,
                k_BxKxHxP,
                v_BxKxPxH,
                causal_1xPxP,
                dtype=dt,
                slot_minor=True,
                query_block=_PREFILL_QUERY_BLOCK,
                causal_keys=0,
            )
            x_BxPxD = _ffn_recording(cfg, w, x_BxPxD, out_BxPxNxH, ids if routes else None)
        else:
            # Past the last layer's keys and values only each row's last prompt token is
            # used (its logits): the rest of the layer runs for that token alone, as a decode
            # step would (about half the prefill FLOPs of a 2-layer model).
            q_Bx1xNxH = jnp.take_along_axis(q_BxPxNxH, last_Bx1x1[..., None], axis=1)
            visible_Bx1xP = (t_P[None, :] <= last_Bx1x1[:, 0])[:, None, :]
            out_Bx1xNxH = attend(
                q_Bx1xNxH, k_BxKxHxP, v_BxKxPxH, visible_Bx1xP, dtype=dt, slot_minor=True
            )
            x_Bx1xD = jnp.take_along_axis(x_BxPxD, last_Bx1x1, axis=1)
            x_Bx1xD = _attention_output_and_ffn(cfg, w, x_Bx1xD, out_Bx1xNxH)

    if routes:  # every layer ran for every token: the last prompt token's outputs
        x_Bx1xD = jnp.take_along_axis(x_BxPxD, last_Bx1x1, axis=1)
    cache = DecodeCache(
        tuple(ks),
        tuple(vs),
        prompt_lengths_B,
        cos_1xSx1xH2[0, :, 0],
        sin_1xSx1xH2[0, :, 0],
        prompt_slots=p,
        routes=jnp.stack(ids, axis=2).astype(jnp.int16) if routes else None,
    )
    return _logits(cfg, weights, x_Bx1xD[:, 0]), extend(cache, slots)


def _ffn_recording(cfg, w, x_BxTxD: Array, out_BxTxNxH: Array, ids: list | None) -> Array:
    """`_attention_output_and_ffn`; with a list `ids`, the layer's routing [B, T, J] appended."""
    if ids is None:
        return _attention_output_and_ffn(cfg, w, x_BxTxD, out_BxTxNxH)
    x_BxTxD, ids_BxTxJ = _attention_output_and_ffn(cfg, w, x_BxTxD, out_BxTxNxH, routes=True)
    ids.append(ids_BxTxJ)
    return x_BxTxD


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
    dt = cfg.jnp_dtype
    h = cfg.head_dim
    b, a = tokens_BxA.shape
    p = cache.prompt_slots
    if cache.v[0].shape[2] != p:
        raise ValueError("prefill_append needs a cache without generated slots (keep_context)")
    slots = max_new if slots is None else slots
    start_B = cache.prompt_lengths_B
    cos_1xSx1xH2, sin_1xSx1xH2 = rope_tables(
        jnp.arange(p + max_new, dtype=jnp.int32)[None, :], h, cfg.rope_theta
    )
    # Padding tokens past the block take any position in it: nothing reads their outputs.
    positions_BxA = jnp.minimum(start_B[:, None] + jnp.arange(a, dtype=jnp.int32)[None, :], p - 1)
    cos = cos_1xSx1xH2[0, :, 0][positions_BxA][:, :, None, :]  # [B, A, 1, H / 2]
    sin = sin_1xSx1xH2[0, :, 0][positions_BxA][:, :, None, :]
    slot_P = jnp.arange(p, dtype=jnp.int32)
    # Cache slot s of row b takes new token s - C_b when that is one of the row's A_b tokens.
    j_BxP = slot_P[None, :] - start_B[:, None]
    is_new_BxP = (j_BxP >= 0) & (j_BxP < lengths_B[:, None])
    j_BxP = jnp.clip(j_BxP, 0, a - 1)
    visible_BxAxP = slot_P[None, None, :] <= positions_BxA[:, :, None]  # causal by position
    end_B = start_B + lengths_B
    last_Bx1x1 = (lengths_B - 1)[:, None, None]

    x_BxAxD = _embed(model, weights, tokens_BxA)
    ks, vs, ids = [], [], []
    record = cache.routes is not None
    for i, w in enumerate(weights.layers):
        q_BxAxNxH, k_BxAxKxH, v_BxAxKxH = _attention_inputs(cfg, w, x_BxAxD, cos, sin)
        k_BxKxHxA = jnp.transpose(k_BxAxKxH, (0, 2, 3, 1)).astype(dt)
        v_BxKxAxH = jnp.transpose(v_BxAxKxH, (0, 2, 1, 3)).astype(dt)
        ks.append(k_BxKxHxP := _place(k_BxKxHxA, j_BxP, is_new_BxP, cache.k[i], axis=3))
        vs.append(v_BxKxPxH := _place(v_BxKxAxH, j_BxP, is_new_BxP, cache.v[i], axis=2))
        if i < len(weights.layers) - 1 or record:
            out_BxAxNxH = attend(
                q_BxAxNxH,
                k_BxKxHxP,
                v_BxKxPxH,
                visible_BxAxP,
                dtype=dt,
                slot_minor=True,
                query_block=_PREFILL_QUERY_BLOCK,
            )
            x_BxAxD = _ffn_recording(cfg, w, x_BxAxD, out_BxAxNxH, ids if record else None)
        else:
            q_Bx1xNxH = jnp.take_along_axis(q_BxAxNxH, last_Bx1x1[..., None], axis=1)
            visible_Bx1xP = (slot_P[None, :] < end_B[:, None])[:, None, :]
            out_Bx1xNxH = attend(
                q_Bx1xNxH, k_BxKxHxP, v_BxKxPxH, visible_Bx1xP, dtype=dt, slot_minor=True
            )
            x_Bx1xD = jnp.take_along_axis(x_BxAxD, last_Bx1x1, axis=1)
            x_Bx1xD = _attention_output_and_ffn(cfg, w, x_Bx1xD, out_Bx1xNxH)

    if record:  # every layer ran for every token: the last new token's outputs
        x_Bx1xD = jnp.take_along_axis(x_BxAxD, last_Bx1x1, axis=1)
    out = DecodeCache(
        tuple(ks),
        tuple(vs),
        end_B,
        cos_1xSx1xH2[0, :, 0],
        sin_1xSx1xH2[0, :, 0],
        prompt_slots=p,
        routes=_place(
            jnp.stack(ids, axis=2).astype(jnp.int16), j_BxP, is_new_BxP, cache.routes, axis=1
        )
        if record
        else None,  # the new tokens' routing at their slots
    )
    return _logits(cfg, weights, x_Bx1xD[:, 0]), extend(out, slots)


def _write(cache: Array, new: Array, col: Array, slot_axis: int) -> Array:
    """Writes one shared column in place (a dynamic_update_slice, not a scatter)."""
    start = tuple(col if a == slot_axis else 0 for a in range(cache.ndim))
    return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), start)


def _norm(cfg, x: Array, norm_params: Any) -> Array:
    return RMSNorm(cfg.rms_norm_eps, cfg.jnp_param_dtype).apply({"params": norm_params}, x)


def _embed(model: Transformer, weights: DecodeWeights, tokens_BxT: Array) -> Array:
    return model.apply({"params": weights.params}, tokens_BxT, method=Transformer.embed_tokens)


def _attention_inputs(cfg, w: dict[str, Any], x_BxTxD: Array, cos: Array, sin: Array):
    """Pre-norm, fused q/k/v projection, q/k RMSNorm and RoPE of one layer:
    (q [B, T, N, H], k [B, T, K, H], v [B, T, K, H])."""
    n, n_kv, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    b, t = x_BxTxD.shape[:2]
    qkv_BxTxQ = _norm(cfg, x_BxTxD, w["attn_norm"]).astype(cfg.jnp_dtype) @ w["qkv"]
    q_BxTxNxH = qkv_BxTxQ[..., : n * h].reshape(b, t, n, h)
    k_BxTxKxH = qkv_BxTxQ[..., n * h : (n + n_kv) * h].reshape(b, t, n_kv, h)
    v_BxTxKxH = qkv_BxTxQ[..., (n + n_kv) * h :].reshape(b, t, n_kv, h)
    q_BxTxNxH = apply_rope(_norm(cfg, q_BxTxNxH, w["q_norm"]), cos, sin)
    k_BxTxKxH = apply_rope(_norm(cfg, k_BxTxKxH, w["k_norm"]), cos, sin)
    return q_BxTxNxH, k_BxTxKxH, v_BxTxKxH


def _attention_output_and_ffn(
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
    hid_BxTxD = _norm(cfg, x_BxTxD, w["mlp_norm"])
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


def _logits(cfg, weights: DecodeWeights, x_BxD: Array) -> Array:
    """Final norm and unembedding: fp32 logits [B, V]."""
    x_BxD = _norm(cfg, x_BxD, weights.params["final_norm"]).astype(cfg.jnp_dtype)
    return (x_BxD @ weights.unembed).astype(jnp.float32)


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

    x_Bx1xD = _embed(model, weights, tokens_B[:, None])
    new_k, new_v, ids = list(cache.k), list(cache.v), []
    record = cache.routes is not None
    for i, w in enumerate(weights.layers):
        q_Bx1xNxH, k_Bx1xKxH, v_Bx1xKxH = _attention_inputs(cfg, w, x_Bx1xD, cos, sin)
        new_k[i] = _write(new_k[i], jnp.transpose(k_Bx1xKxH, (0, 2, 3, 1)), col, slot_axis=3)
        new_v[i] = _write(new_v[i], jnp.transpose(v_Bx1xKxH, (0, 2, 1, 3)), col, slot_axis=2)
        out_Bx1xNxH = attend(
            q_Bx1xNxH, new_k[i], new_v[i], visible_Bx1xS, dtype=dt, slot_minor=True
        )
        x_Bx1xD = _ffn_recording(cfg, w, x_Bx1xD, out_Bx1xNxH, ids if record else None)
    routes = _write(cache.routes, jnp.stack(ids, axis=2), col, slot_axis=1) if record else None
    new = cache.replace(k=tuple(new_k), v=tuple(new_v), routes=routes)
    return _logits(cfg, weights, x_Bx1xD[:, 0]), new


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
        q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = _attention_inputs(
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
        return _attention_output_and_ffn(cfg, w, x_BxTxD, out_BxTxNxH, replay_BxTxJ), None

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
    return _norm(cfg, x_BxTxD, params["final_norm"])


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
