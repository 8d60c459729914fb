"""The thinking-token control at an equal distilled-token budget (`tg.distill_budget`).

TG with thinking tokens (`tg.include_thinking`) distils the <think> tokens of the targeted
turns as well as their answer tokens, so it gets more teacher signal per step than TG without
them, and a comparison of the two mixes "which tokens" with "how many". With
`tg.distill_budget = "answer_tokens"` the thinking arm distils, per step, at most as many
tokens as the answer tokens of its targeted turns (what TG without thinking tokens would
distil on the same batch), drawn uniformly at random from its answer + thinking mask: the
same budget, spread over both kinds.

The draw is a function of (seed, step) only, so a resumed run draws what the uninterrupted
run drew.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tg_jax.rl.loss import distill_mask
from tg_jax.rl.step_config import TGConfig


def budget_masks(batch: Any, gate: str) -> tuple[np.ndarray, np.ndarray]:
    """(M with thinking tokens, M without them) of a host batch (`loss.distill_mask`)."""
    masks = (distill_mask(batch, TGConfig(include_thinking=t, gate=gate)) for t in (True, False))
    with_thinking, answers = (np.asarray(m, bool) for m in masks)
    return with_thinking, answers


def apply_budget(batch: Any, gate: str, seed: int, step: int) -> tuple[Any, int]:
    """`batch` (a tg_jax.rl.batch.Batch of host arrays) with its thinking-inclusive TG mask cut
    to the number of answer tokens under it, and how many tokens were left out.

    Tokens are left out of `distill_mask_BxT` (so of M); the teacher rows are unchanged.
    """
    full, answers = budget_masks(batch, gate)
    budget, have = int(answers.sum()), int(full.sum())
    if have <= budget:
        return batch, 0
    rng = np.random.default_rng([int(seed), int(step), 0x7467])
    where = np.flatnonzero(full.reshape(-1))
    drop = rng.choice(where, size=have - budget, replace=False)
    keep = np.asarray(batch.distill_mask_BxT, bool).copy().reshape(-1)
    keep[drop] = False
    return batch.replace(distill_mask_BxT=keep.reshape(full.shape)), have - budget
