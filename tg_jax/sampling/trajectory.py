"""The record a multi-turn rollout produces and the trainer consumes.

Token-in/token-out: `tokens` are exactly the ids the sampler saw and produced, in order
(prompt, assistant turns, environment observations, template separators). The trainer
never re-renders text. Hints are NOT in `tokens`: for each failed assistant turn the
rollout records which requirements failed, and `hint_tokens` holds the rendered hint
message per requirement, so the batch builder can insert it before that turn to make the
teacher sequence (see tg_jax.rl.batch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from tg_jax.text.chat import Role  # PROMPT=0, THINK=1, ANSWER=2, ENV=3, HINT=4


def hint_key(names: Sequence[str]) -> str:
    """The key of the one hint message for several requirements in a hint table
    (`Trajectory.hint_tokens`, `turn_hint_tokens`): their sorted names joined by "+"."""
    return "+".join(sorted(set(names)))


@dataclasses.dataclass
class Trajectory:
    """One episode.

    Attributes:
      tokens: [n] int32, the whole student sequence.
      roles: [n] int8 `Role` codes (assistant header tokens are PROMPT; the closing
        <|im_end|> of an assistant turn is ANSWER).
      turn_ids: [n] int32, index of the assistant turn a token belongs to (thinking and
        answer tokens), -1 for every other token.
      turn_starts: [num_turns] int32, index in `tokens` of the first token of each
        assistant turn's header ("<|im_start|>assistant\\n"): a hint message is inserted
        right before it.
      behaviour_logprobs: [n] float32, log-prob of each sampled token under the sampling
        distribution (after temperature / top-k / top-p), 0 for tokens not sampled.
      turn_verdicts: per assistant turn, {requirement name: passed}.
      rewards: reward components, e.g. {"task": 1.0, "fence": 0.0}.
      hint_tokens: {requirement name: token ids of the rendered hint message}, and for a
        turn that fails several requirements, {hint_key(names): their one message}.
      group_id: rollouts of the same task in the same step share it (GRPO groups).
      policy_version: version of the weights that sampled it.
      task_id: the task's id.
      info: free-form episode summary (actions taken, termination reason, ...).
      turn_hint_tokens: per assistant turn, {requirement name: token ids of the hint message
        the teacher sees before that turn} (imperfect feedback picks one per turn; several
        requirements' picks also under hint_key(names), one message); None =
        `hint_tokens` for every turn.
      turn_breaks: per assistant turn, {failed requirement: index in `tokens` of the first
        token that breaks it} for the requirements that locate it (`Requirement.breaks_at`);
        None = not located in any turn.
      routed_experts: MoE router replay (`model.router_replay`): [n, L, J] int16, the experts
        each layer routed token i to in the rollout (sampler or engine), -1 where it has none
        (a token the rollout never fed: the router decides there); None = not recorded.
    """

    tokens: np.ndarray
    roles: np.ndarray
    turn_ids: np.ndarray
    turn_starts: np.ndarray
    behaviour_logprobs: np.ndarray
    turn_verdicts: list[dict[str, bool]]
    rewards: dict[str, float]
    hint_tokens: dict[str, list[int]]
    group_id: int
    policy_version: int
    task_id: str
    info: dict = dataclasses.field(default_factory=dict)
    turn_hint_tokens: list[dict[str, list[int]]] | None = None
    turn_breaks: list[dict[str, int]] | None = None
    routed_experts: np.ndarray | None = None

    def __post_init__(self):
        n = len(self.tokens)
        if self.routed_experts is not None and len(self.routed_experts) != n:
            raise ValueError(f"Trajectory.routed_experts: {len(self.routed_experts)} rows != {n}")
        for name in ("roles", "turn_ids", "behaviour_logprobs"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Trajectory.{name} has length {len(getattr(self, name))} != {n}")
        if len(self.turn_starts) != len(self.turn_verdicts):
            raise ValueError("one verdict dict per assistant turn is required")
        if self.turn_hint_tokens is not None and len(self.turn_hint_tokens) != self.num_turns:
            raise ValueError("turn_hint_tokens needs one dict per assistant turn")
        if self.turn_breaks is not None and len(self.turn_breaks) != self.num_turns:
            raise ValueError("turn_breaks needs one dict per assistant turn")

    @property
    def num_turns(self) -> int:
        return len(self.turn_verdicts)

    def hint_ids(self, turn: int, names: Sequence[str]) -> np.ndarray:
        """[H] int32: the hint shown before turn `turn` for the requirements `names`.

        Several names: the one message that hints them all (key `hint_key(names)`, one line
        per requirement, as the SFT transcripts and the hinted evaluation show it) when the
        table has it, else each one's message in the order of `names`. A requirement without
        hint tokens adds nothing."""
        table = self.hint_tokens if self.turn_hint_tokens is None else self.turn_hint_tokens[turn]
        if len(names) > 1 and hint_key(names) in table:
            return np.asarray(table[hint_key(names)], np.int32)
        parts = [np.asarray(table.get(n, ()), np.int32) for n in names]
        return np.concatenate(parts) if parts else np.zeros((0,), np.int32)

    def closed_by_rollout(self) -> int:
        """Tokens inside assistant turns that the policy did not sample: the </think> the
        rollout appends to a block still open at `rl_loop.think_budget` (role PROMPT)."""
        ids = np.asarray(self.turn_ids)
        n = 0
        for k in range(self.num_turns):
            (idx,) = np.nonzero(ids == k)
            n += int((ids[idx[0] : idx[-1]] < 0).sum()) if idx.size else 0
        return n

    def failed_requirements(self, turn: int) -> list[str]:
        """Names of the requirements assistant turn `turn` broke (sorted; None = not applicable)."""
        return sorted(name for name, ok in self.turn_verdicts[turn].items() if ok is False)

    def turn_met(self, turn: int) -> bool | None:
        """Whether assistant turn `turn` met every requirement judged on it; None when none
        was judged (every verdict None: not applicable)."""
        judged = [ok for ok in self.turn_verdicts[turn].values() if ok is not None]
        return all(judged) if judged else None


def visible_context(roles: Sequence[int], turn_ids: Sequence[int], turn: int) -> np.ndarray:
    """Hidden planning text (`rl_loop.hide_thinking`): bool [n], the tokens of a rollout's
    record that assistant turn `turn` sees, every token but the <think> blocks of earlier
    turns (Role.THINK tokens, tags included; what the model wrote after a block stays)."""
    roles, turn_ids = np.asarray(roles), np.asarray(turn_ids)
    return ~((roles == Role.THINK) & (turn_ids >= 0) & (turn_ids < turn))


def aligned_routes(routes: np.ndarray | None, n: int) -> np.ndarray | None:
    """A rollout's routing record [m, L, J] made n rows long: cut, or padded with -1 (tokens
    it never fed: the router's own choice); None stays None."""
    if routes is None:
        return None
    out = np.full((n, *routes.shape[1:]), -1, np.int16)
    out[: min(n, len(routes))] = routes[:n]
    return out


__all__ = ["Role", "Trajectory", "aligned_routes", "hint_key", "visible_context"]
