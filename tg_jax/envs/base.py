"""The environment API: strings in, strings out.

An episode is: `reset(task)` -> first user message; then repeatedly the policy writes an
assistant message and `step(message)` returns the next observation (a "tool" message) until
`done`. Every assistant turn is judged by the environment's requirements (machine-checkable
format rules). A hint for requirement r is its own message (role HINT_ROLE) placed right
before the turn it targets; the environment supplies the text, the renderer the tokens.

Reward convention: every step returns a reward for every key in `reward_keys`; non-final
steps return 0.0 everywhere, the final step returns the episode's values, so the sum over
steps is the episode return.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

HINT_ROLE = "user"
REQUIREMENT_REWARD_MODES = ("fraction", "all")


class Unjudged(Exception):
    """A requirement could not judge a turn (a plug-in checker raised or ran past its
    timeout, `tg_jax.envs.plugins`): that turn's verdict is None and it is counted in
    `EpisodeSummary.unjudged`."""


@dataclasses.dataclass(frozen=True)
class Requirement:
    """A machine-checkable rule for assistant turns.

    Attributes:
      name: reward key and id, e.g. "fence".
      check: turn_text -> True iff the turn meets the requirement.
      hint: the hint text shown before a turn that should meet it.
      weight: weight of this requirement's reward in a weighted total.
      applies: turn_text -> whether the requirement is judged on this turn at all
        (e.g. "code is fenced" does not apply to a turn without code).
      conditional: a rule for some situations only (e.g. "ask before overwriting a file"):
        an episode where it never applied meets it (reward 1, compliance True). Otherwise
        (e.g. the fence) an episode with no applicable turn fails it, so that doing nothing
        never earns it.
      opening: the text a turn meeting it starts with, where the requirement is decided at
        the turn's first answer token (the fence: "```python\n"), else None. The base
        model's format cost (`tg_jax.train.sft_eval`) opens the first answer with it.
      timeout_s: seconds one call of a plug-in's check may take (`tg_jax.envs.plugins`;
        None: its default). Built-in requirements are not timed.
    """

    name: str
    check: Callable[[str], bool]
    hint: str
    weight: float = 1.0
    applies: Callable[[str], bool] = lambda turn_text: True
    conditional: bool = False
    breaks_at: Callable[[str], int | None] | None = None
    opening: str | None = None
    timeout_s: float | None = None

    def verdict(self, turn_text: str) -> bool | None:
        """True (met), False (failed turn) or None (not applicable)."""
        if not self.applies(turn_text):
            return None
        return bool(self.check(turn_text))

    def break_offset(self, turn_text: str) -> int | None:
        """`breaks_at(turn_text)` for a failed turn, checked to lie in [0, len(turn_text)];
        None without a locator or when it cannot tell."""
        if self.breaks_at is None:
            return None
        off = self.breaks_at(turn_text)
        if off is not None and not 0 <= off <= len(turn_text):
            raise ValueError(
                f"requirement {self.name!r}: breaks_at gave {off} outside [0, {len(turn_text)}]"
            )
        return off


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one environment step returns.

    Attributes:
      observation: next message to the policy (role "tool"), None iff done.
      done: the episode is over.
      rewards: reward per key (0.0 on non-final steps).
      info: per-step details (action, error, verdicts, ...); "summary" on the final step.
    """

    observation: str | None
    done: bool
    rewards: dict[str, float]
    info: dict[str, Any]


@dataclasses.dataclass
class EpisodeSummary:
    """Per-episode record for compliance and side-effect reporting.

    Attributes:
      verdicts: requirement name -> one verdict per assistant turn (True/False/None).
      actions: action counts, e.g. {"run_tests": 2, "submit": 1, "malformed": 0}.
      turns: number of assistant turns taken.
      end_reason: "submit", "max_turns" or "" while running.
      unjudged: requirement name -> turns it could not judge (`Unjudged`; their verdict is
        None).
      rejected: indices of the turns that are not a valid action of the environment
        (`Environment.valid_action`: a malformed call, junk code, an edit that does not apply;
        or `reject_turn` in a step). A requirement met there earns no reward
        (`requirement_reward`); where `begin_turn` rejected the turn, its met verdicts were
        recorded as failed too, so compliance and the TG gate count it failed.
    """

    verdicts: dict[str, list[bool | None]]
    actions: dict[str, int]
    turns: int = 0
    end_reason: str = ""
    unjudged: dict[str, int] = dataclasses.field(default_factory=dict)
    rejected: list[int] = dataclasses.field(default_factory=list)

    def reject_turn(self) -> None:
        """Marks the current turn (the last one counted) as not accepted by the environment."""
        if self.turns < 1:
            raise RuntimeError("reject_turn() before any turn was counted")
        if not self.rejected or self.rejected[-1] != self.turns - 1:
            self.rejected.append(self.turns - 1)

    def failed_turns(self, name: str) -> list[int]:
        """Indices of assistant turns that failed requirement `name` (the TG gate)."""
        return [k for k, v in enumerate(self.verdicts[name]) if v is False]

    def requirement_reward(
        self, name: str, mode: str = "fraction", conditional: bool = False
    ) -> float:
        """Requirement reward of the episode.

        The one place a requirement's reward is paid. A turn meets the requirement for the
        reward only when its verdict is True and it is a valid action of the environment (not
        in `rejected`): a well-formed tool call around junk code (`a`, `pass`, a function of
        another name), or a fence around it, is not rewarded. Otherwise the requirement's
        reward is worth more than the task to a policy that fails most tasks, and GRPO learns
        to write the format without the work (configs/joint.py: 2 of 3 GRPO seeds collapsed to
        task success 0 with tool_json "compliance" 1.0).

        Args:
          name: requirement name.
          mode: "fraction" = share of applicable turns that meet it; "all" = 1.0 iff every
            applicable turn meets it. With no applicable turn at all (e.g. the policy never
            wrote code) the reward is 0.0, so doing nothing never earns it, unless the
            requirement is `conditional` and the episode took a valid action (then 1.0: it
            was never called for; an episode of junk turns alone does not earn it).
          conditional: `Requirement.conditional`.

        Returns:
          The reward in [0, 1].
        """
        rejected = set(self.rejected)
        judged = [
            v and k not in rejected for k, v in enumerate(self.verdicts[name]) if v is not None
        ]
        if not judged:
            return 1.0 if conditional and self.turns > len(rejected) else 0.0
        if mode == "fraction":
            return sum(judged) / len(judged)
        if mode == "all":
            return float(all(judged))
        raise ValueError(f"mode must be one of {REQUIREMENT_REWARD_MODES}, got {mode!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def turn_text(assistant_message: Any, *, done: bool) -> str:
    """The text of a turn given to `Environment.step` (bytes decoded, invalid UTF-8 replaced).

    Raises:
      RuntimeError: the episode is not running (`done`: before reset or after its end).
      TypeError: not text.
    """
    if done:
        raise RuntimeError("step() called before reset() or after the episode ended")
    if isinstance(assistant_message, bytes):
        assistant_message = assistant_message.decode("utf-8", "replace")
    if not isinstance(assistant_message, str):
        raise TypeError(f"assistant_message must be str, got {type(assistant_message)}")
    return assistant_message


def hint_text(requirements: Sequence[Requirement], names: Sequence[str]) -> str:
    """Hint message text for the named requirements, one line each, in the order of their
    names: the same text whatever the order of `requirements` (the SFT transcripts' env, the
    RL env and the hinted evaluation may list them differently; a base model taught one order
    follows the hints of both requirements at 0.2 in the other)."""
    unknown = set(names) - {r.name for r in requirements}
    if unknown:
        raise ValueError(f"unknown requirement(s) {sorted(unknown)}")
    return join_hints({r.name: r.hint for r in requirements if r.name in names})


def join_hints(texts: Mapping[str, str]) -> str:
    """The one hint message for several requirements, {name: its hint text}: one line each,
    in name order (`hint_text`; the imperfect-feedback picks of a turn are joined the same)."""
    return "\n".join(texts[n] for n in sorted(texts))


def weighted_total(
    rewards: dict[str, float], requirements: Sequence[Requirement], task_weight: float = 1.0
) -> float:
    """task_weight * rewards["task"] + sum_r weight_r * rewards[r.name]."""
    total = task_weight * rewards.get("task", 0.0)
    return total + sum(r.weight * rewards.get(r.name, 0.0) for r in requirements)


class Environment(abc.ABC):
    """Multi-turn text environment. Subclasses set `requirements` and implement the rest.

    A malformed assistant message (no parsable action, broken tool-call JSON, no code,
    garbage bytes) must produce a clear observation and rewards, never an exception.
    """

    requirements: tuple[Requirement, ...] = ()
    # JSON schemas of the tools ({"type": "function", "function": {...}}), for the chat
    # template's own `tools` argument (it describes them in the model's format); None: the task
    # prompt describes them.
    tool_schemas: tuple[dict[str, Any], ...] | None = None

    @property
    def reward_keys(self) -> tuple[str, ...]:
        return ("task", *(r.name for r in self.requirements))

    @abc.abstractmethod
    def reset(self, task: Any) -> str:
        """Starts an episode; returns the first user message."""

    @abc.abstractmethod
    def step(self, assistant_message: str) -> StepResult:
        """Consumes one assistant turn; returns the observation, done flag and rewards."""

    @abc.abstractmethod
    def summary(self) -> EpisodeSummary:
        """The current episode's summary."""

    def judge(self, turn_text: str) -> dict[str, bool | None]:
        """Verdict of every requirement on one assistant turn."""
        return self.judge_turn(turn_text)[0]

    def judge_turn(self, turn_text: str) -> tuple[dict[str, bool | None], list[str]]:
        """(`judge`'s verdicts, the names of the requirements that could not judge the turn:
        `Unjudged`, their verdict None)."""
        verdicts: dict[str, bool | None] = {}
        unjudged = []
        for r in self.requirements:
            try:
                verdicts[r.name] = r.verdict(turn_text)
            except Unjudged:
                verdicts[r.name] = None
                unjudged.append(r.name)
        return verdicts, unjudged

    def breaks(self, turn_text: str, verdicts: Mapping[str, bool | None]) -> dict[str, int]:
        """{name: `Requirement.break_offset`} of each requirement the turn failed that can
        locate its break (`turn_text` as the environment judged it)."""
        out = {}
        for r in self.requirements:
            if verdicts.get(r.name) is False:
                off = r.break_offset(turn_text)
                if off is not None:
                    out[r.name] = off
        return out

    def valid_action(self, turn_text: str) -> bool:
        """Whether the turn is a valid action of this environment, whatever its format: its
        requirements are met only on a valid action (`begin_turn`), so that a well-formed
        tool call or fence around junk earns no reward and counts as failed.

        Called by `begin_turn` before the step runs the turn (the environment's state is the
        one the turn acts on). The default, True, accepts every turn: an environment whose
        turns can be junk says what a valid action is (the coding environment: code that
        parses and defines f; the SWE one: a well-formed call whose edit applies).
        """
        del turn_text
        return True

    def begin_turn(
        self, assistant_message: Any, summary: EpisodeSummary, *, done: bool
    ) -> tuple[str, dict[str, bool | None]]:
        """A step's common start: the turn's text (`turn_text`), counted in `summary`, and
        every requirement's verdict on it, recorded there too. A turn that is not a valid
        action (`valid_action`) is rejected (`EpisodeSummary.reject_turn`) and the
        requirements it met are recorded as failed: no reward, not compliant, and the TG gate
        targets it, as any failed turn (not applicable stays None)."""
        text = turn_text(assistant_message, done=done)
        summary.turns += 1
        verdicts, unjudged = self.judge_turn(text)
        if not self.valid_action(text):
            summary.reject_turn()
            verdicts = {name: None if v is None else False for name, v in verdicts.items()}
        for name, v in verdicts.items():
            summary.verdicts[name].append(v)
        for name in unjudged:
            summary.unjudged[name] = summary.unjudged.get(name, 0) + 1
        return text, verdicts

    def hint(self, names: Sequence[str]) -> str:
        """Hint text for the named requirements (see `hint_text`)."""
        return hint_text(self.requirements, names)

    def hint_message(self, names: Sequence[str]) -> dict[str, str]:
        """The hint as a chat message, to be placed right before the targeted turn."""
        return {"role": HINT_ROLE, "content": self.hint(names)}
