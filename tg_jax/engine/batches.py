"""The host side of the engine's device calls: a call's arrays from its sequences, and the
draws a decode call returns taken back into them.

The `Engine` decides which sequences a call runs (admission, pages, preemption); these
functions only lay those rows out as the jitted calls of `tg_jax.engine.paged` take them
(padding rows are inactive: they write only the scratch page) and read the drawn tokens back.
"""

from __future__ import annotations

import numpy as np

from tg_jax.engine.requests import Sequence


def prefill_arrays(
    rows: list[tuple[Sequence, int]], num_rows: int, chunk: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A prefill call's (tokens [num_rows, chunk], start [num_rows], lengths [num_rows]): row i
    feeds rows[i]'s next n context tokens from its first uncached position; padding rows have
    length 0."""
    tokens = np.full((num_rows, chunk), pad_id, np.int32)
    start, lengths = np.zeros((num_rows,), np.int32), np.zeros((num_rows,), np.int32)
    for i, (seq, n) in enumerate(rows):
        tokens[i, :n] = seq.tokens[seq.cached : seq.cached + n]
        start[i], lengths[i] = seq.cached, n
    return tokens, start, lengths


def decode_arrays(
    rows: list[Sequence], size: int, steps: list[int], stop_width: int, pad_id: int
) -> dict[str, np.ndarray]:
    """A decode call's arrays but its page table (`paged.sample_steps`' batch): row i is
    rows[i] feeding its last token and drawing up to steps[i] tokens, padded to `size` rows;
    a request's first `stop_width` stop ids are checked on the device."""
    pad, w, reqs = size - len(rows), stop_width, [s.request for s in rows]

    def col(values, fill, dtype):
        return np.asarray([*values, *[fill] * pad], dtype)

    stop = [(list(r.stop_ids)[:w] + [-1] * w)[:w] for r in reqs] + [[-1] * w] * pad
    return {
        "tokens": col([s.tokens[-1] for s in rows], pad_id, np.int32),
        "pos": col([s.cached for s in rows], 0, np.int32),
        "active": col([True] * len(rows), False, bool),
        "seed": col([r.stream() for r in reqs], 0, np.int32),
        "index": col([s.generated for s in rows], 0, np.int32),
        "temperature": col([r.temperature for r in reqs], 1.0, np.float32),
        "top_k": col([r.top_k for r in reqs], 0, np.int32),
        "top_p": col([r.top_p for r in reqs], 1.0, np.float32),
        "steps": col(steps, 0, np.int32),
        "stop": np.asarray(stop, np.int32).reshape(size, w),
    }


def take_draws(
    seq: Sequence,
    tok_N: np.ndarray,
    lp_N: np.ndarray,
    raw_N: np.ndarray,
    drawn_N: np.ndarray,
    version: int,
) -> tuple[int, str | None]:
    """Appends the tokens one row of a decode call drew (with their log-probs and the weights'
    version) to its sequence, up to its first stop id or the end of its token budget (the
    host's check: draws past it are dropped). Returns (tokens taken, finish reason or None)."""
    n, reason = 0, None
    while reason is None and n < len(drawn_N) and drawn_N[n]:
        seq.tokens.append(int(tok_N[n]))
        seq.logprobs.append(float(lp_N[n]))
        seq.raw_logprobs.append(float(raw_N[n]))
        seq.versions.append(version)
        n += 1
        if seq.tokens[-1] in seq.request.stop_ids:
            reason = "stop"
        elif seq.generated >= seq.request.max_new_tokens:
            reason = "length"
    return n, reason


__all__ = ["decode_arrays", "prefill_arrays", "take_draws"]
