"""Imperfect feedback: pick a correct, an irrelevant or a wrong hint at set rates; and a judge
that errs.

Used to measure how sensitive targeted guidance is to feedback quality (docs/design.md section 4).
The kind is drawn per targeted turn (`pick_turn_hints`), not per episode.
A wrong hint points at a different format (it would make the turn fail the requirement); an
irrelevant hint is true-sounding advice that says nothing about the requirement.

A wrong judge (`VerdictNoise`, `noisy_judge`): the requirements' checkers of the training
environments give the wrong verdict at set rates: a failed turn judged met (false positive: no
hint, no TG, requirement reward earned) or a met turn judged failed (false negative: a hint and
the TG KL on a turn that was right). The error is a function of (run seed, requirement, turn
text), so one turn text is always judged the same way in a run, whatever thread or step judges
it, as a model judge would. Training sees only the judge's verdicts (rewards, TG gate and the
rollout metrics); the held-out evaluation judges with the true checkers.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from tg_jax.envs.base import Requirement
from tg_jax.envs.protocol import FENCE_HINT, TOOL_JSON_HINT, tool_json_hint
from tg_jax.envs.swe import requirements as swe_requirements
from tg_jax.text.tool_formats import HERMES, ToolFormat

HINT_KINDS = ("correct", "irrelevant", "wrong")

CORRECT_HINTS: dict[str, str] = {
    "fence": FENCE_HINT,
    "tool_json": TOOL_JSON_HINT,
    **swe_requirements.HINTS,
}
IRRELEVANT_HINTS: tuple[str, ...] = (
    "Reminder: keep your lines short.",
    "Reminder: read the examples carefully.",
    "Reminder: small steps are fine.",
)
WRONG_HINTS: dict[str, tuple[str, ...]] = {
    "fence": ("Reminder: put code in a ```js block.", "Reminder: never use code fences."),
    "tool_json": ("Reminder: use <tool>run_tests</tool>.", "Reminder: end with CALL submit."),
    **swe_requirements.WRONG_HINTS,
}


def correct_hint(name: str, fmt: ToolFormat = HERMES) -> str:
    """The correct hint of requirement `name` for a model whose tool-call format is `fmt`
    (`CORRECT_HINTS` holds the Hermes ones)."""
    if name == "tool_json":
        return tool_json_hint(fmt)
    if name in swe_requirements.HINTS:
        return swe_requirements.hint(name, fmt)
    return CORRECT_HINTS[name]


class Rng(Protocol):
    """Anything with `.random() -> float in [0, 1)`: random.Random or numpy's Generator."""

    def random(self) -> float: ...


@dataclasses.dataclass(frozen=True)
class FeedbackRates:
    """Probabilities of each hint kind; they must sum to 1."""

    correct: float = 1.0
    irrelevant: float = 0.0
    wrong: float = 0.0

    def __post_init__(self):
        rates = (self.correct, self.irrelevant, self.wrong)
        if any(r < 0 for r in rates) or abs(sum(rates) - 1.0) > 1e-6:
            raise ValueError(f"feedback rates must be >= 0 and sum to 1, got {rates}")


def _choice(rng: Rng, options: Sequence[str]) -> str:
    return options[min(int(rng.random() * len(options)), len(options) - 1)]


def pick_hint(
    name: str, rng: Rng, rates: FeedbackRates = FeedbackRates(), fmt: ToolFormat = HERMES
) -> tuple[str, str]:
    """Picks the hint shown for a failed turn of requirement `name`.

    Args:
      name: requirement name ("fence" or "tool_json").
      rng: random source; the same rng state gives the same pick.
      rates: probabilities of a correct / irrelevant / wrong hint.
      fmt: the model's tool-call format (the correct hints that show a call use it).

    Returns:
      (kind, text) with kind in HINT_KINDS.
    """
    if name not in CORRECT_HINTS:
        raise ValueError(f"no hints for requirement {name!r}")
    u = rng.random()
    if u < rates.correct:
        return "correct", correct_hint(name, fmt)
    if u < rates.correct + rates.irrelevant:
        return "irrelevant", _choice(rng, IRRELEVANT_HINTS)
    return "wrong", _choice(rng, WRONG_HINTS[name])


def pick_hints(
    names: Sequence[str], rng: Rng, rates: FeedbackRates = FeedbackRates()
) -> tuple[list[str], str]:
    """Picks one hint per requirement and joins them into one hint message.

    Returns:
      (kinds, text): the kind of each hint, in `names` order, and the message text.
    """
    picks = [pick_hint(n, rng, rates) for n in names]
    return [k for k, _ in picks], "\n".join(t for _, t in picks)


def pick_turn_hints(
    turn_verdicts: Sequence[Mapping[str, bool | None]], pick: Callable[[str], str]
) -> list[dict[str, str]]:
    """One feedback pick per assistant turn and requirement judged on it.

    Each turn a requirement was judged on (verdict not None: the turns either gate can
    target) gets its own `pick(name)`, so the kind (correct / irrelevant / wrong) is drawn
    per turn at the configured rates: two failed turns of one episode can be shown
    different kinds of feedback.

    Returns:
      per turn, {requirement name: hint text}, in turn and then verdict order.
    """
    return [
        {name: pick(name) for name, ok in verdicts.items() if ok is not None}
        for verdicts in turn_verdicts
    ]


def hint_kind(name: str, text: str, fmt: ToolFormat = HERMES) -> str:
    """Which kind a hint text of requirement `name` is (inverse of `pick_hint`)."""
    if name in CORRECT_HINTS and text == correct_hint(name, fmt):
        return "correct"
    if text in IRRELEVANT_HINTS:
        return "irrelevant"
    if text in WRONG_HINTS.get(name, ()):
        return "wrong"
    raise ValueError(f"{text!r} is no hint of requirement {name!r}")


@dataclasses.dataclass(frozen=True)
class VerdictNoise:
    """How often the training judge errs (`rl_loop.feedback.false_positive` / `false_negative`).

    Attributes:
      false_positive: share of failed turns judged met.
      false_negative: share of met turns judged failed.
    """

    false_positive: float = 0.0
    false_negative: float = 0.0

    def __post_init__(self):
        for name in ("false_positive", "false_negative"):
            rate = getattr(self, name)
            if not 0.0 <= rate < 1.0:
                raise ValueError(f"rl_loop.feedback.{name} must be in [0, 1), got {rate}")

    @property
    def active(self) -> bool:
        return self.false_positive > 0 or self.false_negative > 0


def judge_unit(seed: int, name: str, text: str) -> float:
    """A number in [0, 1) fixed by (seed, requirement name, turn text): the judge's draw."""
    digest = hashlib.blake2b(f"{seed}\0{name}\0{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def noisy_verdict(met: bool, noise: VerdictNoise, seed: int, name: str, text: str) -> bool:
    """A wrong judge's verdict of a turn whose true verdict is `met`: flipped at `noise`'s
    rates, by the draw `judge_unit(seed, name, text)`."""
    u = judge_unit(seed, name, text)
    return u >= noise.false_negative if met else u < noise.false_positive


def noisy_requirement(req: Requirement, noise: VerdictNoise, seed: int) -> Requirement:
    """`req` judged by a wrong judge: its check's verdict flipped at `noise`'s rates."""
    check, name = req.check, req.name

    def judged(text: str) -> bool:
        return noisy_verdict(bool(check(text)), noise, seed, name, text)

    return dataclasses.replace(req, check=judged)


def noisy_judge(factory: Callable[[], Any], noise: VerdictNoise, seed: int) -> Callable[[], Any]:
    """An environment factory whose environments' requirements judge with `noise`
    (`factory` itself when there is none)."""
    if not noise.active:
        return factory

    def make() -> Any:
        env = factory()
        env.requirements = tuple(noisy_requirement(r, noise, seed) for r in env.requirements)
        return env

    return make
