"""The host side of batched sampling: `Sampler` pads a batch of prompts to the buckets, runs the
jitted prefill and decode loop (`tg_jax.sampling.decoding`) and returns each row's tokens and
log-probs (`SampleResult`).

Everything that varies between calls within a bucket (prompt lengths, stop ids, max new tokens,
temperature, top-k, top-p, rng) is an array, so only the bucketed shapes (B, P, R, W) trigger
compilation. Multi-turn rollouts pass a `TurnCache` (tg_jax.sampling.turn_cache): the rows'
keys and values stay on the device between calls and a call prefills only the appended tokens
(`decoding.sample_appended`), or each distinct prompt once (`decoding.sample_prefilled`).

Also here: the sampler's log-probs against the trainer's (`sequence_logprobs`,
`logprob_mismatch`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from tg_jax import tracing
from tg_jax.models import Transformer, decode, forward
from tg_jax.sampling.decoding import (
    SampleOutput,
    SamplingState,
    decode_loop,
    sample_appended,
    sample_prefilled,
    sample_tokens,
)
from tg_jax.sampling.methods import row_uniforms, step_uniforms
from tg_jax.sampling.rows import (
    batch_bucket,
    length_bucket,
    pad_to,
    padded_row_ids,
    padded_settings,
    per_row,
    segment_ends,
    stop_block,
)

Array = jax.Array


class PromptCache(Protocol):
    """What `Sampler.sample` asks of a cache of prompts kept between calls
    (`tg_jax.sampling.turn_cache.TurnCache` is the one there is)."""

    def run(
        self,
        sampler: Sampler,
        params: Any,
        prompts: Sequence[Sequence[int]],
        keys: Sequence[Hashable] | None,
        settings: Sequence[np.ndarray],
        rng: Array,
        n: int,
        row_ids_B: np.ndarray | None = None,
    ) -> tuple[Any, np.ndarray]:
        """One sample call through the cache: (SampleOutput, [B] prefilled tokens)."""

    def record(
        self,
        prompts: Sequence[Sequence[int]],
        keys: Sequence[Hashable],
        tokens: Sequence[np.ndarray],
    ) -> None:
        """After a call: caches each row's prompt and its sampled tokens."""


@dataclasses.dataclass
class SampleResult:
    """Host-side (numpy) result of `Sampler.sample`, one entry per requested row.

    Attributes:
      tokens: per row, [n_b] int32 generated ids (stop token included when `stopped`).
      logprobs: per row, [n_b] f32 log-probs under the sampling distribution.
      raw_logprobs: per row, [n_b] f32 temperature-1 log-probs.
      stopped: [B] bool, the row ended on a stop id (else it hit its max new tokens).
      prefill_tokens: [B] f32 prompt tokens the call ran through the model for the row (a
        prefill shared by k rows counts 1 / k to each); None when not counted.
      routes: with `record_routes`, per row [prompt + n_b - routes_from_b, L, J] int16: the
        experts each layer routed each token to when it was fed, from position routes_from_b
        (`Sampler.sample`), -1 for the last token; else None.
    """

    tokens: list[np.ndarray]
    logprobs: list[np.ndarray]
    raw_logprobs: list[np.ndarray]
    stopped: np.ndarray
    prefill_tokens: np.ndarray | None = None
    routes: list[np.ndarray] | None = None


_routes_window = tracing.jit(decode.routes_window, static_argnums=2)


def _from_start(out: SampleOutput, lengths, start, n: int, multiple: int) -> SampleOutput:
    """`out` with its routing record (if any) cut to each row's positions from `start` on, [B,
    W, L, J] (W bucketed: the rows' prompt beyond their start and the n new-token slots)."""
    if out.routes_BxSxLxJ is None:
        return out
    routes = out.routes_BxSxLxJ
    w = min(length_bucket(int((lengths - start).max()) + n, multiple), routes.shape[1])
    return out.replace(routes_BxSxLxJ=_routes_window(routes, pad_to(start, routes.shape[0], 0), w))


def _checked_rows(
    prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """([B] prompt lengths, [B] max new tokens) of a `Sampler.sample` call: raises ValueError
    unless there is a row, every prompt is non-empty and max_new_tokens is shared or per row."""
    n_rows = len(prompts)
    lengths = np.array([len(p) for p in prompts], np.int32)
    if n_rows == 0 or lengths.min() < 1:
        raise ValueError("sample() needs at least one row and non-empty prompts")
    max_new = per_row(max_new_tokens, n_rows, np.int32)
    if max_new.shape != (n_rows,):
        raise ValueError(f"max_new_tokens has shape {max_new.shape}, expected ({n_rows},)")
    return lengths, max_new


def _host_result(
    out: SampleOutput, lengths: np.ndarray, start: np.ndarray, prefilled: np.ndarray
) -> SampleResult:
    """The requested rows of a host copy of the output (`jax.device_get`): each cut to its
    length, its routing record (if any) to its positions from `start` on."""
    n_rows = len(lengths)
    ln = out.lengths_B
    routes = out.routes_BxSxLxJ
    return SampleResult(
        tokens=[out.tokens_BxR[i, : ln[i]] for i in range(n_rows)],
        logprobs=[out.logprobs_BxR[i, : ln[i]] for i in range(n_rows)],
        raw_logprobs=[out.raw_logprobs_BxR[i, : ln[i]] for i in range(n_rows)],
        stopped=np.asarray(out.stopped_B[:n_rows]),
        prefill_tokens=prefilled,
        routes=None
        if routes is None
        else [np.asarray(routes[i, : lengths[i] + ln[i] - start[i]]) for i in range(n_rows)],
    )


# The jitted entry points by kind: what precedes the shared sampling settings in their arguments.
_KINDS = {"prompt": sample_tokens, "prefilled": sample_prefilled, "appended": sample_appended}


class Sampler:
    """Host-side driver: pads a batch of prompts to the buckets and runs the jitted sampler.

    Compiles once per (batch bucket, prompt bucket, new-token bucket, stop width), and with a
    `TurnCache` per appended-block bucket too; everything else is an argument. `num_traces`
    counts traces of the jitted function (for tests/logs).
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
        record_routes: bool = False,
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
        record_routes: MoE: results carry each row's routing record (`SampleResult.routes`,
          for router replay in the trainer).
        """
        self.model = model
        self.pad_id = int(pad_id)
        self.length_multiple = length_multiple
        self.batch_divisor = batch_divisor
        self.stop_width = stop_width
        self.mesh, self.rules = mesh, rules
        segment_ends(1, segment)  # validates it
        self.segment = int(segment)
        if record_routes and not model.config.is_moe:
            raise ValueError("a routing record (router replay) needs a mixture-of-experts model")
        self.record_routes = bool(record_routes)
        self.num_traces = 0
        self._jitted = tracing.jit(
            self._traced, static_argnames=("kind", "max_new_bucket", "per_shard", "per_row")
        )

    def _traced(
        self, params, *arrays, kind: str, max_new_bucket: int, per_shard: bool, per_row: bool
    ):
        """`_KINDS[kind]` on the padded arrays (the last one the rng; with `per_row`, the one
        before it the rows' random-stream ids); with `per_shard`, one decode loop per shard of
        rows (`_row_axes`)."""
        self.num_traces += 1  # Runs only while tracing: counts compilations.
        *rows, rng = arrays
        if per_row:
            *rows, row_ids_B = rows
            u_BxR = row_uniforms(rng, row_ids_B, max_new_bucket)
        else:
            # Every kind's arguments end with (max_new_B, stop_ids_BxW, temperature_B, top_k_B,
            # top_p_B): the padded batch is max_new_B's.
            u_BxR = step_uniforms(rng, rows[-5].shape[0], max_new_bucket)
        fn = functools.partial(_KINDS[kind], self.model, pad_id=self.pad_id, segment=self.segment)
        if kind == "prompt":
            fn = functools.partial(fn, routes=self.record_routes)
        if per_shard:
            spec = jax.P(self._row_axes())
            specs = [_row_specs(x, spec) for x in rows]
            caches = [s for s in specs if isinstance(s, decode.DecodeCache)]
            out_specs = (spec, *caches) if caches else spec  # (output, cache) when cached
            fn = jax.shard_map(
                fn, mesh=self.mesh, in_specs=(jax.P(), *specs, spec), out_specs=out_specs
            )
        return fn(params, *rows, u_BxR)

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
        row_ids: Sequence[int] | None = None,
        cache: PromptCache | None = None,
        keys: Sequence[Hashable] | None = None,
        routes_from: Sequence[int] | None = None,
    ) -> SampleResult:
        """Samples a continuation of every prompt.

        Args:
          params: model params (on the sampler's devices).
          prompts: B token-id lists (each non-empty).
          max_new_tokens: per row or shared.
          stop_ids: one list shared by every row, or one list per row.
          temperature, top_k, top_p: per row or shared (module docstring).
          rng: PRNG key.
          row_ids: per row, an int32 id of its random stream: row b's draws then depend only
            on (rng, row_ids[b]) (`row_uniforms`), not on its position or the batch size, so
            a row samples the same in any batch (e.g. on whichever host samples it). None:
            draws by position in the batch (`step_uniforms`).
          cache: keeps every row's keys and values for the next call (multi-turn): a row whose
            key it holds prefills only what its prompt appends to that row's context
            (`tg_jax.sampling.turn_cache`). Same tokens as without it (to float rounding).
          keys: with `cache`, the rows' ids in it.
          routes_from: with `record_routes`, per row the first position whose routing record
            the result carries (the caller holds the rest from earlier calls): only that
            window leaves the devices. None: from 0.
        Returns:
          SampleResult with B rows.
        """
        n_rows = len(prompts)
        lengths, max_new = _checked_rows(prompts, max_new_tokens)
        b = batch_bucket(n_rows, self.batch_divisor)
        n = length_bucket(max(int(max_new.max()), 1), self.length_multiple)
        stops = stop_block(stop_ids, n_rows, b, self.stop_width)
        settings = padded_settings(b, max_new, stops, temperature, top_k, top_p)
        row_ids_B = None if row_ids is None else padded_row_ids(row_ids, n_rows, b)
        if cache is None:
            out, prefilled = self._sample_uncached(params, prompts, settings, rng, n, row_ids_B)
        else:
            out, prefilled = cache.run(
                self, params, prompts, keys, settings, rng, n, row_ids_B=row_ids_B
            )
        start = np.zeros((n_rows,), np.int32) if routes_from is None else np.asarray(routes_from)
        out = _from_start(out, lengths, start, n, self.length_multiple)
        result = _host_result(jax.device_get(out), lengths, start, prefilled)
        if cache is not None:
            cache.record(prompts, keys, result.tokens)
        return result

    def _sample_uncached(
        self,
        params: Any,
        prompts: Sequence[Sequence[int]],
        settings: Sequence[np.ndarray],
        rng: Array,
        n: int,
        row_ids_B: np.ndarray | None,
    ) -> tuple[SampleOutput, np.ndarray]:
        """A `sample` call without a cache: every prompt prefilled whole (`sample_tokens`);
        (SampleOutput, [B] prefilled tokens), as `PromptCache.run`."""
        b = settings[0].shape[0]
        lengths = np.array([len(p) for p in prompts], np.int32)
        prompt_BxP, _ = self.pad_block(prompts, b)
        args = (prompt_BxP, pad_to(lengths, b, 1), *settings)
        out = self.run("prompt", params, args, rng, n, row_ids_B=row_ids_B)
        return out, lengths.astype(np.float32)

    def pad_block(self, rows: Sequence[Sequence[int]], b: int) -> tuple[np.ndarray, np.ndarray]:
        """([b, length bucket] right-padded token block, [b] lengths (padding rows: 1))."""
        lengths = np.ones((b,), np.int32)
        lengths[: len(rows)] = [len(r) for r in rows]
        block = np.full(
            (b, length_bucket(int(lengths.max()), self.length_multiple)), self.pad_id, np.int32
        )
        for i, ids in enumerate(rows):
            block[i, : len(ids)] = ids
        return block, lengths

    def in_mesh(self, params: Any) -> tuple[bool, Any]:
        """(one decode loop per shard of rows, the context to run jitted code in)."""
        if self.mesh is None:
            return False, contextlib.nullcontext()
        from tg_jax import sharding  # noqa: PLC0415 (only the sharded path needs it)

        replicated = all(
            getattr(x, "sharding", None) is not None and x.sharding.is_fully_replicated
            for x in jax.tree.leaves(params)
        )
        if replicated and self._row_axes() is not None:
            return True, contextlib.nullcontext()
        return False, sharding.activation_sharding(self.mesh, self.rules)

    def place(self, args: Sequence[Any]) -> list[Any]:
        """Host arrays (rows first) placed with the mesh's batch sharding; device values kept."""
        if self.mesh is None:
            return list(args)
        from tg_jax import sharding  # noqa: PLC0415 (only the sharded path needs it)

        return [
            jax.device_put(a, sharding.data_sharding(self.mesh, self.rules, a.ndim))
            if isinstance(a, np.ndarray)
            else a
            for a in args
        ]

    def run(
        self,
        kind: str,
        params: Any,
        args: Sequence[Any],
        rng: Array,
        n: int,
        row_ids_B: np.ndarray | None = None,
    ) -> Any:
        """The jitted `_KINDS[kind]` on `args` (its arguments between params and the uniform
        numbers) with R = n output columns: a SampleOutput, and for the cached kinds the cache
        after the loop too. With `row_ids_B`, row b draws from its own stream (`row_uniforms`)."""
        per_shard, context = self.in_mesh(params)
        per_row = row_ids_B is not None
        args = (*args, row_ids_B) if per_row else tuple(args)
        with context:
            return self._jitted(
                params,
                *self.place(args),
                rng,
                kind=kind,
                max_new_bucket=n,
                per_shard=per_shard,
                per_row=per_row,
            )


def _row_specs(x: Any, spec: Any) -> Any:
    """shard_map specs of a row-major argument: `spec` for arrays, and for a decode cache its
    per-row arrays split like rows (its RoPE tables replicated)."""
    if isinstance(x, decode.DecodeCache):
        return x.replace(
            k=(spec,) * len(x.k),
            v=(spec,) * len(x.v),
            prompt_lengths_B=spec,
            rope_cos=jax.P(),
            rope_sin=jax.P(),
            routes=None if x.routes is None else spec,
        )
    return spec


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
    "decode_loop",
    "logprob_mismatch",
    "sample_appended",
    "sample_prefilled",
    "sample_tokens",
    "sequence_logprobs",
]
