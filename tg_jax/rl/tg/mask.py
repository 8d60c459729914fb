"""M, the tokens the TG term distils: which turns are targeted, and which of their tokens count.

A turn is *targeted* when it failed a requirement (tg.gate "failed_turns"; its hint = the hints
of its failed requirements) or, with "all_turns", whenever it has verdicts (the hints of all
its requirements). `build_batch` builds M once per batch on the host (`tg_mask`) and carries
it as `Batch.tg_mask_BxT`; the batch's host-side cuts (`break_span`, `hint_copies`,
`distill_budget`) only remove tokens from it, and the loss reads it as it is.
"""

from __future__ import annotations

from typing import Any

import numpy as np

GATES = ("failed_turns", "all_turns")


def failed_requirements(traj: Any, turn: int) -> list[str]:
    """Sorted names of the requirements turn `turn` of the trajectory broke; a None verdict (not
    applicable) is not a failure."""
    return sorted(n for n, ok in traj.turn_verdicts[turn].items() if ok is not None and not ok)


def targeted_requirements(traj: Any, turn: int, gate: str) -> list[str]:
    """Sorted names of the requirements whose hint precedes turn `turn` in the teacher rows
    (gate "failed_turns": the failed ones; "all_turns": every judged one)."""
    if gate == "failed_turns":
        return failed_requirements(traj, turn)
    if gate == "all_turns":  # every requirement judged on the turn (None = not applicable)
        return sorted(n for n, ok in traj.turn_verdicts[turn].items() if ok is not None)
    raise ValueError(f"unknown gate {gate!r}")


def tg_mask(
    hinted_BxT: Any,
    thinking_mask_BxT: Any,
    failed_turn_mask_BxT: Any,
    loss_mask_BxT: Any,
    *,
    include_thinking: bool,
    gate: str,
) -> np.ndarray:
    """The distillation mask M, bool [B, T] (numpy; all inputs [B, T], target-aligned).

    Inputs:
      hinted_BxT: the target has a hinted teacher counterpart (its turn is targeted, has a
        non-empty hint and a teacher row). With gate "all_turns" that is every turn with
        verdicts.
      thinking_mask_BxT: the produced tokens inside a `<think>...</think>` span (tags included).
      failed_turn_mask_BxT: every token of an assistant turn that broke a requirement.
      loss_mask_BxT: the tokens the policy produced (answer and thinking). Prompt, environment
        and tool tokens, hints and padding are never in M.

    Rule:
      eligible = loss_mask if include_thinking else loss_mask & ~thinking
      M        = eligible & failed_turn & hinted   (gate "failed_turns", the method's default)
      M        = eligible & hinted                 (gate "all_turns": every turn)
    """
    if gate not in GATES:
        raise ValueError(f"unknown gate {gate!r}")
    eligible_BxT = np.asarray(loss_mask_BxT, bool)
    if not include_thinking:
        eligible_BxT = eligible_BxT & ~np.asarray(thinking_mask_BxT, bool)
    if gate == "failed_turns":
        eligible_BxT = eligible_BxT & np.asarray(failed_turn_mask_BxT, bool)
    return eligible_BxT & np.asarray(hinted_BxT, bool)
