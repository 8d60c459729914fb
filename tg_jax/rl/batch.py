"""From rollouts to a padded, statically shaped training batch (host side, numpy).

One student row per trajectory (no packing), padded to T; teacher rows hold the same tokens
with hint messages inserted, padded to T_t.

Alignment. `tokens_BxT`, `positions_BxT` and `segment_ids_BxT` are the model's inputs. Every
other per-token array is aligned with `targets_BxT`: index t describes token t + 1, the token
that the logits at position t predict (targets[b, t] = tokens[b, t + 1]; the last position
predicts nothing). So `loss_mask_BxT[b, t]` says whether tokens[b, t + 1] was produced by the
policy, and `behaviour_logprobs_BxT[b, t]` is the sampler's log-prob of tokens[b, t + 1].

Teacher index map. For each student position t, (teacher_row_BxT[t], teacher_pos_BxT[t]) is
the teacher position whose logits predict the teacher's copy of tokens[t + 1]: if token
j = t + 1 sits at teacher index tj, then teacher_pos = tj - 1. Hence the teacher distribution
compared with the student's prediction at t is the teacher's prediction of the same token, and
    teacher_tokens[row, teacher_pos + 1] == targets[b, t]   wherever tg_mask_BxT is set.
Positions outside the distilled turns point at some valid index (only masked ones matter).
`teacher_row_BxT` is an index into the teacher rows of the row's *micro-batch* (see
`split_microbatches`): with M micro-batches, student row b belongs to micro-batch b % M at
local index b // M, and so does teacher row r.

Teacher modes:
  per_trajectory: teacher row b = trajectory b with the hints of the targeted requirements
    inserted right before turn_starts[k] of every targeted turn k (B_t = B). One teacher
    forward per trajectory; the teacher of turn k also sees the hints of earlier turns.
  per_turn: one teacher row per targeted turn k: tokens[:turn_starts[k]] + hint +
    tokens[turn_starts[k]:end of turn k] (what follows is dropped). Exact per-turn contexts;
    B_t = `max_teacher_rows`, static; targeted turns beyond it are not distilled (warning).
  none: no teacher (the GRPO arm): [B, 1] placeholder teacher arrays.
compact=True keeps either mode's teacher contexts but stores only what the teacher must
compute: rows for targeted trajectories (turns) only, each from its first hint to the end of
its last targeted turn; the layout and its index map are in `tg_jax.rl.tg.compact`.
A turn is *targeted* when it failed a requirement (gate="failed_turns"; its hint = the hint
messages of its failed requirements, in sorted order) or, with gate="all_turns", whenever it
has verdicts (hint = those of all its requirements; `tg_jax.rl.tg.mask`). A targeted turn whose
hint has no tokens (missing or empty `hint_tokens`) is not distilled, so an empty hint makes the
TG term exactly 0. The batch carries M, the tokens the TG term distils (`tg_mask_BxT`, built
here once by `tg_jax.rl.tg.mask.tg_mask`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any, Literal

import jax
import numpy as np

from tg_jax.rl.core import Batch
from tg_jax.rl.routing import batch_routes
from tg_jax.rl.tg.compact import (
    bucket_length,
    compact_teacher,
    compaction_pays,
    full_teacher_slots,
    hinted,
    located,
    turn_end,
)
from tg_jax.rl.tg.mask import failed_requirements, targeted_requirements, tg_mask
from tg_jax.sampling.trajectory import Role, Trajectory

__all__ = [
    "Batch",
    "bucket_length",
    "build_batch",
    "join_rows",
    "num_rows",
    "split_batch",
    "split_microbatches",
]

TeacherMode = Literal["per_trajectory", "per_turn", "none"]


def _hint(traj: Trajectory, names: Sequence[str], turn: int) -> np.ndarray:
    return traj.hint_ids(turn, names)  # the hints picked for that turn (Trajectory)


def _fill_row(
    dst: dict[str, np.ndarray],
    row: int,
    seq: np.ndarray,
    length: int,
    src: np.ndarray | None = None,
    b: int = 0,
) -> None:
    n = len(seq)  # a teacher row: its sources (`compact.hinted`) and student row b too
    dst["tokens"][row, :n] = seq
    dst["positions"][row] = np.arange(length, dtype=np.int32)
    dst["segments"][row, :n] = 1
    if src is not None:
        dst["src"][row, :n], dst["src_b"][row] = src, b


def _empty_seqs(rows: int, length: int) -> dict[str, np.ndarray]:
    """Token rows; host only, "src" / "src_b": a teacher token's student index (-1) and row."""
    return {
        "tokens": np.zeros((rows, length), np.int32),
        "positions": np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
        "segments": np.zeros((rows, length), np.int32),
        "src": np.full((rows, length), -1, np.int32),
        "src_b": np.zeros((rows,), np.int32),
    }


def _fill_student_targets(
    per_token: dict[str, np.ndarray], b: int, traj: Trajectory, gate: str, req_index: dict[str, int]
) -> dict[int, np.ndarray]:
    """Fills row b of the target-aligned arrays; returns the hint of each targeted turn with a
    non-empty hint."""
    tokens = np.asarray(traj.tokens, np.int32)
    roles, turn_ids = np.asarray(traj.roles)[1:], np.asarray(traj.turn_ids, np.int32)[1:]
    s = slice(0, len(tokens) - 1)  # prediction positions t whose target t + 1 exists
    per_token["targets"][b, s] = tokens[1:]
    answer, thinking = roles == Role.ANSWER, roles == Role.THINK
    produced = answer | thinking
    per_token["answer"][b, s], per_token["thinking"][b, s] = answer, thinking
    per_token["loss"][b, s] = produced
    per_token["turn"][b, s] = np.where(produced, turn_ids, -1)
    per_token["behaviour"][b, s] = np.asarray(traj.behaviour_logprobs, np.float32)[1:]

    hints = {}
    rejected = set(traj.info.get("rejected_turns", ()))  # the environment refused the turn
    for k in range(traj.num_turns):
        in_turn, failed = (turn_ids == k) & produced, bool(failed_requirements(traj, k))
        per_token["failed"][b, s] |= in_turn & failed
        per_token["unmet"][b, s] |= in_turn & (failed or k in rejected)  # requirement_credit
        targeted = targeted_requirements(traj, k, gate)
        if not targeted:
            continue
        unknown = [r for r in targeted if r not in req_index]
        if unknown:
            raise ValueError(f"task {traj.task_id}: unknown requirement(s) {unknown}")
        per_token["req"][b, s][in_turn] = req_index[targeted[0]]
        hint = _hint(traj, targeted, k)
        if hint.size:
            hints[k] = hint
    return hints


def _turn_mask(traj: Trajectory, k: int) -> np.ndarray:
    """[n - 1] bool over prediction positions: the target is a produced token of turn k."""
    roles, turn_ids = np.asarray(traj.roles)[1:], np.asarray(traj.turn_ids)[1:]
    return (turn_ids == k) & ((roles == Role.ANSWER) | (roles == Role.THINK))


def _fill_per_trajectory_teacher(
    per_token: dict[str, np.ndarray],
    b: int,
    local_row: int,
    traj: Trajectory,
    hints: dict[int, np.ndarray],
    teacher_max_len: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The hinted sequence of row b (hints before every targeted turn), its sources
    (`compact.hinted`) and its index map."""
    num = len(traj.tokens)
    s = slice(0, num - 1)
    for k in hints:
        per_token["hinted"][b, s] |= _turn_mask(traj, k)
    seq, src = hinted(traj, hints, hints, 0, num)
    if len(seq) > teacher_max_len:
        raise ValueError(
            f"task {traj.task_id}: teacher sequence with hints has {len(seq)} tokens > "
            f"teacher_max_len {teacher_max_len} (student {num})"
        )
    per_token["t_row"][b] = local_row
    # Student token j sits at teacher index located[j]; the position predicting it is one less.
    per_token["t_pos"][b, s] = located(src, num)[1:] - 1
    return seq, src


def _fill_per_turn_teacher(
    per_token: dict[str, np.ndarray],
    b: int,
    local_row: int,
    traj: Trajectory,
    k: int,
    hint: np.ndarray,
    teacher_max_len: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Turn k's exact hinted context (prefix + hint + turn k), its sources (`compact.hinted`)
    and its index map in row b."""
    num = len(traj.tokens)
    s = slice(0, num - 1)
    seq, src = hinted(traj, {k: hint}, [k], 0, turn_end(traj, k))
    if len(seq) > teacher_max_len:
        raise ValueError(
            f"task {traj.task_id}: teacher sequence of turn {k} has {len(seq)} tokens > "
            f"teacher_max_len {teacher_max_len}"
        )
    sel = _turn_mask(traj, k)
    per_token["hinted"][b, s] |= sel
    per_token["t_row"][b, s][sel] = local_row
    per_token["t_pos"][b, s][sel] = (located(src, num)[1:] - 1)[sel]
    return seq, src


def _check_trajectories(trajectories: Sequence[Trajectory], max_len: int) -> list[str]:
    """The batch's reward names; raises on no trajectory, a too-long one or differing reward
    names."""
    if not trajectories:
        raise ValueError("build_batch needs at least one trajectory")
    reward_names = sorted(trajectories[0].rewards)
    for traj in trajectories:
        if len(traj.tokens) > max_len:
            raise ValueError(
                f"task {traj.task_id}: trajectory has {len(traj.tokens)} tokens > max_len {max_len}"
            )
        if sorted(traj.rewards) != reward_names:
            raise ValueError(
                f"task {traj.task_id}: reward names {sorted(traj.rewards)} differ from "
                f"{reward_names}"
            )
    return reward_names


@dataclasses.dataclass
class _Layout:
    """A batch's static shape: B rows of T student tokens, and how its teacher rows are laid out
    (the keyword arguments of `compact.compact_teacher`, and per_turn's rows per micro-batch)."""

    mode: TeacherMode
    rows: int  # B
    student_len: int  # T
    micro_batches: int
    batch_multiple: int
    max_teacher_rows: int  # B_t in per_turn mode
    teacher_max_len: int
    pad_multiple: int  # T_t is rounded up to a multiple of this
    per_micro: int = dataclasses.field(init=False)  # per_turn: teacher rows per micro-batch

    def __post_init__(self):
        self.per_micro = 0
        if self.mode == "per_turn":  # raises unless B_t splits evenly
            self.per_micro, rem = divmod(self.max_teacher_rows, self.micro_batches)
            if self.max_teacher_rows <= 0 or rem or self.per_micro % self.batch_multiple:
                raise ValueError(
                    f"max_teacher_rows={self.max_teacher_rows} must be a positive multiple of "
                    f"micro_batches * batch_multiple = {self.batch_multiple * self.micro_batches}"
                )


def _empty_per_token(rows: int, length: int) -> dict[str, np.ndarray]:
    """The target-aligned [rows, length] arrays, at their 'nothing here' values."""
    return {
        "targets": np.zeros((rows, length), np.int32),
        "loss": np.zeros((rows, length), bool),
        "answer": np.zeros((rows, length), bool),
        "thinking": np.zeros((rows, length), bool),
        "failed": np.zeros((rows, length), bool),
        "unmet": np.zeros((rows, length), bool),
        "hinted": np.zeros((rows, length), bool),
        "req": np.full((rows, length), -1, np.int32),
        "turn": np.full((rows, length), -1, np.int32),
        "behaviour": np.zeros((rows, length), np.float32),
        "t_row": np.zeros((rows, length), np.int32),
        "t_pos": np.zeros((rows, length), np.int32),
    }


def _per_trajectory_teacher(
    per_token: dict[str, np.ndarray],
    trajectories: Sequence[Trajectory],
    hints: Sequence[dict[int, np.ndarray]],
    layout: _Layout,
) -> dict[str, np.ndarray]:
    """per_trajectory mode: one hinted sequence per trajectory (teacher row b = student row b)."""
    micro_batches, teacher_max_len = layout.micro_batches, layout.teacher_max_len
    seqs = [
        _fill_per_trajectory_teacher(per_token, b, b // micro_batches, traj, h, teacher_max_len)
        for b, (traj, h) in enumerate(zip(trajectories, hints, strict=True))
    ]
    t_len = bucket_length(max(len(q) for q, _ in seqs), teacher_max_len, layout.pad_multiple)
    teacher = _empty_seqs(layout.rows, t_len)
    for b, (seq, src) in enumerate(seqs):
        _fill_row(teacher, b, seq, t_len, src, b)
    # Padding rows point at their own (empty) teacher row.
    for b in range(len(trajectories), layout.rows):
        per_token["t_row"][b] = b // micro_batches
    return teacher


def _per_turn_teacher(
    per_token: dict[str, np.ndarray],
    trajectories: Sequence[Trajectory],
    hints: Sequence[dict[int, np.ndarray]],
    layout: _Layout,
) -> dict[str, np.ndarray]:
    """per_turn mode: one exact hinted context per targeted turn, up to `layout.per_micro`
    teacher rows per micro-batch (the turns beyond are not distilled, with a warning)."""
    micro_batches, teacher_max_len = layout.micro_batches, layout.teacher_max_len
    seqs, global_rows = [], []  # each appended sequence and its global teacher row
    used = [0] * micro_batches
    dropped = 0
    for b, (traj, turn_hints) in enumerate(zip(trajectories, hints, strict=True)):
        m = b % micro_batches
        for k in sorted(turn_hints):
            if used[m] == layout.per_micro:
                dropped += 1
                continue
            seqs.append(
                _fill_per_turn_teacher(
                    per_token, b, used[m], traj, k, turn_hints[k], teacher_max_len
                )
            )
            global_rows.append((used[m] * micro_batches + m, b))
            used[m] += 1
    if dropped:
        logging.warning(
            "build_batch: %d targeted turns exceed max_teacher_rows=%d and are not distilled",
            dropped,
            layout.max_teacher_rows,
        )
    longest = max((len(q) for q, _ in seqs), default=1)
    t_len = bucket_length(longest, teacher_max_len, layout.pad_multiple)
    teacher = _empty_seqs(layout.max_teacher_rows, t_len)
    for (row, b), (seq, src) in zip(global_rows, seqs, strict=True):
        _fill_row(teacher, row, seq, t_len, src, b)
    return teacher


def _compact_rows(
    per_token: dict[str, np.ndarray],
    trajectories: Sequence[Trajectory],
    hints: Sequence[dict[int, np.ndarray]],
    layout: _Layout,
    min_saving: float,
) -> tuple[dict[str, np.ndarray] | None, int]:
    """`compact_teacher`'s (teacher arrays, prefix slots) when compaction saves at least
    `min_saving` of the full rows' token slots; (None, 0), per_token as it was, otherwise."""
    saved = {k: per_token[k].copy() for k in ("hinted", "t_row", "t_pos")}
    kwargs = {k: v for k, v in dataclasses.asdict(layout).items() if k != "per_micro"}
    teacher, prefix_len = compact_teacher(per_token, trajectories, hints, _turn_mask, **kwargs)
    full_slots = full_teacher_slots(
        trajectories,
        hints,
        mode=layout.mode,
        rows=layout.rows,
        max_teacher_rows=layout.max_teacher_rows,
        teacher_max_len=layout.teacher_max_len,
        pad_multiple=layout.pad_multiple,
    )
    if compaction_pays(teacher["tokens"].size, full_slots, min_saving):
        return teacher, prefix_len
    per_token.update(saved)
    return None, 0


def _row_fields(
    trajectories: Sequence[Trajectory], rows: int, reward_names: Sequence[str], heads=None
) -> dict[str, Any]:
    """The per-row [rows] fields: rewards, group ids, policy versions, validity, heads."""
    n = len(trajectories)
    rewards = {name: np.zeros((rows,), np.float32) for name in reward_names}
    for b, traj in enumerate(trajectories):
        for name in reward_names:
            rewards[name][b] = traj.rewards[name]
    group_ids = np.zeros((rows,), np.int32)
    group_ids[:n] = [t.group_id for t in trajectories]
    versions = np.full((rows,), -1, np.int32)
    versions[:n] = [t.policy_version for t in trajectories]
    return {
        "rewards": rewards,
        "group_ids_B": group_ids,
        "policy_version_B": versions,
        "valid_B": np.arange(rows) < n,
        "head_B": None if heads is None else np.pad(np.asarray(heads, bool), (0, rows - n)),
    }


def build_batch(
    trajectories: Sequence[Trajectory],
    *,
    max_len: int,
    teacher_max_len: int,
    mode: TeacherMode = "per_trajectory",
    gate: str = "failed_turns",
    include_thinking: bool = False,
    max_teacher_rows: int = 0,
    requirement_names: Sequence[str] | None = None,
    pad_to_multiple: int = 64,
    teacher_pad_to_multiple: int | None = None,
    batch_multiple: int = 1,
    micro_batches: int = 1,
    compact: bool = False,
    min_compact_saving: float = 0.0,
    heads: Sequence[bool] | None = None,
    min_rows: int = 0,
) -> Batch:
    """Pads trajectories into a `Batch` (see the module docstring for conventions).

    Args:
      trajectories: the rollouts, one row each, in order.
      max_len: longest student sequence allowed (T <= max_len).
      teacher_max_len: longest teacher sequence allowed (T_t <= teacher_max_len).
      mode: "per_trajectory", "per_turn" or "none".
      gate: "failed_turns" (hint and distil failed turns) or "all_turns" (every turn with
        verdicts).
      include_thinking: M holds the targeted turns' thinking tokens too (tg.include_thinking).
      max_teacher_rows: B_t in per_turn mode (all micro-batches together); a multiple of
        micro_batches * batch_multiple.
      requirement_names: the run's requirement names (ids index this list); default: the
        sorted names seen in the batch (for tests and notebooks: ids then vary by batch).
      pad_to_multiple: T and T_t are rounded up to a multiple of this (capped at the maximum),
        so that shapes rarely change; 0 = always pad to the maximum.
      teacher_pad_to_multiple: the same for T_t (default: pad_to_multiple); a finer one keeps
        the teacher forward close to the student's length when hints are short.
      batch_multiple: rows per micro-batch are a multiple of this (the mesh's batch divisor);
        padding rows are added (valid_B False, every mask 0).
      micro_batches: number of micro-batches the train step will split the batch into.
      compact: teacher rows only where a turn is targeted, from the first hint to the end of
        the last targeted turn (`tg_jax.rl.tg.compact`; the train step reuses the student's keys
        and values for the shared prefix). B_t is bucketed (per_turn: <= max_teacher_rows).
      min_compact_saving: with compact, full rows instead when the compact rows' B_t x T_t
        slots are more than (1 - min_compact_saving) of the full rows'
        (`compact.compaction_pays`); 0 (the train loop's) keeps compact rows.
      heads: per trajectory, `Batch.head_B` (`tg_jax.rl.hidden_thinking.segments`).
      min_rows: B is at least this (rounded up as the trajectories' count is).

    Returns:
      A `Batch` of numpy arrays.
    Raises:
      ValueError: a student sequence longer than max_len or a teacher sequence longer than
        teacher_max_len (names the task), inconsistent reward names, bad sizes.
    """
    if mode not in ("per_trajectory", "per_turn", "none"):
        raise ValueError(f"unknown teacher mode {mode!r}")
    reward_names = _check_trajectories(trajectories, max_len)  # at least one
    if requirement_names is None:
        requirement_names = sorted({r for t in trajectories for v in t.turn_verdicts for r in v})
    length = bucket_length(max(len(t.tokens) for t in trajectories), max_len, pad_to_multiple)
    t_multiple = pad_to_multiple if teacher_pad_to_multiple is None else teacher_pad_to_multiple
    layout = _Layout(
        mode=mode,
        rows=num_rows(max(len(trajectories), min_rows), batch_multiple, micro_batches),
        student_len=length,
        micro_batches=micro_batches,
        batch_multiple=batch_multiple,
        max_teacher_rows=max_teacher_rows,
        teacher_max_len=teacher_max_len,
        pad_multiple=t_multiple,
    )
    student, per_token, hints = _fill_students(trajectories, layout, gate, requirement_names)
    teacher = _teacher_rows(per_token, trajectories, hints, layout, compact, min_compact_saving)
    per_token["tg"] = _tg_mask(per_token, gate, include_thinking)
    per_row = _row_fields(trajectories, layout.rows, reward_names, heads)
    return _assemble(trajectories, layout, student, per_token, teacher, per_row, requirement_names)


def _fill_students(
    trajectories: Sequence[Trajectory], layout: _Layout, gate: str, requirement_names: Sequence[str]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], list[dict[int, np.ndarray]]]:
    """(the student token rows, the target-aligned arrays, per row: targeted turn -> its
    non-empty hint), every trajectory filled in."""
    req_index = {name: i for i, name in enumerate(requirement_names)}
    student = _empty_seqs(layout.rows, layout.student_len)
    per_token = _empty_per_token(layout.rows, layout.student_len)
    hints = []
    for b, traj in enumerate(trajectories):
        _fill_row(student, b, np.asarray(traj.tokens, np.int32), layout.student_len)
        hints.append(_fill_student_targets(per_token, b, traj, gate, req_index))
    return student, per_token, hints


@dataclasses.dataclass
class _TeacherRows:
    """A batch's teacher arrays; compact: compacted, continuing `prefix_len` prefix slots."""

    arrays: dict[str, np.ndarray]
    compact: bool = False
    prefix_len: int = 0


def _teacher_rows(
    per_token: dict[str, np.ndarray],
    trajectories: Sequence[Trajectory],
    hints: Sequence[dict[int, np.ndarray]],
    layout: _Layout,
    compact: bool,
    min_saving: float,
) -> _TeacherRows:
    """Compact teacher rows where asked and paying (`_compact_rows`), else the mode's full rows
    (per_trajectory / per_turn / none); fills the teacher index map of per_token."""
    if compact and layout.mode != "none":
        teacher, prefix_len = _compact_rows(per_token, trajectories, hints, layout, min_saving)
        if teacher is not None:
            return _TeacherRows(teacher, True, prefix_len)
    if layout.mode == "per_trajectory":
        return _TeacherRows(_per_trajectory_teacher(per_token, trajectories, hints, layout))
    if layout.mode == "per_turn":
        return _TeacherRows(_per_turn_teacher(per_token, trajectories, hints, layout))
    return _TeacherRows(_empty_seqs(layout.rows, 1))


def _tg_mask(per_token: dict[str, np.ndarray], gate: str, include_thinking: bool) -> np.ndarray:
    """M of the filled target-aligned arrays (`tg_jax.rl.tg.mask.tg_mask`)."""
    hinted, thinking = per_token["hinted"], per_token["thinking"]
    failed, produced = per_token["failed"], per_token["loss"]
    return tg_mask(hinted, thinking, failed, produced, include_thinking=include_thinking, gate=gate)


def _assemble(
    trajectories: Sequence[Trajectory],
    layout: _Layout,
    student: dict[str, np.ndarray],
    per_token: dict[str, np.ndarray],
    teacher_rows: _TeacherRows,
    per_row: dict[str, Any],
    requirement_names: Sequence[str],
) -> Batch:
    """The `Batch` of the filled arrays (`per_row`: `_row_fields`)."""
    teacher, mode = teacher_rows.arrays, layout.mode
    routes, teacher_routes = batch_routes(
        trajectories, layout.rows, student["tokens"].shape[1], None if mode == "none" else teacher
    )
    return Batch(
        tokens_BxT=student["tokens"],
        positions_BxT=student["positions"],
        segment_ids_BxT=student["segments"],
        targets_BxT=per_token["targets"],
        loss_mask_BxT=per_token["loss"],
        answer_mask_BxT=per_token["answer"],
        thinking_mask_BxT=per_token["thinking"],
        failed_turn_mask_BxT=per_token["failed"],
        unmet_turn_mask_BxT=per_token["unmet"],
        tg_mask_BxT=per_token["tg"],
        requirement_ids_BxT=per_token["req"],
        turn_ids_BxT=per_token["turn"],
        behaviour_logprobs_BxT=per_token["behaviour"],
        teacher_row_BxT=per_token["t_row"],
        teacher_pos_BxT=per_token["t_pos"],
        teacher_tokens_BtxTt=teacher["tokens"],
        teacher_positions_BtxTt=teacher["positions"],
        teacher_segment_ids_BtxTt=teacher["segments"],
        **per_row,
        teacher_src_row_Bt=teacher.get("src_row"),
        teacher_start_Bt=teacher.get("start"),
        routes_BxTxLxJ=routes,
        teacher_routes_BtxTtxLxJ=teacher_routes,
        requirement_names=tuple(requirement_names),
        teacher_mode=mode,
        teacher_compact=teacher_rows.compact,
        teacher_prefix_len=teacher_rows.prefix_len,
    )


def split_microbatches(batch: Batch, num: int) -> Batch:
    """Stacks a batch into `num` micro-batches: every array gets a leading [num] axis.

    Row b goes to micro-batch b % num at local index b // num (strided, not contiguous): a
    batch axis sharded over devices in contiguous blocks keeps every micro-batch spread over
    all devices. Works on numpy and jax arrays (inside jit too).

    Args:
      batch: a `Batch` whose B and B_t are multiples of num.
      num: number of micro-batches.

    Returns:
      A `Batch` whose arrays are [num, B / num, ...] (teacher arrays [num, B_t / num, ...]).
    """

    def split(x):
        if x.shape[0] % num:
            raise ValueError(f"leading size {x.shape[0]} is not a multiple of {num}")
        return x.reshape(x.shape[0] // num, num, *x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, batch)


def split_batch(batch: Batch, num: int) -> list[Batch]:
    """Host-side list of the `num` micro-batches of `split_microbatches`."""
    stacked = split_microbatches(batch, num)
    return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(num)]


def join_rows(micro: Sequence[np.ndarray]) -> np.ndarray:
    """The inverse of `split_batch` for one per-row array: the `num` micro-batches' [B / num,
    ...] arrays back to [B, ...], row b from micro-batch b % num at local index b // num."""
    return np.stack(micro, axis=1).reshape(-1, *micro[0].shape[1:])


def num_rows(num_trajectories: int, batch_multiple: int, micro_batches: int) -> int:
    """B that `build_batch` pads `num_trajectories` rows to."""
    step = batch_multiple * micro_batches
    return math.ceil(num_trajectories / step) * step
