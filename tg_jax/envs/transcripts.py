"""Synthetic expert transcripts of the coding environment, for SFT of the base model.

A transcript is a message list ({"role": "user" | "assistant" | "tool", "content": str}):
the task prompt, then assistant turns, each followed by the tool observation unless the
episode ended. An assistant message may also carry "no_loss_chars": offsets in its content
whose tokens SFT leaves out of the loss (`TranscriptConfig.p_forced`). A hint, when present,
is its own "user" message right before the assistant turn it targets. Observations and
rewards come from actually running CodingEnv on the turns (by default with the in-process
"trusted" executor, since the code is ours; the sandbox gives the same text), so SFT and RL
see identical observation strings.

Knobs (TranscriptConfig) shape the base model: the share of wrong final answers caps its
pass rate; hinted turns follow the hinted requirements (unless `p_ignore_hint`) and unhinted
turns never meet any requirement, so the base model follows a hint when one is in context and
almost never meets a requirement without one.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Sequence
from typing import ClassVar

from tg_jax.config_schema import Section
from tg_jax.envs.base import HINT_ROLE, StepResult
from tg_jax.envs.coding import CodingEnv, CodingEnvConfig
from tg_jax.envs.protocol import REQUIREMENT_NAMES, format_turn
from tg_jax.envs.tasks import EASY_FAMILIES, FAMILIES, HARD_FAMILIES, Task

Guess = tuple[str, tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class TranscriptConfig(Section):
    """Knobs of the synthetic expert: the `sft.transcripts` section of a run config.

    Attributes:
      p_correct: probability that the submitted function is the right one.
      p_hinted: probability that a transcript is hinted (then every turn with an applicable
        requirement gets a hint message).
      p_hint_requirement: in a hinted turn, probability that each applicable requirement is
        hinted (at least one always is).
      p_ignore_hint: probability that a hinted requirement is not followed in its turn (the
        hint is shown, the turn is written as unhinted). Gives the base model hinted contexts
        followed by non-compliant turns: the contexts the TG teacher is evaluated in when it
        scores the policy's own failed turns.
      p_multi_turn: probability of run_tests -> observation -> revise/submit (else one
        submit turn).
      p_fix: multi-turn only: probability that the first attempt is a wrong guess that
        fails the visible tests and is revised after the observation.
      p_retest: after a revision, probability of running the tests again before submitting
        (when the turn limit allows).
      p_think: probability that code turns open with a <think> block naming the family.
      p_forced: probability that an unhinted transcript meets `forced_requirements` anyway,
        as if each turn had been forced to open that way: the character where the turn
        without the requirement would differ (`Requirement.breaks_at`: the first backtick
        of the fence) is listed in the message's "no_loss_chars", and SFT leaves its token
        out of the loss. The base model learns to continue such a turn as well as a plain
        one, never to start one unprompted (as a pretrained model writes good Markdown once
        it has started, without choosing Markdown unasked).
      forced_requirements: the requirements of p_forced (each met where it applies).
      max_chars: transcripts whose message contents sum to more are redrawn (the model's
        context must also hold the chat template's role markers).
    """

    section: ClassVar[str] = "sft.transcripts"

    p_correct: float = 0.7
    p_hinted: float = 0.3
    p_hint_requirement: float = 0.7
    p_ignore_hint: float = 0.0
    p_multi_turn: float = 0.5
    p_fix: float = 0.3
    p_retest: float = 0.5
    p_think: float = 1.0
    p_forced: float = 0.0
    forced_requirements: tuple[str, ...] = ()
    max_chars: int = 800

    def __post_init__(self):
        unknown = sorted(set(self.forced_requirements) - set(REQUIREMENT_NAMES))
        if unknown:
            raise ValueError(
                f"sft.transcripts.forced_requirements: unknown {unknown}; known: "
                f"{list(REQUIREMENT_NAMES)}"
            )
        if not 0.0 <= self.p_forced <= 1.0:
            raise ValueError(f"sft.transcripts.p_forced must be in [0, 1], got {self.p_forced}")
        if self.p_forced > 0 and not self.forced_requirements:
            raise ValueError(
                "sft.transcripts.p_forced > 0 needs sft.transcripts.forced_requirements (the "
                "requirements its transcripts meet unprompted)"
            )


@dataclasses.dataclass
class Transcript:
    """One synthetic episode.

    Attributes:
      task_id: the task's id.
      messages: the chat messages (see module docstring).
      rewards: the environment's final rewards for this episode.
      correct: the submitted function is the right one.
      hinted: the transcript contains hint messages.
      summary: the environment's EpisodeSummary as a dict.
    """

    task_id: str
    messages: list[dict[str, str]]
    rewards: dict[str, float]
    correct: bool
    hinted: bool
    summary: dict


def guess_code(guess: Guess) -> str:
    """Canonical code of a guessed function, e.g. ("lin", (2, 3)) -> 'def f(x): return 2*x+3'."""
    return FAMILIES[guess[0]].code(guess[1])


def _fits(guess: Guess, pairs: Sequence[tuple[int, int]]) -> bool:
    fam, params = guess
    return all(FAMILIES[fam].fn(params, x) == y for x, y in pairs)


def wrong_guesses(task: Task, families: Sequence[str] | None = None) -> list[Guess]:
    """Plausible wrong functions: the functions read off the anchors f(0), f(1) in each family
    (e.g. `1+x` for `1+abs(x)`, which fits every visible x >= 0), and the true family with one
    parameter off by one; only functions of `families` are kept, and each fails at least one
    hidden test.

    Args:
      task: the task.
      families: the families a guess may come from (default: the task's family set,
        EASY_FAMILIES or HARD_FAMILIES).

    Returns:
      Sorted, non-empty list of (family, params).
    """
    if families is None:
        families = EASY_FAMILIES if task.family in EASY_FAMILIES else HARD_FAMILIES
    families = tuple(families) if task.family in families else (*families, task.family)
    cands: set[Guess] = set()
    vis = dict(task.visible)
    if 0 in vis and 1 in vis:
        b, a = vis[0], vis[1] - vis[0]
        if a != 0:
            cands.update((fam, (a, b)) for fam in ("lin", "quad", "abs"))
        cands.update(("mod", (m, b)) for m in (2, 3, 4))
        cands.update((fam, (vis[0],)) for fam in ("max", "min", *EASY_FAMILIES))
    for i in range(len(task.params)):
        for d in (-1, 1):
            p = list(task.params)
            p[i] += d
            cands.add((task.family, tuple(p)))
    valid = lambda g: g[0] in families and g[1] in FAMILIES[g[0]].grid
    out = sorted(g for g in cands if valid(g) and not _fits(g, task.hidden))
    if not out:  # rare (e.g. a clamp shift no hidden input reaches): any other function
        grid = ((name, p) for name in families for p in FAMILIES[name].grid)
        out = [next(g for g in grid if not _fits(g, task.hidden))]
    return out


def make_transcript(
    task: Task,
    rng: random.Random,
    config: TranscriptConfig = TranscriptConfig(),
    env: CodingEnv | None = None,
    families: Sequence[str] | None = None,
) -> Transcript:
    """Generates one expert transcript by playing the episode in `env`.

    Args:
      task: the task.
      rng: random source (the transcript is a deterministic function of its state).
      config: the expert's knobs.
      env: environment to play in; default CodingEnv(CodingEnvConfig(executor="trusted")).
        Its requirements and max_turns shape the transcript.
      families: the families wrong guesses come from (see `wrong_guesses`).

    Returns:
      The Transcript.
    """
    env = env or CodingEnv(CodingEnvConfig(executor="trusted"))
    for _ in range(1000):
        tr = _draw(task, rng, config, env, families)
        if sum(len(m["content"]) for m in tr.messages) <= config.max_chars:
            return tr
    raise ValueError(f"no transcript of task {task.task_id} fits max_chars={config.max_chars}")


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The expert's draws for one transcript, made before it plays a turn."""

    truth: Guess  # the task's function
    final: Guess  # the submitted function (the truth with probability p_correct)
    first: Guess  # multi-turn: the first attempt (a failing guess with probability p_fix)
    hinted: bool
    forced: bool  # meets the forced requirements unhinted (p_forced)
    think: bool
    multi: bool  # run_tests -> observation -> revise/submit


def _plan(
    task: Task,
    rng: random.Random,
    config: TranscriptConfig,
    max_turns: int,
    families: Sequence[str] | None,
) -> _Plan:
    """The draws of `_draw`, in the order that keeps transcripts a deterministic function of
    the rng's state."""
    truth: Guess = (task.family, task.params)
    wrong = wrong_guesses(task, families)
    correct = rng.random() < config.p_correct
    if correct:
        final = truth
    else:
        # Prefer wrong answers that fit the visible examples: the mistake an expert makes.
        plausible = [g for g in wrong if _fits(g, task.visible)]
        final = rng.choice(plausible or wrong)
    hinted = rng.random() < config.p_hinted
    # Drawn only when on, so that transcripts without it are unchanged.
    forced = config.p_forced > 0 and not hinted and rng.random() < config.p_forced
    think = rng.random() < config.p_think
    multi = max_turns >= 2 and rng.random() < config.p_multi_turn
    failing = [g for g in wrong if not _fits(g, task.visible) and g != final]
    first = rng.choice(failing) if multi and failing and rng.random() < config.p_fix else final
    return _Plan(truth, final, first, hinted, forced, think, multi)


def _draw(
    task: Task,
    rng: random.Random,
    config: TranscriptConfig,
    env: CodingEnv,
    families: Sequence[str] | None,
) -> Transcript:
    """One transcript: the expert's plan (`_plan`), then its turns played in `env`."""
    max_turns = env.config.max_turns
    plan = _plan(task, rng, config, max_turns, families)
    messages = [{"role": "user", "content": env.reset(task)}]
    any_hint = False

    def play(guess: Guess | None, tool: str) -> StepResult:
        nonlocal any_hint
        code = None if guess is None else guess_code(guess)
        names = _hint_names(env, code, tool, rng, config) if plan.hinted else []
        if names:
            messages.append({"role": HINT_ROLE, "content": env.hint(names)})
            any_hint = True
        # A hinted requirement is followed, except with probability p_ignore_hint.
        followed = names
        if config.p_ignore_hint > 0:
            followed = [n for n in names if rng.random() >= config.p_ignore_hint]
        think_text = guess[0] if plan.think and guess is not None else None
        write = lambda names: format_turn(  # noqa: E731
            code, tool, fence="fence" in names, tool_json="tool_json" in names, think=think_text
        )
        message = {"role": "assistant", "content": write(followed)}
        if plan.forced:
            probe = write([])
            names = [
                r.name
                for r in env.requirements
                if r.name in config.forced_requirements and r.applies(probe)
            ]
            if names:
                message["content"] = write(names)
                # Where the turn without each forced requirement would differ from this one.
                message["no_loss_chars"] = sorted(
                    {
                        len(os.path.commonprefix([message["content"], write(set(names) - {m})]))
                        for m in names
                    }
                )
        text = message["content"]
        messages.append(message)
        res = env.step(text)
        if not res.done:
            messages.append({"role": "tool", "content": res.observation})
        return res

    final = plan.final
    if not plan.multi:
        res = play(final, "submit")
    else:
        res = play(plan.first, "run_tests")
        if res.info.get("passed") == len(task.visible):
            res = play(None, "submit")
        elif max_turns >= 3 and _fits(final, task.visible) and rng.random() < config.p_retest:
            res = play(final, "run_tests")
            res = play(None, "submit")
        else:
            res = play(final, "submit")
    if not res.done:
        raise AssertionError("expert transcript did not end with a submission")
    return Transcript(
        task.task_id, messages, res.rewards, final == plan.truth, any_hint, env.summary().to_dict()
    )


def _hint_names(
    env: CodingEnv, code: str | None, tool: str, rng: random.Random, config: TranscriptConfig
) -> list[str]:
    """Requirements hinted (and so followed) in one turn of a hinted transcript."""
    probe = format_turn(code, tool)
    applicable = [r.name for r in env.requirements if r.applies(probe)]
    names = [n for n in applicable if rng.random() < config.p_hint_requirement]
    if applicable and not names:
        names = [rng.choice(applicable)]
    return names


def make_transcripts(
    tasks: Sequence[Task],
    seed: int = 0,
    config: TranscriptConfig = TranscriptConfig(),
    env_config: CodingEnvConfig = CodingEnvConfig(executor="trusted"),
    families: Sequence[str] | None = None,
) -> list[Transcript]:
    """One transcript per task, deterministic in (tasks, seed, config, env_config, families)."""
    rng = random.Random(f"tg_jax.envs.transcripts:{seed}")
    env = CodingEnv(env_config)
    return [make_transcript(t, rng, config, env, families) for t in tasks]


def replay(task: Task, messages: Sequence[dict[str, str]], env: CodingEnv) -> list[StepResult]:
    """Feeds a transcript's assistant turns through `env` (hints are not the env's business).

    Returns:
      The StepResult of every assistant turn, in order.
    """
    if env.reset(task) != messages[0]["content"]:
        raise ValueError("transcript prompt does not match the task")
    return [env.step(m["content"]) for m in messages if m["role"] == "assistant"]
