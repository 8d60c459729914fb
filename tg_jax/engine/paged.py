"""The engine's device computations: paged prefill chunks, the paged decode step, page copies.

Layout (per layer, `PagedPool`): k and v are [num_pages, page_size, K, H] arrays; token slot
o of page p holds the key / value of one position of one sequence. A sequence's page table
row [M] lists its pages in position order (position t lives in page table[t // page_size] at
offset t % page_size); unused columns hold page 0, the scratch page (`pages.SCRATCH_PAGE`),
where padding rows and padding tokens write and which nothing reads unmasked. Attention
gathers a row's M pages into [S = M * page_size, K, H] keys and masks slot s > the query's
position, so stale slots (of a page shared copy-on-write, or past a sequence's length) are
never seen.

The layer math is the decode path's (`tg_jax.models.fused_layers`: `attention_inputs` with q/k
RMSNorm and RoPE, `attention_output_and_ffn`, `output_logits`, the fused `DecodeWeights`) and
the attention is the model's one core (`tg_jax.models.attention.attend`); only the cache
differs.
Both entry points write the new keys and values with one scatter per layer and return the
updated pool (jit them with the pool donated, so the writes are in place):

  prefill_chunk  [B, C] tokens per row at positions start_b.., n_b of them valid: writes their
                 keys / values and, except in the last layer (whose outputs nobody reads),
                 runs the layers over them. No logits: the engine feeds a context's last
                 token through `decode_step`, which samples.
  decode_step    one token per row at position pos_b: writes it, attends over the row's
                 pages, returns fp32 logits [B, V]; `draw` samples from them.

MoE routing record (router replay, R3; a pool made with routes=True): both entry points also
write, at each fed token's slot, the experts every layer routed it to (prefill then runs the
last layer too), so a shared or copied page carries its tokens' routing like their keys;
`page_routes` reads a sequence's back.

`weights_jit`, `prefill_jit`, `decode_jit` (`sample_steps`: decode and draw, one or several
tokens a row per call), `copy_jit` and `routes_jit` are the jitted forms the engine calls
(`tracing.jit`, the model static, the pool donated);
`TRACES` counts their traces. The engine buckets B (decode rows) and M (page-table width) to
powers of two (`buckets`), so each compiles once per bucket.

Limits: a step gathers M pages of every row into a contiguous copy before attending (XLA has
no paged-attention kernel here: the gather costs one extra read and write of the keys and
values a step attends to), M being the longest row's bucket; no ragged or flattened batch
(prefill and decode are separate calls).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from tg_jax import tracing
from tg_jax.models.attention import attend
from tg_jax.models.fused_layers import (
    DecodeWeights,
    attention_inputs,
    decode_weights,
    embed,
    ffn_recording,
    output_logits,
)
from tg_jax.models.layers import rope_tables
from tg_jax.models.qwen3 import Transformer
from tg_jax.sampling.methods import draw_with_uniforms, uniforms

Array = jax.Array


@flax.struct.dataclass
class PagedPool:
    """Per-layer key / value pages.

    Attributes:
      k: tuple of num_layers arrays [num_pages, page_size, K, H] (compute dtype).
      v: tuple of num_layers arrays [num_pages, page_size, K, H].
      routes: MoE routing record, or None: [num_pages, page_size, L, J] int16, the experts
        each layer routed the token of that slot to when it was fed (router replay, R3).
    """

    k: tuple[Array, ...]
    v: tuple[Array, ...]
    routes: Array | None = None

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    def nbytes(self) -> int:
        arrays = (*self.k, *self.v, *(() if self.routes is None else (self.routes,)))
        return sum(x.size * x.dtype.itemsize for x in arrays)


def init_pool(
    model: Transformer, num_pages: int, page_size: int, routes: bool = False, placement: Any = None
) -> PagedPool:
    """A zeroed pool for `model` (zeros: a masked slot must not hold NaN or inf); routes: with
    the MoE routing record (-1 = not fed yet); placement: made in place on its mesh
    (`tg_jax.engine.placement.Placement`: keys and values split on their KV heads), never
    whole on one device."""
    cfg = model.config
    if routes and not cfg.is_moe:
        raise ValueError("a routing record (router replay) needs a mixture-of-experts model")
    shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    shape_r = (num_pages, page_size, cfg.num_layers, cfg.experts_per_token)

    def make():
        k = tuple(jnp.zeros(shape, cfg.jnp_dtype) for _ in range(cfg.num_layers))
        v = tuple(jnp.zeros(shape, cfg.jnp_dtype) for _ in range(cfg.num_layers))
        return PagedPool(k, v, jnp.full(shape_r, -1, jnp.int16) if routes else None)

    if placement is None:
        return make()
    kv = (placement.kv,) * cfg.num_layers
    out = PagedPool(kv, kv, placement.replicated if routes else None)
    return tracing.jit(make, out_shardings=out)()


def pool_bytes(model: Transformer, num_pages: int, page_size: int) -> int:
    """Bytes of the keys and values of `init_pool(model, num_pages, page_size)` (without
    building it)."""
    cfg = model.config
    per_slot = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    return num_pages * page_size * per_slot * jnp.dtype(cfg.jnp_dtype).itemsize


def _write_and_gather(pool_x: Array, new_BxTxKxH: Array, page_BxT, offset_BxT, table_BxM):
    """Scatters new slots into one layer's pages, then gathers each row's pages:
    (updated pool [num_pages, page_size, K, H], the rows' slots [B, M * page_size, K, H])."""
    pool_x = pool_x.at[page_BxT, offset_BxT].set(new_BxTxKxH.astype(pool_x.dtype))
    b, m = table_BxM.shape
    rows = pool_x[table_BxM]  # [B, M, page_size, K, H]
    return pool_x, rows.reshape(b, m * pool_x.shape[1], *pool_x.shape[2:])


def _paged_attention(cfg, q_BxTxNxH: Array, k_BxSxKxH: Array, v_BxSxKxH: Array, pos_BxT) -> Array:
    """Attention of T queries per row over the row's gathered slots s <= the query's
    position (slot == position): [B, T, N, H]."""
    visible_BxTxS = (
        jnp.arange(k_BxSxKxH.shape[1], dtype=jnp.int32)[None, None, :] <= pos_BxT[:, :, None]
    )
    return attend(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, visible_BxTxS, dtype=cfg.jnp_dtype)


def _slots(table_BxM: Array, pos_BxT: Array, valid_BxT: Array, page_size: int):
    """(page, offset) [B, T] where each position is written; invalid ones go to page 0."""
    m = table_BxM.shape[1]
    col_BxT = jnp.clip(pos_BxT // page_size, 0, m - 1)
    page_BxT = jnp.take_along_axis(table_BxM, col_BxT, axis=1)
    return jnp.where(valid_BxT, page_BxT, 0), pos_BxT % page_size


def prefill_chunk(
    model: Transformer,
    weights: DecodeWeights,
    pool: PagedPool,
    tokens_BxC: Array,
    start_B: Array,
    lengths_B: Array,
    table_BxM: Array,
) -> PagedPool:
    """Writes the keys / values of tokens_BxC[b, :lengths_B[b]] at positions start_b.. .

    Row b's earlier positions 0..start_b-1 must already be in its pages; its pages must cover
    start_b + lengths_b positions. Rows with lengths_b == 0 are padding (write to page 0).
    Returns the updated pool.
    """
    cfg = model.config
    c = tokens_BxC.shape[1]
    pos_BxC = start_B[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]
    valid_BxC = jnp.arange(c, dtype=jnp.int32)[None, :] < lengths_B[:, None]
    page_BxC, offset_BxC = _slots(table_BxM, pos_BxC, valid_BxC, pool.page_size)
    cos, sin = rope_tables(pos_BxC, cfg.head_dim, cfg.rope_theta)
    x_BxCxD = embed(model, weights, tokens_BxC)
    ks, vs, ids = list(pool.k), list(pool.v), []
    record = pool.routes is not None
    last = len(weights.layers) - 1
    for i in range(len(weights.layers)):
        w, x_BxCxD = _layer(cfg, weights, i, x_BxCxD)
        q_BxCxNxH, k_BxCxKxH, v_BxCxKxH = attention_inputs(cfg, w, x_BxCxD, cos, sin)
        ks[i], keys = _write_and_gather(ks[i], k_BxCxKxH, page_BxC, offset_BxC, table_BxM)
        vs[i], vals = _write_and_gather(vs[i], v_BxCxKxH, page_BxC, offset_BxC, table_BxM)
        if i < last or record:  # the last layer's outputs: only its routing is read
            out = _paged_attention(cfg, q_BxCxNxH, keys, vals, pos_BxC)
            x_BxCxD = ffn_recording(cfg, w, x_BxCxD, out, ids if record else None)
    return PagedPool(tuple(ks), tuple(vs), _write_routes(pool.routes, ids, page_BxC, offset_BxC))


def _write_routes(routes: Array | None, ids: list, page_BxT: Array, offset_BxT: Array):
    """The routing record with the layers' routing (ids: L arrays [B, T, J]) written at the
    fed tokens' slots (None: no record)."""
    if routes is None:
        return None
    return routes.at[page_BxT, offset_BxT].set(jnp.stack(ids, axis=2).astype(routes.dtype))


def decode_step(
    model: Transformer,
    weights: DecodeWeights,
    pool: PagedPool,
    tokens_B: Array,
    pos_B: Array,
    active_B: Array,
    table_BxM: Array,
) -> tuple[Array, PagedPool]:
    """Feeds tokens_B[b] at position pos_B[b] of row b (positions < pos_b already in its
    pages): (fp32 logits [B, V] of the next token, updated pool). Inactive rows write to
    page 0 and their logits are garbage."""
    cfg = model.config
    pos_Bx1 = pos_B[:, None]
    page_Bx1, offset_Bx1 = _slots(table_BxM, pos_Bx1, active_B[:, None], pool.page_size)
    cos, sin = rope_tables(pos_Bx1, cfg.head_dim, cfg.rope_theta)
    x_Bx1xD = embed(model, weights, tokens_B[:, None])
    ks, vs, ids = list(pool.k), list(pool.v), []
    for i in range(len(weights.layers)):
        w, x_Bx1xD = _layer(cfg, weights, i, x_Bx1xD)
        q_Bx1xNxH, k_Bx1xKxH, v_Bx1xKxH = attention_inputs(cfg, w, x_Bx1xD, cos, sin)
        ks[i], keys = _write_and_gather(ks[i], k_Bx1xKxH, page_Bx1, offset_Bx1, table_BxM)
        vs[i], vals = _write_and_gather(vs[i], v_Bx1xKxH, page_Bx1, offset_Bx1, table_BxM)
        out = _paged_attention(cfg, q_Bx1xNxH, keys, vals, pos_Bx1)
        x_Bx1xD = ffn_recording(cfg, w, x_Bx1xD, out, ids if pool.routes is not None else None)
    routes = _write_routes(pool.routes, ids, page_Bx1, offset_Bx1)
    return output_logits(cfg, weights, x_Bx1xD[:, 0]), PagedPool(tuple(ks), tuple(vs), routes)


def request_uniforms(rng: Array, seed_B: Array, index_B: Array) -> Array:
    """[B] uniforms: entry b is `row_uniforms(rng, [seed_b], index_b + 1)[0, index_b]`, the
    random input of a request's index_b-th draw (independent of slot and step)."""

    def one(seed, index):
        return uniforms(jax.random.fold_in(jax.random.fold_in(rng, seed), index), 1)[0]

    return jax.vmap(one)(seed_B, index_B)


def draw(rng: Array, logits_BxV: Array, settings: dict[str, Array]) -> tuple[Array, ...]:
    """`draw_with_uniforms` with per-request streams: settings holds [B] "seed", "index",
    "temperature", "top_k", "top_p". Returns (tokens, sampling log-probs, raw log-probs)."""
    u_B = request_uniforms(rng, settings["seed"], settings["index"])
    return draw_with_uniforms(
        u_B, logits_BxV, settings["temperature"], settings["top_k"], settings["top_p"]
    )


def copy_page(pool: PagedPool, src: Array, dst: Array) -> PagedPool:
    """Page `dst` of every layer becomes a copy of page `src` (copy-on-write)."""

    def cp(x):
        return jax.lax.dynamic_update_index_in_dim(x, jax.lax.dynamic_index_in_dim(x, src), dst, 0)

    routes = None if pool.routes is None else cp(pool.routes)
    return PagedPool(tuple(cp(x) for x in pool.k), tuple(cp(x) for x in pool.v), routes)


def page_routes(routes: Array, table_M: Array) -> Array:
    """The routing record (`PagedPool.routes`) of one sequence's pages table_M:
    [M * page_size, L, J]."""
    rows = routes[table_M]
    return rows.reshape(-1, *rows.shape[2:])


def sample_step(
    model: Transformer,
    weights: DecodeWeights,
    pool: PagedPool,
    rng: Array,
    batch: dict[str, Any],
) -> tuple[tuple[Array, ...], PagedPool]:
    """`decode_step` then `draw`: batch holds [B] "tokens", "pos", "active", the draw's
    settings, and "table" [B, M]. Returns ((tokens, log-probs, raw log-probs), pool)."""
    logits_BxV, pool = decode_step(
        model, weights, pool, batch["tokens"], batch["pos"], batch["active"], batch["table"]
    )
    return draw(rng, logits_BxV, batch), pool


def sample_steps(
    model: Transformer,
    weights: DecodeWeights,
    pool: PagedPool,
    rng: Array,
    batch: dict[str, Any],
    num_steps: int,
) -> tuple[tuple[Array, ...], PagedPool]:
    """Up to `num_steps` `sample_step`s in one call (multi-step decode: one host round trip and
    one dispatch for several tokens per row).

    batch: `sample_step`'s, plus [B] "steps" (tokens row b may draw in this call, <= num_steps)
    and [B, S] "stop" (its stop ids, -1 padded). Row b runs while it is active, has drawn fewer
    than steps_b tokens and has not drawn a stop id; each draw feeds the previous one at the
    next position and uses the next index of the row's random stream, so the tokens equal
    those of num_steps single-step calls. A stopped row writes only the scratch page.
    Returns ((tokens, log-probs, raw log-probs, drawn) each [B, num_steps], pool); drawn[b, j]
    says whether row b drew its j-th token here.
    """

    def body(carry, step):
        pool, tokens_B, pos_B, index_B, alive_B = carry
        active_B = alive_B & (step < batch["steps"])
        inner = {**batch, "tokens": tokens_B, "pos": pos_B, "index": index_B, "active": active_B}
        (tok_B, lp_B, raw_B), pool = sample_step(model, weights, pool, rng, inner)
        stopped_B = jnp.any(tok_B[:, None] == batch["stop"], axis=-1)
        more_B = active_B.astype(jnp.int32)
        carry = (
            pool,
            jnp.where(active_B, tok_B, tokens_B),
            pos_B + more_B,
            index_B + more_B,
            alive_B & ~(active_B & stopped_B),
        )
        return carry, (tok_B, lp_B, raw_B, active_B)

    init = (pool, batch["tokens"], batch["pos"], batch["index"], batch["active"])
    steps = jnp.arange(num_steps, dtype=jnp.int32)
    (pool, *_), outs = jax.lax.scan(body, init, steps)
    return tuple(x.T for x in outs), pool


def engine_weights(model: Transformer, params: Any) -> DecodeWeights:
    """The engine's own copies (jitted: `weights_jit`): `fused_layers.decode_weights`' fused
    per-layer weights and unembedding, without a mixture-of-experts layer's experts and
    without `params` (`with_params` attaches those by reference, no copy)."""
    w = decode_weights(model, params)
    layers = w.layers
    if model.config.is_moe:
        layers = tuple({k: v for k, v in layer.items() if k != "mlp"} for layer in layers)
    return w.replace(layers=layers, params={})


def kept_params(model: Transformer, params: Any) -> dict[str, Any]:
    """The params the engine's calls read as they are: embedding, final norm, and a
    mixture-of-experts model's stacked experts (each call slices its layer's experts, so the
    engine never keeps a second copy of them)."""
    kept = {k: v for k, v in params.items() if k != "layers"}
    if model.config.is_moe:
        kept["layers"] = {"mlp": params["layers"]["mlp"]}
    return kept


def with_params(model: Transformer, weights: DecodeWeights, params: Any) -> Any:
    """`weights` (`engine_weights`) holding `kept_params(params)` by reference (no copy)."""
    return weights.replace(params=kept_params(model, params))


def _layer(cfg, weights: DecodeWeights, i: int, x: Array) -> tuple[dict[str, Any], Array]:
    """(layer i's weights as the decode path takes them, x): a MoE layer's experts sliced from
    the stacked params inside the call, once x (the layer's input) exists: the index passes a
    barrier with x, so no slice is made before its layer and one layer's are live at a time."""
    w = weights.layers[i]
    if cfg.is_moe and "mlp" not in w:
        index, x = jax.lax.optimization_barrier((jnp.int32(i), x))
        mlp = jax.tree.map(
            lambda a: jax.lax.dynamic_index_in_dim(a, index, keepdims=False),
            weights.params["layers"]["mlp"],
        )
        w = {**w, "mlp": mlp}
    return w, x


def buckets(limit: int, on: bool = True, minimum: int = 1) -> list[int]:
    """Sizes a bucketed dimension takes: powers of two from `minimum` (rounded up to one)
    below `limit`, then `limit` (off: `limit` only)."""
    if not on:
        return [limit]
    return [1 << i for i in range(limit.bit_length()) if minimum <= 1 << i < limit] + [limit]


# The jitted calls, shared by engines of the same model and shapes (the model is static, the
# pool donated: the writes are in place). TRACES[0] counts their traces (each compiles).
TRACES = [0]


def _traced(fn):
    def body(model, *args):
        TRACES[0] += 1
        return fn(model, *args)

    return functools.wraps(fn)(body)


weights_jit = tracing.jit(_traced(engine_weights), static_argnums=0)
prefill_jit = tracing.jit(_traced(prefill_chunk), static_argnums=0, donate_argnums=(2,))
decode_jit = tracing.jit(_traced(sample_steps), static_argnums=(0, 5), donate_argnums=(2,))
copy_jit = tracing.jit(
    _traced(lambda model, pool, src, dst: copy_page(pool, src, dst)),
    static_argnums=0,
    donate_argnums=(1,),
)
routes_jit = tracing.jit(
    _traced(lambda model, routes, table: page_routes(routes, table)), static_argnums=0
)

__all__ = [
    "TRACES",
    "PagedPool",
    "buckets",
    "copy_jit",
    "decode_jit",
    "prefill_jit",
    "weights_jit",
    "copy_page",
    "decode_step",
    "draw",
    "engine_weights",
    "init_pool",
    "kept_params",
    "page_routes",
    "pool_bytes",
    "prefill_chunk",
    "request_uniforms",
    "routes_jit",
    "sample_step",
    "sample_steps",
    "with_params",
]
