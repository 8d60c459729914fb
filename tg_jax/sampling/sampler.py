"""Batched autoregressive sampling with a KV cache: jitted prefill, then a `lax.while_loop`.

Shapes: B rows, a right-padded prompt block of P tokens (row b's prompt is `prompt[b, :L_b]`),
N new-token slots, a KV cache of P + N slots, V vocabulary.

Row b's prompt fills positions 0..L_b-1 (prefill runs the model on the whole block; padding
slots are never attended to). Its first new token is drawn from the logits at position L_b - 1;
generated token i is then fed back at position L_b + i (cache slot P + i, shared by all rows:
see tg_jax.sampling.decode_step) and yields the logits of token i + 1. All rows draw their i-th
token in loop iteration i, so the output column is shared; the loop exits early once every row
has hit a stop id or its own budget.

Which distribution a token is drawn from (and which log-prob is recorded as `logprobs`):

  1. z = logits / temperature                       (row's temperature T > 0)
  2. top-k: keep the k largest z (k = 0: keep all)
  3. top-p: of those, keep the smallest prefix (by decreasing z) whose softmax mass >= p
     (p = 1: keep all); ties at the cut-off logit are all kept
  4. q = softmax(z over the kept tokens); token ~ q (inverse CDF, one uniform per row);
     `logprobs` = log q(token)

With T == 0 the row is greedy: the token is argmax(logits) and q is the point mass on it, so
`logprobs` = 0. `raw_logprobs` is always log_softmax(logits)(token), the temperature-1 log-prob
of the unfiltered model, i.e. what the trainer's forward pass recomputes. For T = 1, k = 0,
p = 1 the two agree. The trainer's importance ratio should use `logprobs` (the behaviour
policy that actually drew the token).

Everything that varies between calls within a bucket (prompt lengths, stop ids, max new tokens,
temperature, top-k, top-p, rng) is an array, so only the bucketed shapes (B, P, N, stop width)
trigger compilation. Multi-turn rollouts re-prefill the whole context each turn (see
tg_jax.sampling.rollout): one batched forward, cheap next to the token-by-token decode.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from tg_jax.models import Transformer, forward
from tg_jax.sampling.decode_step import DecodeCache, decode_one, decode_weights, extend, prefill

Array = jax.Array
_NEG_INF = -1e30  # finite, so that a fully masked row still gives a (harmless) softmax


@flax.struct.dataclass
class SamplingState:
    """Carry of the decode loop.

    Attributes:
      step: [] int32, tokens drawn so far by every live row (= next output column).
      tokens_BxN: [B, N] int32 drawn tokens, `pad_id` past a row's end.
      logprobs_BxN: [B, N] f32 log-probs under the sampling distribution (module docstring).
      raw_logprobs_BxN: [B, N] f32 temperature-1 log-probs of the same tokens.
      lengths_B: [B] int32 tokens generated per row (stop token included).
      stopped_B: [B] bool, the row ended on one of its stop ids.
      done_B: [B] bool, the row draws no more tokens.
      last_token_B: [B] int32, the token to feed at the next decode step.
      cache: the decode cache (tg_jax.sampling.decode_step), P + N slots.
    """

    step: Array
    tokens_BxN: Array
    logprobs_BxN: Array
    raw_logprobs_BxN: Array
    lengths_B: Array
    stopped_B: Array
    done_B: Array
    last_token_B: Array
    cache: DecodeCache


@flax.struct.dataclass
class SampleOutput:
    """What `sample_tokens` returns (device arrays, padded to the buckets)."""

    tokens_BxN: Array
    logprobs_BxN: Array
    raw_logprobs_BxN: Array
    lengths_B: Array
    stopped_B: Array


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

    XLA:CPU runs `jnp.argmax` as a (value, index) variadic reduce that is ~4x slower here.
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
    x_BxNxK = jnp.pad(x_BxV, ((0, 0), (0, nb * block - v))).reshape(b, nb, block)
    r_K, r_N = jnp.arange(block), jnp.arange(nb)
    within_BxNxK = x_BxNxK @ (r_K[:, None] <= r_K[None, :]).astype(x_BxV.dtype)
    before_BxN = within_BxNxK[..., -1] @ (r_N[:, None] < r_N[None, :]).astype(x_BxV.dtype)
    return (within_BxNxK + before_BxN[..., None]).reshape(b, nb * block)[:, :v]


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


def _record(state: SamplingState, tokens_B, lp_B, raw_B, stop_ids_BxS, max_new_B, pad_id):
    """Writes the tokens drawn at column `state.step` and updates the per-row stop flags."""
    live_B = ~state.done_B
    tokens_B = jnp.where(live_B, tokens_B, pad_id)
    col = state.step

    def put(buf_BxN, val_B):
        return jax.lax.dynamic_update_slice(buf_BxN, val_B[:, None].astype(buf_BxN.dtype), (0, col))

    is_stop_B = jnp.any(tokens_B[:, None] == stop_ids_BxS, axis=-1) & live_B
    lengths_B = state.lengths_B + live_B.astype(jnp.int32)
    return state.replace(
        step=col + 1,
        tokens_BxN=put(state.tokens_BxN, tokens_B),
        logprobs_BxN=put(state.logprobs_BxN, jnp.where(live_B, lp_B, 0.0)),
        raw_logprobs_BxN=put(state.raw_logprobs_BxN, jnp.where(live_B, raw_B, 0.0)),
        lengths_B=lengths_B,
        stopped_B=state.stopped_B | is_stop_B,
        done_B=state.done_B | is_stop_B | (lengths_B >= max_new_B),
        last_token_B=tokens_B,
    )


def step_uniforms(rng: Array, batch: int, steps: int) -> Array:
    """[B, N] uniform numbers: column i is `uniforms(fold_in(rng, i), B)`, the random input
    of the i-th draw of `sample_tokens`. Drawn all at once before the loop (a CPU decode step spent
    a noticeable share of its time in the PRNG); split the rows over devices and each shard
    draws exactly what the unsharded sampler would."""
    keys = jax.vmap(lambda i: jax.random.fold_in(rng, i))(jnp.arange(steps, dtype=jnp.int32))
    return jax.vmap(lambda k: uniforms(k, batch))(keys).T


def segment_ends(n: int, segment: int) -> list[int]:
    """Where the decode loop's segments end: [segment, 2 * segment, ..., n] (0: [n]).

    Segment i's steps attend over a cache of P + ends[i] slots (`decode_step.extend` grows it
    between segments) instead of P + N: a step reads every slot of the cache, so the first
    segments read less. Each segment is its own `while_loop` (compiled separately), so short
    segments trade compile time for speed.
    """
    if segment < 0:
        raise ValueError(f"segment must be >= 0, got {segment}")
    if segment == 0 or segment >= n:
        return [n]
    return [min(n, end) for end in range(segment, n + segment, segment)]


def sample_tokens(
    model: Transformer,
    params: Any,
    prompt_BxP: Array,
    prompt_lengths_B: Array,
    max_new_B: Array,
    stop_ids_BxS: Array,
    temperature_B: Array,
    top_k_B: Array,
    top_p_B: Array,
    u_BxN: Array,
    *,
    pad_id: int,
    segment: int = 0,
) -> SampleOutput:
    """Prefill + decode loop (pure; jit it with `pad_id` and `segment` static).

    Rows are independent, so a shard of rows (with its rows of every argument) samples exactly
    what the whole batch samples for them.

    Args:
      prompt_BxP: [B, P] int32 right-padded prompts.
      prompt_lengths_B: [B] int32, 1 <= L_b <= P.
      max_new_B: [B] int32, at most N; 0 makes the row a no-op (batch padding).
      stop_ids_BxS: [B, S] int32 stop ids per row, padded with -1.
      temperature_B, top_k_B, top_p_B: [B] sampling settings (module docstring).
      u_BxN: [B, N] uniform numbers in (0, 1), column i for the i-th token of every row
        (`step_uniforms(rng, B, N)`); N is the number of output columns.
      segment: decode-loop segment length (`segment_ends`; 0 = one loop over all N slots).
    Returns:
      SampleOutput with [B, N] tokens / log-probs and [B] lengths / stopped flags.
    """
    b, n = u_BxN.shape
    ends = segment_ends(n, segment)
    weights = decode_weights(model, params)
    logits_BxV, cache = prefill(
        model, params, prompt_BxP, prompt_lengths_B, n, slots=ends[0], weights=weights
    )
    state = SamplingState(
        step=jnp.zeros((), jnp.int32),
        tokens_BxN=jnp.full((b, n), pad_id, jnp.int32),
        logprobs_BxN=jnp.zeros((b, n), jnp.float32),
        raw_logprobs_BxN=jnp.zeros((b, n), jnp.float32),
        lengths_B=jnp.zeros((b,), jnp.int32),
        stopped_B=jnp.zeros((b,), bool),
        done_B=max_new_B <= 0,
        last_token_B=jnp.full((b,), pad_id, jnp.int32),
        cache=cache,
    )
    settings = (temperature_B, top_k_B, top_p_B)
    first = draw_with_uniforms(u_BxN[:, 0], logits_BxV, *settings)
    state = _record(state, *first, stop_ids_BxS, max_new_B, pad_id)

    def body(s: SamplingState):
        # Feeds the token drawn last (generated token step - 1) and draws the next one.
        logits_BxV, cache = decode_one(model, weights, s.last_token_B, s.step - 1, s.cache)
        u_B = jax.lax.dynamic_slice_in_dim(u_BxN, s.step, 1, axis=1)[:, 0]
        drawn = draw_with_uniforms(u_B, logits_BxV, *settings)
        return _record(s.replace(cache=cache), *drawn, stop_ids_BxS, max_new_B, pad_id)

    for i, end in enumerate(ends):
        # Steps up to `end` write generated slots < end: the cache holds exactly those.
        if i:
            state = state.replace(cache=extend(state.cache, end))
        state = jax.lax.while_loop(
            lambda s, end=end: (s.step < end) & ~jnp.all(s.done_B), body, state
        )
    return SampleOutput(
        tokens_BxN=state.tokens_BxN,
        logprobs_BxN=state.logprobs_BxN,
        raw_logprobs_BxN=state.raw_logprobs_BxN,
        lengths_B=state.lengths_B,
        stopped_B=state.stopped_B,
    )


def length_bucket(n: int, multiple: int = 64, minimum: int = 8) -> int:
    """Padded size for a length n: powers of two up to `multiple`, then multiples of it.

    Few buckets at short lengths (8, 16, 32, 64) and at most `multiple - 1` wasted slots above.
    """
    n = max(int(n), minimum)
    if n <= multiple:
        return 1 << (n - 1).bit_length()
    return -(-n // multiple) * multiple


def batch_bucket(n: int, divisor: int = 1) -> int:
    """Padded batch size: the next power of two, rounded up to a multiple of `divisor`."""
    b = 1 << (max(int(n), 1) - 1).bit_length()
    return -(-b // divisor) * divisor


@dataclasses.dataclass
class SampleResult:
    """Host-side (numpy) result of `Sampler.sample`, one entry per requested row.

    Attributes:
      tokens: per row, [n_b] int32 generated ids (stop token included when `stopped`).
      logprobs: per row, [n_b] f32 log-probs under the sampling distribution.
      raw_logprobs: per row, [n_b] f32 temperature-1 log-probs.
      stopped: [B] bool, the row ended on a stop id (else it hit its max new tokens).
    """

    tokens: list[np.ndarray]
    logprobs: list[np.ndarray]
    raw_logprobs: list[np.ndarray]
    stopped: np.ndarray


def _per_row(value, batch: int, dtype) -> np.ndarray:
    arr = np.asarray(value, dtype)
    return np.broadcast_to(arr, (batch,)).copy() if arr.ndim == 0 else arr


class Sampler:
    """Host-side driver: pads a batch of prompts to the buckets and runs the jitted sampler.

    Compiles once per (batch bucket, prompt bucket, new-token bucket, stop width); everything
    else is an argument. `num_traces` counts traces of the jitted function (for tests/logs).
    """

    def __init__(
        self,
        model: Transformer,
        *,
        pad_id: int,
        length_multiple: int = 64,
        batch_divisor: int = 1,
        stop_width: int = 4,
        mesh: Any = None,
        rules: Any = None,
        segment: int = 64,
    ):
        """Args:
        pad_id: id written past each row's end (and in prompt padding).
        length_multiple: see `length_bucket` (prompt block and new-token buckets).
        batch_divisor: padded batches are multiples of it (the mesh's batch split).
        stop_width: stop-id slots per row (rows with more stop ids widen it, and recompile).
        mesh, rules: when given, the batch is sharded (params must already live on that
          mesh): with rows over every mesh axis and replicated params, one decode loop per
          device (`_row_axes`); else one loop under these activation shardings.
        segment: decode-loop segment length (`segment_ends`; 0 = one loop).
        """
        self.model = model
        self.pad_id = int(pad_id)
        self.length_multiple = length_multiple
        self.batch_divisor = batch_divisor
        self.stop_width = stop_width
        self.mesh, self.rules = mesh, rules
        segment_ends(1, segment)  # validates it
        self.segment = int(segment)
        self.num_traces = 0
        self._jitted = jax.jit(self._traced, static_argnames=("max_new_bucket", "per_shard"))

    def _traced(self, params, *arrays, max_new_bucket: int, per_shard: bool):
        """`sample_tokens` on the padded arrays (the last one the rng); with `per_shard`, one
        decode loop per shard of rows (`_row_axes`)."""
        self.num_traces += 1  # Runs only while tracing: counts compilations.
        *rows, rng = arrays
        u_BxN = step_uniforms(rng, rows[0].shape[0], max_new_bucket)
        fn = functools.partial(sample_tokens, self.model, pad_id=self.pad_id, segment=self.segment)
        if per_shard:
            spec = jax.P(self._row_axes())
            fn = jax.shard_map(
                fn, mesh=self.mesh, in_specs=(jax.P(), *[spec] * len(rows), spec),
                out_specs=spec,
            )  # fmt: skip
        return fn(params, *rows, u_BxN)

    def _row_axes(self) -> tuple[str, ...] | None:
        """The mesh axes rows are split over when they are all the mesh's axes (rows are then
        independent per device: each runs its own loop, with no collective per step, and
        stops when its own rows are done); else None (one loop under the activation rules)."""
        from tg_jax import sharding  # noqa: PLC0415 (only the sharded path needs it)

        spec = sharding.data_sharding(self.mesh, self.rules, 1).spec[0]
        axes = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
        used = {a for a in self.mesh.axis_names if self.mesh.shape[a] > 1}
        return axes if axes and used <= set(axes) else None

    def sample(
        self,
        params: Any,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int | Sequence[int],
        stop_ids: Sequence[int] | Sequence[Sequence[int]] = (),
        temperature: float | Sequence[float] = 1.0,
        top_k: int | Sequence[int] = 0,
        top_p: float | Sequence[float] = 1.0,
        rng: Array,
    ) -> SampleResult:
        """Samples a continuation of every prompt.

        Args:
          params: model params (on the sampler's devices).
          prompts: B token-id lists (each non-empty).
          max_new_tokens: per row or shared.
          stop_ids: one list shared by every row, or one list per row.
          temperature, top_k, top_p: per row or shared (module docstring).
          rng: PRNG key.
        Returns:
          SampleResult with B rows.
        """
        n_rows = len(prompts)
        lengths = np.array([len(p) for p in prompts], np.int32)
        if n_rows == 0 or lengths.min() < 1:
            raise ValueError("sample() needs at least one row and non-empty prompts")
        max_new = _per_row(max_new_tokens, n_rows, np.int32)
        b = batch_bucket(n_rows, self.batch_divisor)
        p = length_bucket(int(lengths.max()), self.length_multiple)
        n = length_bucket(max(int(max_new.max()), 1), self.length_multiple)

        prompt_BxP = np.full((b, p), self.pad_id, np.int32)
        for i, ids in enumerate(prompts):
            prompt_BxP[i, : len(ids)] = ids
        rows_stop = (
            [list(s) for s in stop_ids]
            if len(stop_ids) and isinstance(stop_ids[0], Sequence | np.ndarray)
            else [list(stop_ids)] * n_rows
        )
        if len(rows_stop) != n_rows:
            raise ValueError(f"{len(rows_stop)} stop-id lists for {n_rows} prompts")
        if max_new.shape != (n_rows,):
            raise ValueError(f"max_new_tokens has shape {max_new.shape}, expected ({n_rows},)")
        width = max(self.stop_width, max(len(s) for s in rows_stop))
        stop_BxS = np.full((b, width), -1, np.int32)
        for i, s in enumerate(rows_stop):
            stop_BxS[i, : len(s)] = s

        def pad_rows(x, fill):
            return np.concatenate([x, np.full((b - n_rows,), fill, x.dtype)])

        args = (
            prompt_BxP,
            pad_rows(lengths, 1),
            pad_rows(max_new, 0),
            stop_BxS,
            pad_rows(_per_row(temperature, n_rows, np.float32), 1.0),
            pad_rows(_per_row(top_k, n_rows, np.int32), 0),
            pad_rows(_per_row(top_p, n_rows, np.float32), 1.0),
        )
        out = self._run(params, args, rng, n)
        out = jax.device_get(out)
        ln = out.lengths_B
        return SampleResult(
            tokens=[out.tokens_BxN[i, : ln[i]] for i in range(n_rows)],
            logprobs=[out.logprobs_BxN[i, : ln[i]] for i in range(n_rows)],
            raw_logprobs=[out.raw_logprobs_BxN[i, : ln[i]] for i in range(n_rows)],
            stopped=np.asarray(out.stopped_B[:n_rows]),
        )

    def _run(self, params, args, rng, n: int) -> SampleOutput:
        if self.mesh is None:
            return self._jitted(params, *args, rng, max_new_bucket=n, per_shard=False)
        from tg_jax import sharding  # noqa: PLC0415 (only the sharded path needs it)

        placed = [
            jax.device_put(a, sharding.data_sharding(self.mesh, self.rules, a.ndim)) for a in args
        ]
        replicated = all(
            getattr(x, "sharding", None) is not None and x.sharding.is_fully_replicated
            for x in jax.tree.leaves(params)
        )
        if replicated and self._row_axes() is not None:
            return self._jitted(params, *placed, rng, max_new_bucket=n, per_shard=True)
        with sharding.activation_sharding(self.mesh, self.rules):
            return self._jitted(params, *placed, rng, max_new_bucket=n, per_shard=False)


def sequence_logprobs(
    model: Transformer, params: Any, tokens_BxT: Array, temperature: float = 1.0
) -> Array:
    """log p(token_t | tokens_<t) from one full forward: [B, T] (column 0 is 0)."""
    logits_BxTxV = forward(model, params, tokens_BxT)[:, :-1] / temperature
    lp_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
    lp_BxT1 = jnp.take_along_axis(lp_BxTxV, tokens_BxT[:, 1:, None], axis=-1)[..., 0]
    return jnp.pad(lp_BxT1, ((0, 0), (1, 0)))


def logprob_mismatch(
    behaviour_logprobs_BxT: Array | np.ndarray,
    trainer_logprobs_BxT: Array | np.ndarray,
    mask_BxT: Array | np.ndarray,
) -> dict[str, Array]:
    """Sampler vs trainer log-prob gap on the sampled tokens (a health metric to log).

    Args:
      behaviour_logprobs_BxT: [B, T] log-probs recorded by the sampler.
      trainer_logprobs_BxT: [B, T] log-probs the trainer recomputes for the same tokens.
      mask_BxT: [B, T] 1 on sampled tokens (where the comparison is meaningful).
    Returns:
      {"mean_abs": [], "max_abs": []} over masked tokens (0 when the mask is empty).
    """
    mask = jnp.asarray(mask_BxT, jnp.float32)
    diff = jnp.abs(jnp.asarray(behaviour_logprobs_BxT) - jnp.asarray(trainer_logprobs_BxT)) * mask
    return {
        "mean_abs": jnp.sum(diff) / jnp.maximum(jnp.sum(mask), 1.0),
        "max_abs": jnp.max(diff, initial=0.0),
    }


__all__ = [
    "SampleOutput",
    "SampleResult",
    "Sampler",
    "SamplingState",
    "batch_bucket",
    "blocked_cumsum",
    "draw_with_uniforms",
    "filter_logits",
    "first_argmax",
    "length_bucket",
    "logprob_mismatch",
    "sample_tokens",
    "segment_ends",
    "sequence_logprobs",
    "step_uniforms",
    "uniforms",
]
