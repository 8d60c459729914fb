"""Student tokens that copy the hint: the mask on hand-made token sequences and a batch."""

import numpy as np
import pytest

from tg_jax.rl import hint_copies


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
