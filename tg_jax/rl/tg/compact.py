"""Compact teacher rows: only the trajectories (or turns) the teacher teaches, from the first hint.

`build_batch(..., compact=True)` lays the teacher out so that its forward pass costs only the
tokens where it differs from the student:

  * rows: a teacher row only for a trajectory with at least one targeted turn (per_trajectory)
    or for each targeted turn (per_turn); per micro-batch the rows are packed and their count
    rounded up to a row bucket (`row_bucket`), so a batch where few turns fail gets a small
    teacher batch and jit sees a bounded number of shapes;
  * columns: positions before the first inserted hint are token for token the student's own
    prefix, so the row starts at the first hint (student position p = turn_starts of the first
    targeted turn) and the teacher forward reads the prefix's keys and values from the student
    pass (`tg_jax.rl.tg.teacher`); the row ends after its last targeted turn (nothing after it is
    distilled), and its length is rounded up to the teacher length bucket.

Layout of teacher row r (global index; micro-batch r % M, local index r // M, like the student):
  teacher_tokens_BtxTt[r, j]: token j of the hinted sequence cut to [p, end of last targeted
    turn), i.e. hinted position p + j; teacher_positions_BtxTt[r, j] = p + j (RoPE position);
    teacher_segment_ids_BtxTt[r, j] = 1 on real tokens.
  teacher_src_row_Bt[r]: the student row (local to the micro-batch) whose prefix it continues.
  teacher_start_Bt[r]: p, the number of shared prefix tokens (the student's tokens [0, p)).
  Batch.teacher_prefix_len (static): p rounded up to the length bucket and at most T, for all
    rows: the number of student key/value slots the teacher attends to.
Padding rows have no real tokens (segment 0), p = 0 and source row 0.

Index map: (teacher_row_BxT[b, t], teacher_pos_BxT[b, t]) is the compact position whose logits
predict the teacher's copy of targets[b, t], valid at every t where that copy lies in the
compact row (t in [p - 1, end - 1) of a row with a teacher row), and (0, 0) elsewhere, where
the target has no hinted teacher counterpart (outside `Batch.tg_mask_BxT`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from tg_jax.sampling.trajectory import Trajectory

# Teacher rows per micro-batch are rounded up to one of these fractions of the cap.
_ROW_FRACTIONS = (8, 4, 2, 1)

# build_batch(compact=True, min_compact_saving=MIN_COMPACT_SAVING) (the RL step benchmark's
# batches) keeps compact rows only when they cut at least this share of the teacher's padded
# token slots (B_t x T_t) against full rows (`compaction_pays`). Compaction has fixed costs
# (the student's prefix capture, the per-row key/value gather and value projection, a second
# attention code path), so where it saves almost nothing (the first hint near the start of
# every row) full rows are cheaper. With every turn failed it saves the prefix before the
# first hint (~20% of the slots on the benchmark's batch), and there compact rows were as
# fast as full rows or faster in repeated alternating timings, so the bar sits below that.
MIN_COMPACT_SAVING = 0.1


def bucket_length(length: int, max_len: int, multiple: int) -> int:
    """Padded length: `length` rounded up to a multiple of `multiple`, capped at `max_len`.

    multiple = 0 always pads to max_len (one shape for the whole run).
    """
    if multiple <= 0:
        return max_len
    return min(max_len, -(-length // multiple) * multiple)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def row_bucket(rows: int, cap: int, multiple: int) -> int:
    """Teacher rows per micro-batch for `rows` rows: the smallest of cap / 8, cap / 4, cap / 2
    and cap (each rounded up to a multiple of `multiple`) that holds them; `multiple` when
    rows = 0 (a minimal teacher that compiles and runs in no time).

    Args:
      rows: the largest number of teacher rows of one micro-batch.
      cap: the most rows a micro-batch can have (a multiple of `multiple`).
      multiple: the mesh's batch divisor.
    """
    if rows > cap:
        raise ValueError(f"{rows} teacher rows > cap {cap}")
    multiple = max(multiple, 1)
    if rows == 0:
        return multiple
    for frac in _ROW_FRACTIONS:
        size = _round_up(_round_up(cap, frac) // frac, multiple)
        if size >= rows:
            return size
    return cap


def full_teacher_slots(
    trajectories: Sequence[Trajectory],
    hints: Sequence[dict[int, np.ndarray]],
    *,
    mode: str,
    rows: int,
    max_teacher_rows: int,
    teacher_max_len: int,
    pad_multiple: int,
) -> int:
    """B_t x T_t of the full (uncompacted) teacher rows of `build_batch`, from the lengths only
    (per_turn: T_t over every targeted turn, an upper bound when some are dropped)."""
    if mode == "per_trajectory":
        lengths = [
            len(t.tokens) + sum(len(h) for h in hs.values())
            for t, hs in zip(trajectories, hints, strict=True)
        ]
        t_rows = rows
    else:
        lengths = [
            turn_end(t, k) + len(h)
            for t, hs in zip(trajectories, hints, strict=True)
            for k, h in hs.items()
        ]
        t_rows = max_teacher_rows
    return t_rows * bucket_length(max(lengths, default=1), teacher_max_len, pad_multiple)


def compaction_pays(compact_slots: int, full_slots: int, min_saving: float) -> bool:
    """Whether compact teacher rows of `compact_slots` padded token slots (B_t x T_t) save at
    least `min_saving` of the full rows' `full_slots` (static: from the shapes)."""
    return compact_slots <= (1.0 - min_saving) * full_slots


def hinted(
    traj: Trajectory, hints: dict[int, np.ndarray], turns: Sequence[int], begin: int, end: int
) -> tuple[np.ndarray, np.ndarray]:
    """The student tokens [begin, end) with hints[k] inserted before turn_starts[k] of each of
    `turns`: (the sequence, for each of its tokens the student index it copies, -1 on a hint)."""
    tokens = np.asarray(traj.tokens, np.int32)
    pieces, srcs, prev = [], [], begin
    for k in sorted(turns):
        start = int(traj.turn_starts[k])
        pieces += [tokens[prev:start], np.asarray(hints[k], np.int32)]
        srcs += [np.arange(prev, start), np.full((len(hints[k]),), -1)]
        prev = start
    pieces.append(tokens[prev:end])
    srcs.append(np.arange(prev, end))
    return np.concatenate(pieces), np.concatenate(srcs).astype(np.int32)


def located(src: np.ndarray, num: int) -> np.ndarray:
    """[num]: where each of a trajectory's num tokens sits in a hinted sequence (`hinted`'s src),
    -1 where it does not."""
    out = np.full((num,), -1, np.int64)
    (idx,) = np.nonzero(src >= 0)
    out[src[idx]] = idx
    return out


def _hinted_span(
    traj: Trajectory, hints: dict[int, np.ndarray], turns: Sequence[int]
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """(p, seq, src, pos_T1): the hinted sequence of `turns` cut to [p, end of the last turn)
    with its sources (`hinted`), and for each student prediction position t the compact index
    predicting tokens[t + 1] (-1 where that token is outside the span)."""
    turns = sorted(turns)
    p = int(traj.turn_starts[turns[0]])
    seq, src = hinted(traj, hints, turns, p, turn_end(traj, turns[-1]))
    at = located(src, len(traj.tokens))[1:]  # student token j = t + 1; one less predicts it
    return p, seq, src, np.where(at >= 0, at - 1, -1)


def turn_end(traj: Trajectory, turn: int) -> int:
    """One past the last token of assistant turn `turn`."""
    (idx,) = np.nonzero(np.asarray(traj.turn_ids) == turn)
    return int(idx[-1]) + 1 if idx.size else int(traj.turn_starts[turn]) + 1


def compact_teacher(
    per_token: dict[str, np.ndarray],
    trajectories: Sequence[Trajectory],
    hints: Sequence[dict[int, np.ndarray]],
    turn_mask_fn: Callable[[Trajectory, int], np.ndarray],
    *,
    mode: str,
    rows: int,
    student_len: int,
    micro_batches: int,
    batch_multiple: int,
    max_teacher_rows: int,
    teacher_max_len: int,
    pad_multiple: int,
) -> tuple[dict[str, np.ndarray], int]:
    """Fills the index map and the hinted-target mask of compact teacher rows; returns
    (teacher arrays {"tokens", "positions", "segments", "src_row", "start"}, prefix slots).

    Args:
      per_token: the target-aligned arrays of `build_batch` (filled in place: "hinted",
        "t_row", "t_pos").
      trajectories, hints: the rows and, per row, targeted turn -> its non-empty hint.
      turn_mask_fn: (traj, k) -> [n - 1] bool, the produced tokens of turn k.
      mode: "per_trajectory" (one row per trajectory with a targeted turn) or "per_turn" (one
        per targeted turn, at most max_teacher_rows / micro_batches per micro-batch; the rest
        are not distilled, with a warning).
      rows: B; student_len: T.
    """
    cap = rows // micro_batches if mode == "per_trajectory" else max_teacher_rows // micro_batches
    per_micro: list[list[tuple[int, int, np.ndarray, np.ndarray]]] = [
        [] for _ in range(micro_batches)
    ]
    dropped = 0
    for b, (traj, turn_hints) in enumerate(zip(trajectories, hints, strict=True)):
        if not turn_hints:
            continue
        m = b % micro_batches
        groups = [sorted(turn_hints)] if mode == "per_trajectory" else [[k] for k in turn_hints]
        for turns in sorted(groups):
            if len(per_micro[m]) == cap:
                dropped += 1
                continue
            p, seq, src, pos_T1 = _hinted_span(traj, turn_hints, turns)
            if p + len(seq) > teacher_max_len:
                raise ValueError(
                    f"task {traj.task_id}: teacher sequence with hints has {p + len(seq)} "
                    f"tokens > teacher_max_len {teacher_max_len}"
                )
            local = len(per_micro[m])
            per_micro[m].append((b, p, seq, src))
            s = slice(0, len(traj.tokens) - 1)
            inside = pos_T1 >= 0
            per_token["t_row"][b, s][inside] = local
            per_token["t_pos"][b, s][inside] = pos_T1[inside]
            for k in turns:
                per_token["hinted"][b, s] |= turn_mask_fn(traj, k)
    if dropped:
        logging.warning(
            "build_batch: %d targeted turns exceed the teacher rows (%d per micro-batch) and "
            "are not distilled",
            dropped,
            cap,
        )
    return _pack(
        per_micro, cap, micro_batches, batch_multiple, student_len, teacher_max_len, pad_multiple
    )


def _pack(
    per_micro: list[list[tuple[int, int, np.ndarray, np.ndarray]]],
    cap: int,
    micro_batches: int,
    batch_multiple: int,
    student_len: int,
    teacher_max_len: int,
    multiple: int,
) -> tuple[dict[str, np.ndarray], int]:
    """The teacher arrays of the rows collected per micro-batch ((student row b, p, sequence,
    its sources) each), and the prefix slots."""
    rows_per_micro = row_bucket(max(len(r) for r in per_micro), cap, batch_multiple)
    entries = [e for r in per_micro for e in r]
    longest = max((len(seq) for _, _, seq, _ in entries), default=1)
    t_len = bucket_length(longest, teacher_max_len, multiple)
    prefix = bucket_length(max((p for _, p, _, _ in entries), default=0), student_len, multiple)
    num = rows_per_micro * micro_batches
    out = {
        "tokens": np.zeros((num, t_len), np.int32),
        "positions": np.tile(np.arange(t_len, dtype=np.int32), (num, 1)),
        "segments": np.zeros((num, t_len), np.int32),
        "src_row": np.zeros((num,), np.int32),
        "start": np.zeros((num,), np.int32),
        "src": np.full((num, t_len), -1, np.int32),  # host only: `hinted`'s sources
        "src_b": np.zeros((num,), np.int32),  # host only: the global student row
    }
    for m, row_list in enumerate(per_micro):
        for local, (b, p, seq, src) in enumerate(row_list):
            g = local * micro_batches + m
            out["tokens"][g, : len(seq)] = seq
            out["src"][g, : len(seq)], out["src_b"][g] = src, b
            out["positions"][g] = p + np.arange(t_len, dtype=np.int32)
            out["segments"][g, : len(seq)] = 1
            out["src_row"][g] = b // micro_batches
            out["start"][g] = p
    return out, prefix
