"""Batch builder on hand-made trajectories: masks, teacher sequences, index map, errors."""

import numpy as np
import pytest

from tg_jax.rl.batch import (
    bucket_length,
    build_batch,
    join_rows,
    split_batch,
    split_microbatches,
)
from tg_jax.rl.tg.compact import row_bucket
from tg_jax.sampling.trajectory import Role, Trajectory

P, TH, A, E = Role.PROMPT, Role.THINK, Role.ANSWER, Role.ENV
HEADER = [10, 11]
HINTS = {"explain": [95, 96], "fence": [90, 91, 92]}


def _traj(segments, verdicts, *, hints=HINTS, task="t0", group=0, rewards=None, version=3):
    """segments: (role, tokens, turn) in order; a PROMPT segment equal to HEADER opens a turn."""
    tokens, roles, turns, starts = [], [], [], []
    for role, toks, turn in segments:
        if role == P and list(toks) == HEADER:
            starts.append(len(tokens))
        tokens += list(toks)
        roles += [role] * len(toks)
        turns += [turn] * len(toks)
    n = len(tokens)
    return Trajectory(
        tokens=np.asarray(tokens, np.int32),
        roles=np.asarray(roles, np.int8),
        turn_ids=np.asarray(turns, np.int32),
        turn_starts=np.asarray(starts, np.int32),
        behaviour_logprobs=-np.arange(n, dtype=np.float32) / 10,
        turn_verdicts=verdicts,
        rewards=rewards or {"task": 1.0, "fence": 0.0},
        hint_tokens=hints,
        group_id=group,
        policy_version=version,
        task_id=task,
    )


def _two_turns(verdicts=None, **kw):
    # index:   0 1 2 | 3 4 | 5 6 | 7 8 9 | 10 11 12 | 13 14 | 15 16
    segments = [
        (P, [1, 2, 3], -1),
        (P, HEADER, -1),
        (TH, [20, 21], 0),
        (A, [30, 31, 32], 0),
        (E, [40, 41, 42], -1),
        (P, HEADER, -1),
        (A, [50, 51], 1),
    ]
    if verdicts is None:
        verdicts = [{"fence": False, "explain": True}, {"fence": True, "explain": False}]
    return _traj(segments, verdicts, **kw)


def _check_index_map(batch, mask):
    """teacher token at (row, pos + 1) == student target, wherever mask is set."""
    b_idx, t_idx = np.nonzero(mask)
    rows, pos = batch.teacher_row_BxT[b_idx, t_idx], batch.teacher_pos_BxT[b_idx, t_idx]
    np.testing.assert_array_equal(
        batch.teacher_tokens_BtxTt[rows, pos + 1], batch.targets_BxT[b_idx, t_idx]
    )
    assert batch.teacher_segment_ids_BtxTt[rows, pos + 1].all()


def test_masks_are_shifted_to_targets():
    traj = _two_turns()
    b = build_batch([traj], max_len=64, teacher_max_len=64, pad_to_multiple=8)
    assert b.tokens_BxT.shape == (1, 24)  # 17 tokens -> bucket of 8
    np.testing.assert_array_equal(b.tokens_BxT[0, :17], traj.tokens)
    np.testing.assert_array_equal(b.targets_BxT[0, :16], traj.tokens[1:])
    assert (b.targets_BxT[0, 16:] == 0).all() and (b.segment_ids_BxT[0, 17:] == 0).all()
    # Position t predicts token t + 1: think tokens 5,6 -> t = 4,5; answers 7-9 -> 6-8, 15-16.
    assert np.nonzero(b.thinking_mask_BxT[0])[0].tolist() == [4, 5]
    assert np.nonzero(b.answer_mask_BxT[0])[0].tolist() == [6, 7, 8, 14, 15]
    assert np.nonzero(b.loss_mask_BxT[0])[0].tolist() == [4, 5, 6, 7, 8, 14, 15]
    assert b.turn_ids_BxT[0, [4, 8, 14, 15]].tolist() == [0, 0, 1, 1]
    # Both turns failed one requirement each.
    assert np.nonzero(b.failed_turn_mask_BxT[0])[0].tolist() == [4, 5, 6, 7, 8, 14, 15]
    names = b.requirement_names
    assert names == ("explain", "fence")
    assert b.requirement_ids_BxT[0, [4, 8, 14]].tolist() == [1, 1, 0]
    assert (b.requirement_ids_BxT[0, [0, 3, 9, 13, 16]] == -1).all()
    np.testing.assert_allclose(b.behaviour_logprobs_BxT[0, :16], traj.behaviour_logprobs[1:])
    assert b.rewards["task"].tolist() == [1.0] and b.policy_version_B.tolist() == [3]


def test_a_rejected_turn_is_unmet_for_turn_credit_but_not_a_failed_turn():
    """Turn 1 met both requirements, but the environment refused it (malformed): for
    rl.requirement_credit "turn" it is unmet (no requirement credit), while the TG gate
    (failed turns) is the judge's alone."""
    traj = _two_turns([{"fence": False}, {"fence": True}])
    traj.info["rejected_turns"] = [1]
    b = build_batch([traj], max_len=64, teacher_max_len=64, pad_to_multiple=8)
    assert np.nonzero(b.failed_turn_mask_BxT[0])[0].tolist() == [4, 5, 6, 7, 8]
    assert np.nonzero(b.unmet_turn_mask_BxT[0])[0].tolist() == [4, 5, 6, 7, 8, 14, 15]
    accepted = build_batch([_two_turns([{"fence": False}, {"fence": True}])], max_len=64,
                           teacher_max_len=64, pad_to_multiple=8)  # fmt: skip
    assert np.array_equal(accepted.unmet_turn_mask_BxT, accepted.failed_turn_mask_BxT)


def test_per_trajectory_teacher_and_index_map():
    traj = _two_turns()
    b = build_batch([traj], max_len=64, teacher_max_len=64, pad_to_multiple=8)
    expected = [1, 2, 3, *HINTS["fence"], *HEADER, 20, 21, 30, 31, 32, 40, 41, 42]
    expected += [*HINTS["explain"], *HEADER, 50, 51]
    assert b.teacher_tokens_BtxTt.shape == (1, 24)
    np.testing.assert_array_equal(b.teacher_tokens_BtxTt[0, : len(expected)], expected)
    assert b.teacher_segment_ids_BtxTt[0].sum() == len(expected)
    # M: the answer tokens of the hinted turns (4, 5 are turn 0's thinking tokens).
    assert np.nonzero(b.tg_mask_BxT[0])[0].tolist() == [6, 7, 8, 14, 15]
    think = build_batch([traj], max_len=64, teacher_max_len=64, include_thinking=True)
    assert np.nonzero(think.tg_mask_BxT[0])[0].tolist() == [4, 5, 6, 7, 8, 14, 15]
    # The map holds for every real prediction position, not only distilled ones.
    _check_index_map(b, np.arange(24)[None] < 16)
    # The teacher's prediction at pos comes right after the student's context shift.
    assert b.teacher_pos_BxT[0, [0, 4, 14]].tolist() == [0, 4 + 3, 14 + 5]


def test_per_turn_rows_and_micro_batches():
    trajs = [_two_turns(task=f"t{i}") for i in range(3)]
    b = build_batch(
        trajs, max_len=64, teacher_max_len=64, mode="per_turn", max_teacher_rows=8,
        pad_to_multiple=8, micro_batches=2,
    )  # fmt: skip
    assert b.tokens_BxT.shape[0] == 4 and b.valid_B.tolist() == [True, True, True, False]
    assert b.teacher_tokens_BtxTt.shape[0] == 8
    # Micro-batch 0 holds rows 0, 2 (4 turns -> teacher rows 0, 2, 4, 6); micro-batch 1 row 1.
    turn0 = [1, 2, 3, *HINTS["fence"], *HEADER, 20, 21, 30, 31, 32]
    turn1 = [1, 2, 3, *HEADER, 20, 21, 30, 31, 32, 40, 41, 42, *HINTS["explain"], *HEADER, 50, 51]
    for global_row, seq in [(0, turn0), (2, turn1), (4, turn0), (1, turn0), (3, turn1)]:
        np.testing.assert_array_equal(b.teacher_tokens_BtxTt[global_row, : len(seq)], seq)
        assert b.teacher_segment_ids_BtxTt[global_row].sum() == len(seq)
    assert b.teacher_segment_ids_BtxTt[[5, 7]].sum() == 0  # unused rows are padding
    assert np.nonzero(b.tg_mask_BxT[2])[0].tolist() == [6, 7, 8, 14, 15]
    assert not b.tg_mask_BxT[3].any()
    for mb in split_batch(b, 2):
        _check_index_map(mb, mb.tg_mask_BxT)
    stacked = split_microbatches(b, 2)
    assert stacked.tokens_BxT.shape == (2, 2, 24)
    assert stacked.teacher_tokens_BtxTt.shape[:2] == (2, 4)
    np.testing.assert_array_equal(stacked.tokens_BxT[1, 0], b.tokens_BxT[1])
    micro = [mb.tokens_BxT for mb in split_batch(b, 2)]  # join_rows: split_batch's inverse
    np.testing.assert_array_equal(join_rows(micro), b.tokens_BxT)


def test_per_turn_overflow_is_dropped_and_per_trajectory_micro_rows():
    trajs = [_two_turns(task=f"t{i}") for i in range(2)]
    b = build_batch(
        trajs,
        max_len=64,
        teacher_max_len=64,
        mode="per_turn",
        max_teacher_rows=3,
        include_thinking=True,
    )
    assert b.tg_mask_BxT[0].sum() == 7 and b.tg_mask_BxT[1].sum() == 5  # turn 1 dropped
    _check_index_map(b, b.tg_mask_BxT)
    b = build_batch(trajs, max_len=64, teacher_max_len=64, micro_batches=2)
    for mb in split_batch(b, 2):
        _check_index_map(mb, mb.loss_mask_BxT)


def test_empty_or_missing_hint_and_no_failure_give_no_distillation():
    for traj in (
        _two_turns(hints={"fence": [], "explain": []}),
        _two_turns(hints={}),
        _two_turns(verdicts=[{"fence": True}, {"fence": True}]),
    ):
        b = build_batch([traj], max_len=64, teacher_max_len=64, pad_to_multiple=8)
        assert not b.tg_mask_BxT.any()
        np.testing.assert_array_equal(b.teacher_tokens_BtxTt, b.tokens_BxT)
        np.testing.assert_array_equal(b.teacher_pos_BxT[0, :16], np.arange(16))


def test_all_turns_gate_hints_passing_turns():
    traj = _two_turns(verdicts=[{"fence": False}, {"fence": True}])
    b = build_batch([traj], max_len=64, teacher_max_len=64, gate="all_turns", pad_to_multiple=8)
    assert np.nonzero(b.failed_turn_mask_BxT[0])[0].tolist() == [4, 5, 6, 7, 8]
    assert np.nonzero(b.tg_mask_BxT[0])[0].tolist() == [6, 7, 8, 14, 15]
    assert (b.teacher_tokens_BtxTt[0] == 90).sum() == 2  # the fence hint before both turns
    _check_index_map(b, b.loss_mask_BxT)


def test_too_long_errors_name_the_task():
    traj = _two_turns(task="task-42")
    with pytest.raises(ValueError, match=r"task task-42: trajectory has 17 tokens > max_len 16"):
        build_batch([traj], max_len=16, teacher_max_len=64)
    with pytest.raises(ValueError, match=r"task task-42: teacher sequence .* 22 tokens"):
        build_batch([traj], max_len=32, teacher_max_len=20)
    with pytest.raises(ValueError, match="turn 1 has 19 tokens"):
        build_batch([traj], max_len=32, teacher_max_len=18, mode="per_turn", max_teacher_rows=2)
    with pytest.raises(ValueError, match="multiple of micro_batches"):
        build_batch([traj], max_len=32, teacher_max_len=32, mode="per_turn", max_teacher_rows=3,
                    micro_batches=2)  # fmt: skip


def test_padding_rows_and_buckets():
    b = build_batch(
        [_two_turns(group=7)], max_len=64, teacher_max_len=64, mode="none", batch_multiple=4
    )
    assert b.tokens_BxT.shape == (4, 64) and b.teacher_tokens_BtxTt.shape == (4, 1)
    assert b.valid_B.tolist() == [True, False, False, False]
    assert not b.loss_mask_BxT[1:].any() and b.group_ids_B[0] == 7
    assert bucket_length(17, 100, 16) == 32 and bucket_length(90, 100, 64) == 100
    assert bucket_length(5, 100, 0) == 100


# ---------------------------------------------------------------------------------------------
# Compact teacher rows (build_batch(compact=True), tg_jax.rl.tg.compact).
# ---------------------------------------------------------------------------------------------


def _check_compact_map(batch, b, start, end):
    """Row b's map is valid on every prediction position whose target lies in [start, end)."""
    mask = np.zeros_like(batch.loss_mask_BxT)
    mask[b, start - 1 : end - 1] = True
    _check_index_map(batch, mask)


def test_compact_per_trajectory_starts_at_first_hint():
    traj = _two_turns()
    full = build_batch([traj], max_len=64, teacher_max_len=64, pad_to_multiple=8)
    b = build_batch([traj], max_len=64, teacher_max_len=64, pad_to_multiple=8, compact=True)
    assert b.teacher_compact and not full.teacher_compact
    n_full = int(full.teacher_segment_ids_BtxTt[0].sum())
    expected = full.teacher_tokens_BtxTt[0, 3:n_full]  # the hinted sequence from index 3 on
    assert b.teacher_tokens_BtxTt.shape == (1, 24)  # 19 tokens -> bucket of 8
    np.testing.assert_array_equal(b.teacher_tokens_BtxTt[0, : len(expected)], expected)
    assert b.teacher_segment_ids_BtxTt[0].sum() == len(expected) == 19
    np.testing.assert_array_equal(b.teacher_positions_BtxTt[0], 3 + np.arange(24))
    assert b.teacher_start_Bt.tolist() == [3] and b.teacher_src_row_Bt.tolist() == [0]
    assert b.teacher_prefix_len == 8  # p = 3 rounded up to the bucket of 8
    np.testing.assert_array_equal(b.tg_mask_BxT, full.tg_mask_BxT)
    _check_compact_map(b, 0, 3, 17)
    # The compact map is the full one shifted by the prefix.
    dist = b.tg_mask_BxT
    np.testing.assert_array_equal(b.teacher_pos_BxT[dist] + 3, full.teacher_pos_BxT[dist])
    assert (b.teacher_pos_BxT[0, :2] == 0).all()  # no teacher token: (0, 0), masked


def test_compact_cuts_after_last_targeted_turn_and_skips_untargeted_rows():
    fail0 = _two_turns(verdicts=[{"fence": False}, {"fence": True}], task="a")
    passing = _two_turns(verdicts=[{"fence": True}, {"fence": True}], task="b")
    b = build_batch([passing, fail0, passing], max_len=64, teacher_max_len=64,
                    pad_to_multiple=8, compact=True)  # fmt: skip
    # One teacher row (for student row 1): fence hint + turn 0 (student tokens 3..9).
    assert b.teacher_tokens_BtxTt.shape == (1, 16)
    seq = [*HINTS["fence"], *HEADER, 20, 21, 30, 31, 32]
    np.testing.assert_array_equal(b.teacher_tokens_BtxTt[0, : len(seq)], seq)
    assert b.teacher_segment_ids_BtxTt[0].sum() == len(seq)
    assert b.teacher_src_row_Bt.tolist() == [1] and b.teacher_start_Bt.tolist() == [3]
    assert np.nonzero(b.tg_mask_BxT[1])[0].tolist() == [6, 7, 8]
    assert not b.tg_mask_BxT[[0, 2]].any()
    _check_compact_map(b, 1, 3, 10)


def test_compact_without_targeted_turns_is_a_minimal_teacher():
    passing = _two_turns(verdicts=[{"fence": True}, {"fence": True}])
    for mode in ("per_trajectory", "per_turn"):
        b = build_batch([passing] * 3, max_len=64, teacher_max_len=64, mode=mode,
                        max_teacher_rows=8, pad_to_multiple=8, batch_multiple=2,
                        compact=True)  # fmt: skip
        assert b.tokens_BxT.shape[0] == 4
        assert b.teacher_tokens_BtxTt.shape == (2, 8) and b.teacher_prefix_len == 0
        assert not b.teacher_segment_ids_BtxTt.any() and not b.tg_mask_BxT.any()


def test_compact_micro_batches_and_per_turn():
    trajs = [_two_turns(task=f"t{i}") for i in range(3)]
    trajs.append(_two_turns(verdicts=[{"fence": True}, {"fence": True}], task="pass"))
    b = build_batch(trajs, max_len=64, teacher_max_len=64, pad_to_multiple=8, micro_batches=2,
                    compact=True)  # fmt: skip
    # Micro-batch 0: student rows 0, 2 (both failing); micro-batch 1: rows 1, 3 (3 passes).
    assert b.teacher_tokens_BtxTt.shape[0] == 4
    assert b.teacher_src_row_Bt.tolist() == [0, 0, 1, 0]  # local student rows
    assert b.teacher_segment_ids_BtxTt[3].sum() == 0  # micro-batch 1 has one row: padding
    for mb in split_batch(b, 2):
        _check_index_map(mb, mb.tg_mask_BxT)
    np.testing.assert_array_equal(b.tg_mask_BxT[:3], np.repeat(b.tg_mask_BxT[:1], 3, 0))

    t = build_batch(trajs, max_len=64, teacher_max_len=64, mode="per_turn", max_teacher_rows=8,
                    pad_to_multiple=8, micro_batches=2, compact=True)  # fmt: skip
    # One row per failed turn: hint + that turn, starting at the turn's start.
    turn0 = [*HINTS["fence"], *HEADER, 20, 21, 30, 31, 32]
    turn1 = [*HINTS["explain"], *HEADER, 50, 51]
    assert t.teacher_tokens_BtxTt.shape[0] == 8  # micro-batch 0 has 4 rows (cap 4)
    for g, seq, start in [(0, turn0, 3), (2, turn1, 13), (1, turn0, 3), (3, turn1, 13)]:
        np.testing.assert_array_equal(t.teacher_tokens_BtxTt[g, : len(seq)], seq)
        assert t.teacher_start_Bt[g] == start and t.teacher_segment_ids_BtxTt[g].sum() == len(seq)
    for mb in split_batch(t, 2):
        _check_index_map(mb, mb.tg_mask_BxT)
    full = build_batch(trajs, max_len=64, teacher_max_len=64, mode="per_turn",
                       max_teacher_rows=8, pad_to_multiple=8, micro_batches=2)  # fmt: skip
    np.testing.assert_array_equal(t.tg_mask_BxT, full.tg_mask_BxT)


def test_row_buckets():
    assert [row_bucket(n, 32, 1) for n in (0, 1, 4, 5, 8, 9, 17, 32)] == [1, 4, 4, 8, 8, 16, 32, 32]
    assert [row_bucket(n, 16, 4) for n in (0, 1, 4, 5, 9)] == [4, 4, 4, 8, 16]
    assert row_bucket(2, 3, 1) == 2
    with pytest.raises(ValueError, match="cap"):
        row_bucket(5, 4, 1)
