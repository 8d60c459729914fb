"""Student tokens that copy the teacher's hint, to be left out of the TG KL (`tg.mask_hint_copies`).

The hinted teacher, having just read "Reminder: put code in a ```python block.", may put
mass on continuing that text; distilling those tokens teaches the student to reproduce a
message it never sees (privilege drift, see tg_jax.envs.leakage). With
`tg.mask_hint_copies` the batch builder drops from the distillation mask every target token
of a targeted turn that lies in a copied span (`mask_hint_copies`, applied to a built batch):

  a span = `NGRAM_TOKENS` (12) consecutive target tokens of the turn that also occur,
  contiguously and in the same order, in that turn's hint tokens (the rendered hint
  message the teacher sees before the turn); every token of the span is masked, the
  first ones too (the KL on them already pushes towards starting the copy).

Token ids, not words: the batch holds ids, and the copy the teacher would induce is a copy
of ids. 12 tokens are 2-3 words with the byte tokenizer and a clause with a BPE tokenizer:
a compliant answer shares its few format tokens with the hint (```python) but not 12 in a
row, so the mask leaves the behaviour's own tokens distilled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tg_jax.sampling.trajectory import Trajectory

NGRAM_TOKENS = 12


def copy_mask(
    turn_tokens: np.ndarray, hint_tokens: np.ndarray, n: int = NGRAM_TOKENS
) -> np.ndarray:
    """[len(turn_tokens)] bool: the token lies in a window of n tokens found in the hint.

    Args:
      turn_tokens: [L] int token ids (in order, e.g. a turn's targets).
      hint_tokens: [H] int ids of the hint.
      n: window length (>= 1).
    """
    turn = np.asarray(turn_tokens, np.int64)
    hint = np.asarray(hint_tokens, np.int64)
    out = np.zeros(turn.shape, bool)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if len(turn) < n or len(hint) < n:
        return out
    hint_grams = {tuple(hint[i : i + n]) for i in range(len(hint) - n + 1)}
    for i in range(len(turn) - n + 1):
        if tuple(turn[i : i + n]) in hint_grams:
            out[i : i + n] = True
    return out


def hint_copy_mask_BxT(
    targets_BxT: np.ndarray,
    turn_ids_BxT: np.ndarray,
    window_mask_BxT: np.ndarray,
    hints: Sequence[Mapping[int, np.ndarray]],
    n: int = NGRAM_TOKENS,
) -> np.ndarray:
    """[B, T] bool: distilled targets that copy their turn's hint (to remove from the mask).

    Args:
      targets_BxT: the batch's targets (`Batch.targets_BxT`).
      turn_ids_BxT: assistant-turn index of each target, -1 elsewhere.
      window_mask_BxT: the targets the windows run over (a turn's, in order).
      hints: per student row b, {targeted turn k: that turn's hint tokens}.
      n: window length in tokens.

    Returns:
      True where window_mask_BxT is True and the target is in a copied span of its turn
      (windows are taken over the turn's targets under window_mask_BxT, in order).
    """
    out = np.zeros(np.shape(targets_BxT), bool)
    for b, row_hints in enumerate(hints):
        for k, hint in row_hints.items():
            (idx,) = np.nonzero((turn_ids_BxT[b] == k) & window_mask_BxT[b])
            if idx.size:
                out[b, idx] = copy_mask(targets_BxT[b, idx], hint, n)
    return out


def targeted_hints(traj: Trajectory, gate: str) -> dict[int, np.ndarray]:
    """{turn k: the hint tokens its teacher sees} for the turns the batch builder targets
    (tg_jax.rl.batch: gate "failed_turns" = the failed requirements' hints, "all_turns" =
    every judged requirement's; sorted names; turns with an empty hint left out)."""
    out = {}
    for k, verdicts in enumerate(traj.turn_verdicts):
        if gate == "failed_turns":
            names = sorted(n for n, ok in verdicts.items() if ok is not None and not ok)
        elif gate == "all_turns":
            names = sorted(n for n, ok in verdicts.items() if ok is not None)
        else:
            raise ValueError(f"unknown gate {gate!r}")
        hint = traj.hint_ids(k, names) if names else np.zeros((0,), np.int32)
        if hint.size:
            out[k] = hint
    return out


def mask_hint_copies(
    batch: Any, trajectories: Sequence[Trajectory], gate: str, n: int = NGRAM_TOKENS
) -> tuple[Any, int]:
    """`batch` (a tg_jax.rl.batch.Batch of host arrays, row b = trajectories[b]) with the
    hint-copying targets removed from M (`tg_mask_BxT`), and how many were removed.

    The windows run over each targeted turn's produced tokens (`loss_mask_BxT`), thinking
    tokens included whether or not M holds them."""
    mask = np.asarray(batch.tg_mask_BxT, bool)
    hints = [targeted_hints(t, gate) for t in trajectories]
    produced = np.asarray(batch.loss_mask_BxT, bool)
    copies = hint_copy_mask_BxT(
        np.asarray(batch.targets_BxT), np.asarray(batch.turn_ids_BxT), produced, hints, n
    )
    copies &= mask
    return batch.replace(tg_mask_BxT=mask & ~copies), int(copies.sum())
