"""Sampling methods: pure functions from logits (and uniform numbers) to drawn tokens.

The decode loop (`tg_jax.sampling.decoding`) calls `draw_with_uniforms` once per step with
per-row settings, all arrays (so changing them does not recompile). Which distribution a
token is drawn from (and which log-prob is recorded as the sampler's `logprobs`):

  1. z = logits / temperature                       (row's temperature T > 0)
  2. top-k: keep the k largest z (k = 0: keep all)
  3. top-p: of those, keep the smallest prefix (by decreasing z) whose softmax mass >= p
     (p = 1: keep all); ties at the cut-off logit are all kept
  4. q = softmax(z over the kept tokens); token ~ q (inverse CDF, one uniform per row);
     `logprobs` = log q(token)

With T == 0 the row is greedy: the token is argmax(logits) and q is the point mass on it, so
`logprobs` = 0. `raw_logprobs` is always log_softmax(logits)(token), the temperature-1 log-prob
of the unfiltered model, i.e. what the trainer's forward pass recomputes. For T = 1, k = 0,
p = 1 the two agree. Shape letters: the legend in `tg_jax.models` (R: the draws of a call).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array
_NEG_INF = -1e30  # finite, so that a fully masked row still gives a (harmless) softmax


def filter_logits(logits_BxV: Array, temperature_B: Array, top_k_B: Array, top_p_B: Array) -> Array:
    """Temperature-scaled logits with everything outside top-k / top-p set to a large negative.

    Args:
      logits_BxV: [B, V] fp32 model logits.
      temperature_B: [B] f32, > 0 (greedy rows are handled by the caller).
      top_k_B: [B] int32, 0 = no top-k.
      top_p_B: [B] f32 in (0, 1], 1 = no top-p.
    Returns:
      [B, V] fp32 logits of the sampling distribution (softmax of them = q of the docstring).
    """
    z_BxV = logits_BxV / temperature_B[:, None]
    vocab = z_BxV.shape[-1]
    needs_filter = jnp.any((top_k_B > 0) & (top_k_B < vocab)) | jnp.any(top_p_B < 1.0)

    def filtered(z):
        sorted_BxV = -jnp.sort(-z, axis=-1)
        k_B = jnp.where((top_k_B > 0) & (top_k_B < vocab), top_k_B, vocab)
        rank_V = jnp.arange(vocab, dtype=jnp.int32)
        in_top_k_BxV = rank_V[None, :] < k_B[:, None]
        sorted_BxV = jnp.where(in_top_k_BxV, sorted_BxV, _NEG_INF)
        probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
        mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
        keep_BxV = in_top_k_BxV & ((mass_before_BxV < top_p_B[:, None]) | (rank_V[None, :] == 0))
        n_keep_B = jnp.sum(keep_BxV, axis=-1)
        cutoff_B = jnp.take_along_axis(sorted_BxV, (n_keep_B - 1)[:, None], axis=-1)[:, 0]
        return jnp.where(z >= cutoff_B[:, None], z, _NEG_INF)

    # The RL default (plain temperature) skips the sort, which matters at V = 151,936.
    return jax.lax.cond(needs_filter, filtered, lambda z: z, z_BxV)


def first_argmax(x_BxV: Array) -> Array:
    """argmax over the last axis (first index on ties) as two plain reductions.

    XLA:CPU runs `jnp.argmax` as a (value, index) variadic reduce, which was slower here.
    """
    vocab = x_BxV.shape[-1]
    is_max_BxV = x_BxV == jnp.max(x_BxV, axis=-1, keepdims=True)
    ids_V = jnp.arange(vocab, dtype=jnp.int32)
    return jnp.min(jnp.where(is_max_BxV, ids_V[None, :], vocab), axis=-1)


def blocked_cumsum(x_BxV: Array, block: int = 16) -> Array:
    """Inclusive cumulative sum over the last axis as two small matmuls.

    Sums within blocks of `block` entries (x @ an upper-triangular ones matrix), then adds the
    totals of the blocks before (totals @ a strictly upper-triangular one). XLA:CPU lowers
    `jnp.cumsum` to a chain of reduce-windows, several kernels per decode step. The sums agree
    with `jnp.cumsum` to float rounding (they are added in another order).
    """
    b, v = x_BxV.shape
    nb = -(-v // block)
    # [B, nb, block] blocks; `within` [B, nb, block], `before` [B, nb]
    blocks = jnp.pad(x_BxV, ((0, 0), (0, nb * block - v))).reshape(b, nb, block)
    in_block, of_blocks = jnp.arange(block), jnp.arange(nb)
    within = blocks @ (in_block[:, None] <= in_block[None, :]).astype(x_BxV.dtype)
    before = within[..., -1] @ (of_blocks[:, None] < of_blocks[None, :]).astype(x_BxV.dtype)
    return (within + before[..., None]).reshape(b, nb * block)[:, :v]


def uniforms(rng: Array, batch: int) -> Array:
    """[B] uniform numbers in (0, 1): the random input of `draw_with_uniforms` (one per row)."""
    return jax.random.uniform(rng, (batch,), minval=jnp.finfo(jnp.float32).tiny)


def draw_with_uniforms(
    u_B: Array, logits_BxV: Array, temperature_B: Array, top_k_B: Array, top_p_B: Array
) -> tuple[Array, Array, Array]:
    """Draws one token per row by inverting the CDF of the sampling distribution.

    One uniform number per row (u_B, in (0, 1)) instead of a Gumbel number per vocabulary
    entry (the random bits dominated a CPU decode step). A token with probability 0 (filtered
    out) is never drawn: the CDF is flat over it, and the drawn index is the first whose CDF
    reaches u * total.

    Returns:
      (tokens [B] int32, log-prob under the sampling distribution [B], temperature-1 log-prob
      [B]); greedy rows (temperature 0) take the argmax with sampling log-prob 0.
    """
    vocab = logits_BxV.shape[-1]
    greedy_B = temperature_B <= 0.0
    safe_t_B = jnp.where(greedy_B, 1.0, temperature_B)
    z_BxV = filter_logits(logits_BxV, safe_t_B, top_k_B, top_p_B)
    # One exponential pass serves both log q's normaliser and the CDF (unnormalised: the
    # draw compares it with u * its total).
    lse_z_B, exp_BxV = _logsumexp_and_exp(z_BxV)
    cdf_BxV = blocked_cumsum(exp_BxV)
    sampled_B = jnp.sum(cdf_BxV < (u_B * cdf_BxV[:, -1])[:, None], axis=-1, dtype=jnp.int32)
    sampled_B = jnp.minimum(sampled_B, vocab - 1)
    tokens_B = jnp.where(greedy_B, first_argmax(logits_BxV), sampled_B)
    z_B = jnp.take_along_axis(z_BxV, tokens_B[:, None], axis=-1)[:, 0]
    lp_B = jnp.where(greedy_B, 0.0, z_B - lse_z_B)
    logit_B = jnp.take_along_axis(logits_BxV, tokens_B[:, None], axis=-1)[:, 0]
    # The same normaliser arithmetic as lse_z: at temperature 1 without top-k / top-p the two
    # log-probs are equal.
    return tokens_B, lp_B, logit_B - _logsumexp_and_exp(logits_BxV)[0]


def _logsumexp_and_exp(x_BxV: Array) -> tuple[Array, Array]:
    """(logsumexp over the last axis [B], exp(x - max) [B, V]); rows hold finite values."""
    max_B = jnp.max(x_BxV, axis=-1)
    exp_BxV = jnp.exp(x_BxV - max_B[:, None])
    return max_B + jnp.log(jnp.sum(exp_BxV, axis=-1)), exp_BxV


def step_uniforms(rng: Array, batch: int, steps: int) -> Array:
    """[B, R] uniform numbers: column i is `uniforms(fold_in(rng, i), B)`, the random input of
    the i-th draw of `sample_tokens`. Drawn all at once before the loop (the PRNG was a
    noticeable share of a CPU decode step); split the rows over devices and each shard draws
    exactly what the unsharded sampler would."""
    keys = jax.vmap(lambda i: jax.random.fold_in(rng, i))(jnp.arange(steps, dtype=jnp.int32))
    return jax.vmap(lambda k: uniforms(k, batch))(keys).T


def row_uniforms(rng: Array, row_ids_B: Array, steps: int) -> Array:
    """[B, R] uniform numbers: entry (b, i) is `uniforms(fold_in(fold_in(rng, row_ids_B[b]),
    i), 1)`, so a row's draws depend only on its id, not on its position or the batch."""

    def row(row_id):
        key = jax.random.fold_in(rng, row_id)
        cols = jnp.arange(steps, dtype=jnp.int32)
        return jax.vmap(lambda i: uniforms(jax.random.fold_in(key, i), 1)[0])(cols)

    return jax.vmap(row)(row_ids_B)


__all__ = [
    "blocked_cumsum",
    "draw_with_uniforms",
    "filter_logits",
    "first_argmax",
    "row_uniforms",
    "step_uniforms",
    "uniforms",
]
