"""A team's own requirements and environment, outside tg_jax (`tg_jax.envs.plugins`).

Named on the command line as a user names theirs, e.g.

    python -m tg_jax.main --config=configs/tiny.py --config.stage=pipeline \\
      --config.env.requirements='("fence", "tests.plugin_example:no_shouting")'
    python -m tg_jax.main ... --config.env.kind=tests.plugin_example:WordEnv \\
      --config.env.requirements='("tests.plugin_example:short_turns",)'

The bad ones below exist for the tests of clear errors.
"""

from __future__ import annotations

import random
import re
import time
from typing import Any

from tg_jax.envs import Environment, Requirement, judge, plugins
from tg_jax.envs.base import EpisodeSummary, StepResult

# A requirement object: no word of five or more capitals ("CALL" is the legacy tool line).
no_shouting = Requirement(
    "no_shouting",
    check=lambda turn: re.search(r"\b[A-Z]{5,}\b", turn) is None,
    hint="Reminder: do not write words in capital letters.",
)


def short_turns(env_config: Any) -> Requirement:
    """A factory of the environment's config: turns of at most 40 characters."""
    del env_config
    return Requirement(
        "short_turns", check=lambda turn: len(turn) <= 40, hint="Reminder: answer in 40 characters."
    )


# A judged requirement (the protocol's tier of norms that need judgment): its verdicts come
# from a judge called on batches of turns, here a scripted one that errs at declared rates
# (a checkpoint would be `tg_jax.engine.judge.ModelJudge(model_dir, rubric)`). Made once, at
# module level: one judge, one cache for every environment of the run.
judged_brief = judge.judged_requirement(
    "judged_brief",
    judge.ScriptedJudge(
        lambda turn: len(turn.split()) <= 6,
        name="judged_brief",
        false_positive=0.1,
        false_negative=0.1,
    ),  # fmt: skip
    hint="Reminder: answer in six words or fewer.",
)


def _boom(turn: str) -> bool:
    raise RuntimeError(f"checker bug on a turn of {len(turn)} characters")


def _slow(turn: str) -> bool:
    time.sleep(8.0)  # far past its 0.2 s timeout, even on a loaded machine
    return True


raises = Requirement("raises", check=_boom, hint="Reminder: never judged.")
slow = Requirement("slow", check=_slow, hint="Reminder: judged too late.", timeout_s=0.2)
not_a_requirement = 42


def factory_of_a_string(env_config: Any) -> str:
    return "fence"


def factory_that_raises(env_config: Any) -> Requirement:
    raise KeyError("report_style")


def judged_by_a_missing_checkpoint(env_config: Any) -> Requirement:
    """A judged requirement whose judge is a checkpoint directory that is not there."""
    from tg_jax.engine.judge import ModelJudge

    polite = ModelJudge("/nonexistent/judge_checkpoint", "Is the reply polite?")
    return judge.judged_requirement("polite", polite, hint="Reminder: be polite.")


class NotAnEnvironment:
    pass


class WordEnv(Environment):
    """Say the task's word, then the episode ends: task reward 1 iff the turn contains it.

    Built as `WordEnv(config.env, tool_format=fmt)`; its requirements are
    `config.env.requirements` (plug-ins only: it has no built-in ones).
    """

    WORDS = ("apple", "river", "stone", "cloud", "maple", "ember", "frost", "lemon")

    def __init__(self, env_config: Any, tool_format: Any = None):
        del tool_format  # no tool calls in this environment
        self.requirements = plugins.requirements(
            env_config.requirements, float(env_config.requirement_weight), env_config,
            builtin=_no_builtins,
        )  # fmt: skip
        self._done, self._word = True, ""
        self._summary = self._fresh_summary()

    @classmethod
    def generate_tasks(cls, split: str, num: int, seed: int):
        rng = random.Random(f"{split}-{seed}")
        for i in range(num):
            yield {"task_id": f"word-{split}-{i}", "word": rng.choice(cls.WORDS)}

    def _fresh_summary(self) -> EpisodeSummary:
        return EpisodeSummary(verdicts={r.name: [] for r in self.requirements}, actions={})

    def reset(self, task: dict) -> str:
        self._word, self._done = str(task["word"]), False
        self._summary = self._fresh_summary()
        return f"Say the word {self._word}."

    def step(self, assistant_message: str) -> StepResult:
        text, verdicts = self.begin_turn(assistant_message, self._summary, done=self._done)
        self._done = True
        self._summary.end_reason = "submit"
        rewards = {"task": float(self._word in text)}
        rewards.update(
            {r.name: self._summary.requirement_reward(r.name) for r in self.requirements}
        )
        return StepResult(None, True, rewards, {"verdicts": verdicts})

    def summary(self) -> EpisodeSummary:
        return self._summary


def _no_builtins(names: list[str]) -> list[Requirement]:
    if names:
        raise ValueError(f"WordEnv has no built-in requirements, got {names}")
    return []


class FileOnlyEnv(WordEnv):
    """WordEnv whose tasks come from task files only: no generator (so no dev tasks)."""

    generate_tasks = None
