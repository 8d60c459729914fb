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


def budget_masks(batch: Any) -> tuple[np.ndarray, np.ndarray]:
    """(M, M without its thinking tokens) of a host batch built with include_thinking."""
    with_thinking = np.asarray(batch.tg_mask_BxT, bool)
    return with_thinking, with_thinking & ~np.asarray(batch.thinking_mask_BxT, bool)


def apply_budget(batch: Any, seed: int, step: int) -> tuple[Any, int]:
    """`batch` (a tg_jax.rl.batch.Batch of host arrays built with include_thinking) with its
    TG mask M cut to the number of answer tokens under it, and how many tokens were left out.

    Tokens are left out of M (`tg_mask_BxT`); the teacher rows are unchanged.
    """
    full, answers = budget_masks(batch)
    budget, have = int(answers.sum()), int(full.sum())
    if have <= budget:
        return batch, 0
    rng = np.random.default_rng([int(seed), int(step), 0x7467])
    where = np.flatnonzero(full.reshape(-1))
    drop = rng.choice(where, size=have - budget, replace=False)
    keep = full.copy().reshape(-1)
    keep[drop] = False
    return batch.replace(tg_mask_BxT=keep.reshape(full.shape)), have - budget
