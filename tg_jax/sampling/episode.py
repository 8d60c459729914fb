"""One episode as evaluation produces it and the statistics consume it (`EpisodeRecord`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any

CONDITIONS = ("plain", "hinted")


@dataclasses.dataclass(frozen=True)
class EpisodeRecord:
    """One held-out episode, as evaluation produces it and the statistics consume it.

    Attributes:
      task_id: the held-out task (the bootstrap unit).
      condition: "plain" (the prompt as in training) or "hinted" (hints shown before every
        assistant turn: "can do when reminded").
      sample: index of this episode among the samples of the same task and condition.
      task_success: the hidden tests all passed.
      compliance: requirement name -> the episode met it: at least one assistant turn was
        judged on it (or it is conditional: `Requirement.conditional`) and every judged turn
        passed (the "all" requirement reward).
      actions: action counts of the episode, e.g. {"run_tests": 2, "submit": 1, "malformed": 0}.
      turns: assistant turns taken.
      cluster_id: the bootstrap cluster of the task: tasks sharing a hidden function are not
        independent items, so they share one cluster (`Task.function_id`). Empty (records
        written before clusters existed, synthetic ones) = the task's own cluster, task_id.
      hint_leaking_turns: assistant turns that reproduce a word n-gram of a requirement's
        hint text (privilege drift, tg_jax.envs.leakage); None = not measured (older
        records), then no "hint_leakage" value.
      unjudged: requirement name -> assistant turns it could not judge (a plug-in checker
        that raised or timed out, `tg_jax.envs.plugins`); such turns count as not judged.
    """

    task_id: str
    condition: str
    sample: int
    task_success: bool
    compliance: dict[str, bool]
    actions: dict[str, int]
    turns: int
    cluster_id: str = ""
    hint_leaking_turns: int | None = None
    unjudged: dict[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.condition not in CONDITIONS:
            raise ValueError(f"condition must be one of {CONDITIONS}, got {self.condition!r}")
        if not self.cluster_id:
            object.__setattr__(self, "cluster_id", self.task_id)  # frozen: set once here

    @property
    def compliant(self) -> bool:
        """Every requirement met (False when there are no requirements)."""
        return bool(self.compliance) and all(self.compliance.values())

    @property
    def joint(self) -> bool:
        """The new behaviour and the old skill in the same episode."""
        return self.compliant and self.task_success

    def values(self) -> dict[str, float]:
        """Every per-episode number: rates, per-requirement compliance, actions, turns and
        hint leakage (the share of the episode's turns that reproduce a hint n-gram)."""
        out = {
            "compliance": float(self.compliant),
            "task_success": float(self.task_success),
            "joint": float(self.joint),
            "turns": float(self.turns),
        }
        if self.hint_leaking_turns is not None:
            out["hint_leakage"] = self.hint_leaking_turns / max(self.turns, 1)
        out.update({f"compliance/{k}": float(v) for k, v in sorted(self.compliance.items())})
        out.update({f"actions/{k}": float(v) for k, v in sorted(self.actions.items())})
        out.update({f"unjudged/{k}": float(v) for k, v in sorted(self.unjudged.items())})
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EpisodeRecord:
        return cls(**d)


def episode_compliance(
    verdicts: Mapping[str, Sequence[bool | None]], conditional: Collection[str] = ()
) -> dict[str, bool]:
    """Per requirement: >= 1 judged turn and all judged turns passed (None = not judged); a
    `conditional` requirement (`Requirement.conditional`) with no judged turn is met."""
    out = {}
    for name, vs in verdicts.items():
        judged = [v for v in vs if v is not None]
        out[name] = all(judged) and (bool(judged) or name in conditional)
    return out
