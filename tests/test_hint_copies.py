"""Student tokens that copy the hint: the mask on hand-made token sequences and a batch."""

import numpy as np
import pytest

from tg_jax.rl.tg import hint_copies


def test_copy_mask_marks_every_token_of_a_copied_window():
    hint = np.array([1, 2, 3, 4, 5, 6])
    turn = np.array([9, 2, 3, 4, 5, 8, 3, 4, 5, 6, 7])
    # n = 4: windows [2 3 4 5] (positions 1-4) and [3 4 5 6] (6-9) occur in the hint.
    want = [0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 0]
    np.testing.assert_array_equal(hint_copies.copy_mask(turn, hint, 4), np.array(want, bool))
    # n = 5: only [2 3 4 5 6] would match, and the turn never has it in a row.
    assert not hint_copies.copy_mask(turn, hint, 5).any()
    # Shorter than n, or nothing in common: nothing masked.
    assert not hint_copies.copy_mask(turn[:3], hint, 4).any()
    assert not hint_copies.copy_mask(turn, np.array([7, 7, 7, 7]), 4).any()
    # The whole hint copied once inside a longer turn, with the default n = 12.
    long_hint = np.arange(100, 116)
    turn = np.concatenate([[1, 2], long_hint[2:15], [3]])
    got = hint_copies.copy_mask(turn, long_hint)
    np.testing.assert_array_equal(got, np.array([0, 0] + [1] * 13 + [0], bool))
    with pytest.raises(ValueError, match="n must be"):
        hint_copies.copy_mask(turn, long_hint, 0)


def test_batch_mask_is_per_row_and_turn_and_inside_the_distill_mask():
    # Row 0: turn 0 (positions 1-5) copies its hint [5 6 7]; turn 1 (positions 7-9) copies
    # [5 6 7] too, but its hint is another one, so it stays distilled.
    targets = np.array(
        [
            [0, 5, 6, 7, 1, 2, 0, 5, 6, 7, 0],
            [0, 5, 6, 7, 5, 6, 7, 0, 0, 0, 0],
        ]
    )
    turns = np.array(
        [
            [-1, 0, 0, 0, 0, 0, -1, 1, 1, 1, -1],
            [-1, 0, 0, 0, 0, 0, 0, -1, -1, -1, -1],
        ]
    )
    distill = turns >= 0
    distill[1, 4:7] = False  # not distilled (e.g. thinking): never reported, never a window
    hints = [{0: np.array([9, 5, 6, 7]), 1: np.array([1, 2, 3])}, {0: np.array([5, 6, 7])}]
    got = hint_copies.hint_copy_mask_BxT(targets, turns, distill, hints, n=3)
    want = np.zeros_like(distill)
    want[0, 1:4] = True
    want[1, 1:4] = True
    np.testing.assert_array_equal(got, want)
    assert not (got & ~distill).any()
    # A row without targeted turns, and n larger than any turn: nothing.
    assert not hint_copies.hint_copy_mask_BxT(targets, turns, distill, [{}, {}], n=3).any()
    assert not hint_copies.hint_copy_mask_BxT(targets, turns, distill, hints, n=6).any()


def _traj(answer0, answer1, verdicts, hints):
    from tg_jax.sampling.trajectory import Role, Trajectory

    P, A, E = Role.PROMPT, Role.ANSWER, Role.ENV
    segments = [(P, [1, 2], -1), (P, [10, 11], -1), (A, answer0, 0), (E, [40, 41], -1),
                (P, [10, 11], -1), (A, answer1, 1)]  # fmt: skip
    tokens, roles, turns = [], [], []
    for role, toks, turn in segments:
        tokens += toks
        roles += [role] * len(toks)
        turns += [turn] * len(toks)
    n = len(tokens)
    return Trajectory(
        tokens=np.asarray(tokens, np.int32), roles=np.asarray(roles, np.int8),
        turn_ids=np.asarray(turns, np.int32),
        turn_starts=np.asarray([2, 6 + len(answer0)], np.int32),
        behaviour_logprobs=np.zeros(n, np.float32), turn_verdicts=verdicts,
        rewards={"task": 0.0}, hint_tokens=hints, group_id=0, policy_version=0, task_id="t",
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["per_trajectory", "per_turn"])
def test_mask_hint_copies_on_a_built_batch(mode):
    from tg_jax.rl.batch import build_batch

    hint = [90, 91, 92, 93, 94]
    # Turn 0 fails and copies 4 hint tokens (then 2 of its own); turn 1 fails and does not.
    copy = _traj([91, 92, 93, 94, 60, 61], [70, 71, 72], [{"fence": False}] * 2, {"fence": hint})
    # The same copy in a passing turn is not distilled at all: nothing to remove there.
    passing = _traj([91, 92, 93, 94, 60], [70, 71], [{"fence": True}, {"fence": False}],
                    {"fence": hint})  # fmt: skip
    trajs = [copy, passing]
    batch = build_batch(trajs, max_len=32, teacher_max_len=64, mode=mode, max_teacher_rows=4,
                        pad_to_multiple=0, batch_multiple=1)  # fmt: skip
    before = np.asarray(batch.tg_mask_BxT).copy()
    masked, removed = hint_copies.mask_hint_copies(batch, trajs, "failed_turns", n=3)
    after = np.asarray(masked.tg_mask_BxT)
    # Row 0's turn-0 targets 91 92 93 94 (student positions 3-6 predict tokens 4-7).
    want = before.copy()
    want[0, 3:7] = False
    np.testing.assert_array_equal(after, want)
    assert removed == 4 and before[0, 3:7].all() and before[0, 7:9].all()
    # Every other field is untouched; with a window longer than the copy nothing changes.
    np.testing.assert_array_equal(masked.targets_BxT, batch.targets_BxT)
    same, none = hint_copies.mask_hint_copies(batch, trajs, "failed_turns", n=5)
    assert none == 0 and (np.asarray(same.tg_mask_BxT) == before).all()
    # all_turns: the passing row's turn 0 is targeted too, and its copy is removed as well.
    batch = build_batch(trajs, max_len=32, teacher_max_len=64, mode=mode, max_teacher_rows=4,
                        pad_to_multiple=0, gate="all_turns")  # fmt: skip
    _, removed = hint_copies.mask_hint_copies(batch, trajs, "all_turns", n=3)
    assert removed == 8


def test_the_rl_loop_applies_the_option():
    from tests import rl_loop_driver as driver
    from tg_jax import config_files
    from tg_jax.train import rl

    hint = [90, 91, 92, 93, 94]
    trajs = [_traj([91, 92, 93, 94, 60, 61], [70, 71, 72], [{"fence": False}] * 2,
                   {"fence": hint})]  # fmt: skip
    counts = {}
    for on in (False, True):
        config = config_files.apply_overrides(
            driver.make_config("tg"), {"tg.mask_hint_copies": on, "rl_loop.length_multiple": 0}
        )
        parts = driver.batch_parts(config, 32, 64)
        batch = rl._build_batch(parts, trajs, 0)
        counts[on] = int(np.asarray(batch.tg_mask_BxT).sum())
    # The default n = 12 finds no 12-token copy here; the option changes nothing then.
    assert counts[True] == counts[False] > 0
    long_hint = list(range(100, 130))
    trajs = [_traj(long_hint[3:20], [70, 71], [{"fence": False}] * 2, {"fence": long_hint})]
    for on in (False, True):
        config = config_files.apply_overrides(
            driver.make_config("tg"), {"tg.mask_hint_copies": on, "rl_loop.length_multiple": 0}
        )
        parts = driver.batch_parts(config, 64, 128)
        counts[on] = int(np.asarray(rl._build_batch(parts, trajs, 0).tg_mask_BxT).sum())
    assert counts[False] - counts[True] == 17  # the 17-token copy, all of it
