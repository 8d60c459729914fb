"""Batched autoregressive sampling on the device: the model's prefill, then a `lax.while_loop`
of its steps (pure functions; `tg_jax.sampling.sampler.Sampler` pads a batch to the buckets and
runs them jitted).

Shapes (legend in `tg_jax.models`): B rows, a right-padded prompt block of P tokens (row b's
prompt is `prompt[b, :L_b]`), R new-token slots, V vocabulary, W stop ids per row.

Row b's prompt fills positions 0..L_b-1 (`tg_jax.models.decode.prefill` runs the whole block;
padding slots are never attended to). Its first new token is drawn from the logits at position
L_b - 1; generated token i is then fed back at position L_b + i (`decode_one`, cache slot
P + i, shared by all rows) and yields the logits of token i + 1. All rows draw their i-th
token in loop iteration i, so the output column is shared; the loop exits early once every row
has hit a stop id or its own budget. The draw itself (temperature, top-k, top-p, and which
log-prob is recorded) is `tg_jax.sampling.methods`; the trainer's importance ratio should use
`logprobs` (the behaviour policy that actually drew the token).

The entry points differ in what the cache holds before the loop (`decode_loop`, shared):
`sample_tokens` prefills the prompt block, `sample_prefilled` starts from a prefill done
elsewhere (each distinct prompt once, `tg_jax.sampling.turn_cache`), `sample_appended` from the
contexts kept since the last call, prefilling only the appended tokens.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from tg_jax.models import Transformer, decode
from tg_jax.sampling.methods import draw_with_uniforms
from tg_jax.sampling.rows import segment_ends

Array = jax.Array


@flax.struct.dataclass
class SamplingState:
    """Carry of the decode loop.

    Attributes:
      step: [] int32, tokens drawn so far by every live row (= next output column).
      tokens_BxR: [B, R] int32 drawn tokens, `pad_id` past a row's end.
      logprobs_BxR: [B, R] f32 log-probs under the sampling distribution (module docstring).
      raw_logprobs_BxR: [B, R] f32 temperature-1 log-probs of the same tokens.
      lengths_B: [B] int32 tokens generated per row (stop token included).
      stopped_B: [B] bool, the row ended on one of its stop ids.
      done_B: [B] bool, the row draws no more tokens.
      last_token_B: [B] int32, the token to feed at the next decode step.
      cache: the model's decode cache (`tg_jax.models.decode`), P + R slots.
    """

    step: Array
    tokens_BxR: Array
    logprobs_BxR: Array
    raw_logprobs_BxR: Array
    lengths_B: Array
    stopped_B: Array
    done_B: Array
    last_token_B: Array
    cache: decode.DecodeCache


@flax.struct.dataclass
class SampleOutput:
    """What `sample_tokens` returns (device arrays, padded to the buckets)."""

    tokens_BxR: Array
    logprobs_BxR: Array
    raw_logprobs_BxR: Array
    lengths_B: Array
    stopped_B: Array
    routes_BxSxLxJ: Array | None = None  # with a routing record: `decode.context_routes`


def _record(state: SamplingState, tokens_B, lp_B, raw_B, stop_ids_BxW, max_new_B, pad_id):
    """Writes the tokens drawn at column `state.step` and updates the per-row stop flags."""
    live_B = ~state.done_B
    tokens_B = jnp.where(live_B, tokens_B, pad_id)
    col = state.step

    def put(buf_BxR, val_B):
        return jax.lax.dynamic_update_slice(buf_BxR, val_B[:, None].astype(buf_BxR.dtype), (0, col))

    is_stop_B = jnp.any(tokens_B[:, None] == stop_ids_BxW, axis=-1) & live_B
    lengths_B = state.lengths_B + live_B.astype(jnp.int32)
    return state.replace(
        step=col + 1,
        tokens_BxR=put(state.tokens_BxR, tokens_B),
        logprobs_BxR=put(state.logprobs_BxR, jnp.where(live_B, lp_B, 0.0)),
        raw_logprobs_BxR=put(state.raw_logprobs_BxR, jnp.where(live_B, raw_B, 0.0)),
        lengths_B=lengths_B,
        stopped_B=state.stopped_B | is_stop_B,
        done_B=state.done_B | is_stop_B | (lengths_B >= max_new_B),
        last_token_B=tokens_B,
    )


def sample_tokens(
    model: Transformer,
    params: Any,
    prompt_BxP: Array,
    prompt_lengths_B: Array,
    max_new_B: Array,
    stop_ids_BxW: Array,
    temperature_B: Array,
    top_k_B: Array,
    top_p_B: Array,
    u_BxR: Array,
    *,
    pad_id: int,
    segment: int = 0,
    routes: bool = False,
) -> SampleOutput:
    """Prefill + decode loop (pure; jit it with `pad_id`, `segment` and `routes` static).

    Rows are independent, so a shard of rows (with its rows of every argument) samples exactly
    what the whole batch samples for them.

    Args:
      prompt_BxP: [B, P] int32 right-padded prompts.
      prompt_lengths_B: [B] int32, 1 <= L_b <= P.
      max_new_B: [B] int32, at most R; 0 makes the row a no-op (batch padding).
      stop_ids_BxW: [B, W] int32 stop ids per row, padded with -1.
      temperature_B, top_k_B, top_p_B: [B] sampling settings (module docstring).
      u_BxR: [B, R] uniform numbers in (0, 1), column i for the i-th token of every row
        (`step_uniforms(rng, B, R)`); R is the number of output columns.
      segment: decode-loop segment length (`segment_ends`; 0 = one loop over all R slots).
      routes: MoE: with the routing record (`decode.prefill(routes=True)`).
    Returns:
      SampleOutput with [B, R] tokens / log-probs and [B] lengths / stopped flags.
    """
    r = u_BxR.shape[1]
    weights = decode.decode_weights(model, params)
    logits_BxV, cache = decode.prefill(
        model,
        params,
        prompt_BxP,
        prompt_lengths_B,
        r,
        slots=segment_ends(r, segment)[0],
        weights=weights,
        routes=routes,
    )
    settings = (max_new_B, stop_ids_BxW, temperature_B, top_k_B, top_p_B, u_BxR)
    return decode_loop(
        model, weights, logits_BxV, cache, *settings, pad_id=pad_id, segment=segment
    )[0]


def sample_prefilled(
    model: Transformer,
    params: Any,
    logits_BxV: Array,
    cache: decode.DecodeCache,
    *settings,
    pad_id: int,
    segment: int = 0,
) -> tuple[SampleOutput, decode.DecodeCache]:
    """`sample_tokens` from an already prefilled cache (`prefill`'s logits and cache, with
    `segment_ends(R, segment)[0]` generated slots); `settings` are `sample_tokens`' arguments
    from `max_new_B` on. Returns the output and the cache after the loop."""
    weights = decode.decode_weights(model, params)
    return decode_loop(model, weights, logits_BxV, cache, *settings, pad_id=pad_id, segment=segment)


def sample_appended(
    model: Transformer,
    params: Any,
    cache: decode.DecodeCache,
    new_BxA: Array,
    new_lengths_B: Array,
    *settings,
    pad_id: int,
    segment: int = 0,
) -> tuple[SampleOutput, decode.DecodeCache]:
    """`sample_tokens` of contexts kept in `cache` (`decode.keep_context`) followed by
    new_BxA[b, :new_lengths_B[b]] (`decode.prefill_append` prefills only those); `settings`
    as in `sample_prefilled`. Returns the output and the cache after the loop."""
    r = settings[-1].shape[1]
    weights = decode.decode_weights(model, params)
    logits_BxV, cache = decode.prefill_append(
        model, weights, cache, new_BxA, new_lengths_B, r, slots=segment_ends(r, segment)[0]
    )
    return decode_loop(model, weights, logits_BxV, cache, *settings, pad_id=pad_id, segment=segment)


def decode_loop(
    model: Transformer,
    weights: decode.DecodeWeights,
    logits_BxV: Array,
    cache: decode.DecodeCache,
    max_new_B: Array,
    stop_ids_BxW: Array,
    temperature_B: Array,
    top_k_B: Array,
    top_p_B: Array,
    u_BxR: Array,
    *,
    pad_id: int,
    segment: int = 0,
) -> tuple[SampleOutput, decode.DecodeCache]:
    """The decode loop after a prefill: draws token 0 from `logits_BxV` (the logits at each
    row's last prompt token), then token i + 1 after feeding token i (`decode_one`). With the
    cache's routing record, the output has each row's by position (prompt and generated
    tokens but the last, which counts as not fed: `decode.context_routes`).

    Args:
      cache: the prefilled cache with `segment_ends(R, segment)[0]` generated slots.
      (others: see `sample_tokens`.)
    Returns:
      (SampleOutput, the cache after the loop: P + R slots, generated token i of row b at
      slot P + i for i < lengths_B[b] - 1; the last drawn token is never fed).
    """
    b, r = u_BxR.shape
    ends = segment_ends(r, segment)
    state = SamplingState(
        step=jnp.zeros((), jnp.int32),
        tokens_BxR=jnp.full((b, r), pad_id, jnp.int32),
        logprobs_BxR=jnp.zeros((b, r), jnp.float32),
        raw_logprobs_BxR=jnp.zeros((b, r), jnp.float32),
        lengths_B=jnp.zeros((b,), jnp.int32),
        stopped_B=jnp.zeros((b,), bool),
        done_B=max_new_B <= 0,
        last_token_B=jnp.full((b,), pad_id, jnp.int32),
        cache=cache,
    )
    settings = (temperature_B, top_k_B, top_p_B)
    first = draw_with_uniforms(u_BxR[:, 0], logits_BxV, *settings)
    state = _record(state, *first, stop_ids_BxW, max_new_B, pad_id)

    def body(s: SamplingState):
        # Feeds the token drawn last (generated token step - 1) and draws the next one.
        logits_BxV, cache = decode.decode_one(model, weights, s.last_token_B, s.step - 1, s.cache)
        u_B = jax.lax.dynamic_slice_in_dim(u_BxR, s.step, 1, axis=1)[:, 0]
        drawn = draw_with_uniforms(u_B, logits_BxV, *settings)
        return _record(s.replace(cache=cache), *drawn, stop_ids_BxW, max_new_B, pad_id)

    for i, end in enumerate(ends):
        # Steps up to `end` write generated slots < end: the cache holds exactly those.
        if i:
            state = state.replace(cache=decode.extend(state.cache, end))
        state = jax.lax.while_loop(
            lambda s, end=end: (s.step < end) & ~jnp.all(s.done_B), body, state
        )
    out = SampleOutput(
        tokens_BxR=state.tokens_BxR,
        logprobs_BxR=state.logprobs_BxR,
        raw_logprobs_BxR=state.raw_logprobs_BxR,
        lengths_B=state.lengths_B,
        stopped_B=state.stopped_B,
        routes_BxSxLxJ=None
        if cache.routes is None
        else decode.context_routes(state.cache, jnp.maximum(state.lengths_B - 1, 0)),
    )
    return out, state.cache


__all__ = [
    "SampleOutput",
    "SamplingState",
    "decode_loop",
    "sample_appended",
    "sample_prefilled",
    "sample_tokens",
]
