"""Keys and values kept on the device across `Sampler.sample` calls (multi-turn rollouts).

A multi-turn episode's context grows append-only (tg_jax.sampling.rollout): turn k's prompt is
turn k - 1's prompt, its sampled tokens, and what the environment appended (observation,
hint, assistant header). With a `TurnCache` each call prefills only that tail:

  first call   the distinct prompts are prefilled once (`decode.prefill`; the G rollouts of a
               GRPO group share one row) and the cache rows are repeated for the rows that
               share them; then the decode loop (`decoding.sample_prefilled`).
  later calls  `decode.keep_context` gathers the rows still sampled (episodes that ended are
               dropped), each row's prompt and generated tokens made contiguous again in a
               prompt block of the call's prompt bucket P; `decode.prefill_append` prefills the
               appended tokens, which start with the row's last drawn token (never fed to
               the decode loop, so not in the cache); then the decode loop.

Rows, their order and the batch, prompt and new-token buckets of a call are those of the
re-prefilling `Sampler.sample` (every live row at its index, padding rows last), and so are
the random numbers: the tokens drawn are the same up to float rounding of the logits (the
cached keys and values come from the decode step rather than one prefill of the whole context).

The host keeps, per key, the tokens whose keys and values are cached; a call whose prompt does
not extend them raises ValueError (contexts must be append-only).
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from tg_jax import tracing
from tg_jax.models import decode
from tg_jax.sampling.rows import batch_bucket, length_bucket, segment_ends

if TYPE_CHECKING:
    from tg_jax.sampling.sampler import Sampler


@functools.partial(tracing.jit, static_argnums=0, static_argnames=("max_new", "slots", "routes"))
def _prefill(model, params, prompt_UxP, lengths_U, *, max_new: int, slots: int, routes: bool):
    return decode.prefill(model, params, prompt_UxP, lengths_U, max_new, slots=slots, routes=routes)


@tracing.jit
def _take_rows(logits_UxV, cache: decode.DecodeCache, rows_B):
    """Rows `rows_B` of a prefill's logits and cache (repeats allowed)."""
    cache = cache.replace(
        k=tuple(x[rows_B] for x in cache.k),
        v=tuple(x[rows_B] for x in cache.v),
        prompt_lengths_B=cache.prompt_lengths_B[rows_B],
        routes=None if cache.routes is None else cache.routes[rows_B],
    )
    return logits_UxV[rows_B], cache


_keep_context = tracing.jit(decode.keep_context, static_argnames="prompt_slots")


class TurnCache:
    """The decode cache of the rows of the last `Sampler.sample(..., cache=self)` call.

    Attributes:
      kv: the cache after that call's decode loop (None before the first call).
      rows: key -> its row in `kv`.
      cached: key -> the tokens whose keys and values `kv` holds (prompt + generated[:-1]).
      generated: key -> how many of those were generated (the rest is the row's prompt).
    """

    def __init__(self):
        self.kv: decode.DecodeCache | None = None
        self.rows: dict[Hashable, int] = {}
        self.cached: dict[Hashable, list[int]] = {}
        self.generated: dict[Hashable, int] = {}

    def run(
        self,
        sampler: Sampler,
        params: Any,
        prompts: Sequence[Sequence[int]],
        keys: Sequence[Hashable] | None,
        settings: Sequence[np.ndarray],
        rng: jax.Array,
        n: int,
        row_ids_B: np.ndarray | None = None,
    ) -> tuple[Any, np.ndarray]:
        """One `Sampler.sample` call through the cache: (SampleOutput, [B] prefilled tokens).

        Args:
          prompts, keys: the call's rows (every key new, or every key cached).
          settings: the padded per-row arrays from max_new_B on (`sample_tokens`).
          n: R, the new-token bucket.
          row_ids_B: the rows' random-stream ids (`Sampler.run`), or None.
        """
        if keys is None or len(keys) != len(prompts) or len(set(keys)) != len(keys):
            raise ValueError("a cached sample() call needs one distinct key per prompt")
        b = settings[0].shape[0]
        if self.kv is None:
            out, self.kv, counts = self._first(
                sampler, params, prompts, settings, rng, n, b, row_ids_B
            )
        else:
            out, self.kv, counts = self._next(
                sampler, params, prompts, keys, settings, rng, n, b, row_ids_B
            )
        return out, counts

    def _first(self, sampler, params, prompts, settings, rng, n, b, row_ids_B=None):
        """Prefills every distinct prompt once, repeats its rows, runs the decode loop."""
        index: dict[tuple[int, ...], int] = {}
        rows = [index.setdefault(tuple(int(t) for t in p), len(index)) for p in prompts]
        unique = [list(p) for p in index]
        block_UxP, lengths_U = sampler.pad_block(
            unique, batch_bucket(len(unique), sampler.batch_divisor)
        )
        rows_B = np.zeros((b,), np.int32)
        rows_B[: len(rows)] = rows
        slots = segment_ends(n, sampler.segment)[0]
        _, context = sampler.in_mesh(params)
        with context:
            block_UxP, lengths_U = sampler.place([block_UxP, lengths_U])
            logits, kv = _prefill(
                sampler.model,
                params,
                block_UxP,
                lengths_U,
                max_new=n,
                slots=slots,
                routes=sampler.record_routes,
            )
            logits, kv = _take_rows(logits, kv, rows_B)
        out, kv = sampler.run("prefilled", params, (logits, kv, *settings), rng, n, row_ids_B)
        shared = np.bincount(rows, minlength=len(unique))[rows]
        counts = np.array([len(p) for p in prompts], np.float32) / shared
        return out, kv, counts

    def _next(self, sampler, params, prompts, keys, settings, rng, n, b, row_ids_B=None):
        """Keeps the rows of `keys`, prefills what their prompts append, runs the decode loop."""
        new = []
        for key, prompt in zip(keys, prompts, strict=True):
            have = self.cached.get(key)
            if have is None or len(prompt) <= len(have) or list(prompt[: len(have)]) != have:
                raise ValueError(
                    f"row {key!r}: its prompt does not extend the context cached for it "
                    "(a cached call's rows must all be cached and append-only)"
                )
            new.append(list(prompt[len(have) :]))
        rows_B = np.zeros((b,), np.int32)
        rows_B[: len(keys)] = [self.rows[k] for k in keys]
        generated_B = np.zeros((b,), np.int32)  # padding rows: row 0's
        generated_B[:] = self.generated[keys[0]]
        generated_B[: len(keys)] = [self.generated[k] for k in keys]
        block_BxA, new_lengths_B = sampler.pad_block(new, b)
        p = length_bucket(max(len(x) for x in prompts), sampler.length_multiple)
        _, context = sampler.in_mesh(params)
        with context:
            kept = _keep_context(self.kv, *sampler.place([rows_B, generated_B]), prompt_slots=p)
        out, kv = sampler.run(
            "appended", params, (kept, block_BxA, new_lengths_B, *settings), rng, n, row_ids_B
        )
        return out, kv, np.array([len(x) for x in new], np.float32)

    def record(
        self,
        prompts: Sequence[Sequence[int]],
        keys: Sequence[Hashable],
        tokens: Sequence[np.ndarray],
    ) -> None:
        """After a call: row i of `kv` is keys[i], caching its prompt and tokens[i][:-1]."""
        self.rows = {k: i for i, k in enumerate(keys)}
        self.cached = {
            k: [int(t) for t in p] + [int(t) for t in toks[:-1]]
            for k, p, toks in zip(keys, prompts, tokens, strict=True)
        }
        self.generated = {k: max(len(t) - 1, 0) for k, t in zip(keys, tokens, strict=True)}


__all__ = ["TurnCache"]
