"""Distil a targeted turn only up to the token that breaks the requirement (`tg.span`).

The teacher reads the student's own turn after the hint. Up to the first token that breaks
the requirement (`Requirement.breaks_at`: e.g. the first code character written without the
opening ```python fence), that prefix is one a compliant turn could have, and the hinted
teacher's distribution there is the behaviour the hint asks for. After it, the teacher reads
a prefix that contradicts its own hint, a context its hinted training data never showed: its
predictions there are not the behaviour (right after unfenced code, a hinted model expects
a closing fence or more code, not the tool call the student writes), yet the forward KL
pulls the student towards them with the same weight.

With `tg.span = "to_break"` the batch builder keeps, of each targeted turn, the targets up
to and including its break token (`cut_after_breaks`, applied to a built batch): the
earliest break among the turn's targeted requirements. A turn with a targeted requirement
that cannot locate its break (no locator, or gate "all_turns" on a turn that met it) stays
whole, as with `tg.span = "turn"`. The teacher rows are unchanged (the cut is a mask).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tg_jax.rl.tg.mask import targeted_requirements
from tg_jax.sampling.trajectory import Trajectory


def turn_cuts(traj: Trajectory, gate: str) -> dict[int, int]:
    """{targeted turn k: index in traj.tokens of its last distilled target} for the turns
    whose every targeted requirement located its break (the earliest of those breaks)."""
    if traj.turn_breaks is None:
        return {}
    out = {}
    for k, breaks in enumerate(traj.turn_breaks):
        names = targeted_requirements(traj, k, gate)
        if names and all(n in breaks for n in names):
            out[k] = min(int(breaks[n]) for n in names)
    return out


def cut_after_breaks(batch: Any, trajectories: Sequence[Trajectory], gate: str) -> tuple[Any, int]:
    """`batch` (a tg_jax.rl.batch.Batch of host arrays, row b = trajectories[b]) with the
    targets after each targeted turn's break left out of M (`tg_mask_BxT`), and how many."""
    mask = np.asarray(batch.tg_mask_BxT, bool)
    turn_ids = np.asarray(batch.turn_ids_BxT)
    target_index = np.arange(mask.shape[1]) + 1  # position t predicts tokens[t + 1]
    cut = np.zeros_like(mask)
    for b, traj in enumerate(trajectories):
        for k, last in turn_cuts(traj, gate).items():
            cut[b] |= (turn_ids[b] == k) & (target_index > last)
    cut &= mask
    return batch.replace(tg_mask_BxT=mask & ~cut), int(cut.sum())
