"""The sampler's host-side shapes: length and batch buckets, decode segments, and the per-row
sampling settings padded to the batch bucket (tg_jax.sampling.sampler and turn_cache use them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def segment_ends(n: int, segment: int) -> list[int]:
    """Where the decode loop's segments end: [segment, 2 * segment, ..., n] (0: [n]).

    Segment i's steps attend over a cache of P + ends[i] slots (`decode.extend` grows it
    between segments) instead of P + R: a step reads every slot of the cache, so the first
    segments read less. Each segment is its own `while_loop` (compiled separately), so short
    segments trade compile time for speed.
    """
    if segment < 0:
        raise ValueError(f"segment must be >= 0, got {segment}")
    if segment == 0 or segment >= n:
        return [n]
    return [min(n, end) for end in range(segment, n + segment, segment)]


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


def per_row(value, batch: int, dtype) -> np.ndarray:
    arr = np.asarray(value, dtype)
    return np.broadcast_to(arr, (batch,)).copy() if arr.ndim == 0 else arr


def pad_to(x: np.ndarray, b: int, fill: Any) -> np.ndarray:
    """[n] -> [b]: `x` followed by b - n copies of `fill` (the padding rows)."""
    return np.concatenate([x, np.full((b - x.shape[0],), fill, x.dtype)])


def padded_settings(
    b: int, max_new: np.ndarray, stop_BxW: np.ndarray, temperature: Any, top_k: Any, top_p: Any
) -> tuple[np.ndarray, ...]:
    """(max_new_B, stop_BxW, temperature_B, top_k_B, top_p_B): the rows' settings (each per row
    or shared) padded to `b` rows; padding rows sample nothing (max_new 0)."""
    n_rows = max_new.shape[0]
    return (
        pad_to(max_new, b, 0),
        stop_BxW,
        pad_to(per_row(temperature, n_rows, np.float32), b, 1.0),
        pad_to(per_row(top_k, n_rows, np.int32), b, 0),
        pad_to(per_row(top_p, n_rows, np.float32), b, 1.0),
    )


def padded_row_ids(row_ids: Sequence[int], n_rows: int, b: int) -> np.ndarray:
    """[b] int32 ids of the rows' random streams (`row_uniforms`), padding rows 0."""
    ids = np.asarray(row_ids, np.int32)
    if ids.shape != (n_rows,):
        raise ValueError(f"row_ids has shape {ids.shape}, expected ({n_rows},)")
    return pad_to(ids, b, 0)


def stop_lists(stop_ids: Any, n_rows: int) -> list[list[int]]:
    """`Sampler.sample`'s stop_ids as one list per row (one list shared by all rows, or one
    per row)."""
    if len(stop_ids) and isinstance(stop_ids[0], Sequence | np.ndarray):
        return [list(s) for s in stop_ids]
    return [list(stop_ids) for _ in range(n_rows)]


def stop_block(stop_ids, n_rows: int, b: int, stop_width: int) -> np.ndarray:
    """[b, W] stop ids per row padded with -1 (one list shared by all rows, or one per row)."""
    rows_stop = stop_lists(stop_ids, n_rows)
    if len(rows_stop) != n_rows:
        raise ValueError(f"{len(rows_stop)} stop-id lists for {n_rows} prompts")
    width = max(stop_width, max(len(s) for s in rows_stop))
    stop_BxW = np.full((b, width), -1, np.int32)
    for i, s in enumerate(rows_stop):
        stop_BxW[i, : len(s)] = s
    return stop_BxW
