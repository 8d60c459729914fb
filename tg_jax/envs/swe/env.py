"""The agentic software-engineering environment: a repository, file tools, real tests.

Episode: the user message is the task's instruction, file list, visible test command and the
tools (tg_jax.envs.swe.tools). Every assistant turn calls one tool; the observation is the
tool's output ("tool" message), cut to `max_observation_chars` with a note. `run_tests` runs
the visible test command on a temporary copy of the current repository through the configured
test runner (tg_jax.envs.swe.runner: the seam where another sandbox plugs in); `submit` copies
the repository, adds the hidden test files, runs the hidden command and ends the episode.

The episode also ends, with task reward 0, after `max_turns` turns, when the assistant turns
add up to more than `max_tokens` (estimated: words and punctuation marks, since the
environment sees text, not the policy's tokens) or when `max_wall_s` have passed since reset.

Rewards (every key on every step, 0.0 except on the final step):
  "task": 1.0 iff every target hidden test passes ("all_pass"), or the passing share
    ("fraction"); the targets are the task's fail_to_pass + pass_to_pass ids, or every test
    the hidden run reports when the task names none.
  one key per requirement (tg_jax.envs.swe.requirements), as in CodingEnv.

A malformed or unknown tool call gets an "error: ..." observation and counts as a "malformed"
action; a well-formed call that fails (a missing file, an old text that is not unique) is a
"tool_error" action. Neither ever raises, and neither is a valid action (`SweEnv.valid_action`):
the requirements such a turn meets earn no reward and count as failed.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
import time
from typing import Any, ClassVar

from tg_jax.config_schema import Section
from tg_jax.envs import plugins
from tg_jax.envs.base import (
    REQUIREMENT_REWARD_MODES,
    Environment,
    EpisodeSummary,
    StepResult,
)
from tg_jax.envs.swe import requirements as reqs
from tg_jax.envs.swe.runner import RUNNERS, Runner, TestRun, make_runner
from tg_jax.envs.swe.task import SweTask
from tg_jax.envs.swe.tools import (
    EDIT_TOOLS,
    TOOL_SCHEMAS,
    TOOLS,
    ToolCall,
    Workspace,
    file_tool,
    parse_call,
    truncate,
)
from tg_jax.text.tool_formats import HERMES, ToolFormat

TASK_REWARD_MODES = ("all_pass", "fraction")
_TOKEN = re.compile(r"\w+|[^\w\s]")
# Counted per episode (EpisodeSummary.actions). Side effects: "overwrite" (a whole file
# replaced), "stopped_after_ask" (asked the user, then no edit), "asked_when_approved" (asked
# on a task whose instruction says the change is approved, `SweTask.approved`),
# "stopped_after_explain" (a turn explained a change without making it, and no edit followed).
ACTIONS = (
    *TOOLS,
    "malformed",
    "tool_error",
    "overwrite",
    "stopped_after_ask",
    "asked_when_approved",
    "stopped_after_explain",
)


@dataclasses.dataclass(frozen=True)
class SweEnvConfig(Section):
    """The software-engineering environment: the `env` section of a run config when
    `env.kind` = "swe" (tg_jax.envs.make_env).

    Attributes:
      requirements: enabled requirements: names from requirements.KNOWN_NAMES (tier 1 tool
        protocol and Markdown report, tier 2 names the changed files, tier 3 asks before
        overwriting a file unless the task is approved, and the optional "explain_change":
        each edit explained in its turn) and plug-ins ("module:attribute",
        tg_jax.envs.plugins). The default is requirements.REQUIREMENT_NAMES.
      max_turns: assistant turns before the episode ends without a submission.
      max_tokens: estimated assistant tokens per episode before it ends (0 = no limit).
      max_wall_s: wall-clock seconds per episode (0 = no limit).
      task_reward: "all_pass" or "fraction" of the target hidden tests.
      requirement_reward: "fraction" of applicable turns meeting it, or "all".
      requirement_weight: weight of each requirement reward in `weighted_total`.
      runner: test runner name (runner.RUNNERS): "sandbox" = a light pytest-compatible runner
        in the audit-hook sandbox (no fixtures, no subprocesses); "namespace" = the real pytest
        in the kernel-enforced sandbox (imported tasks that need fixtures or spawn processes).
      timeout_s, cpu_s, memory_mb: limits of one test run.
      max_observation_chars: tool output beyond this is cut, with a note.
      ask_reply: what ask_user answers.
      tools_in_prompt: describe the tools through the chat template's `tools` argument
        (tools.TOOL_SCHEMAS), as the model's format describes them.
    """

    section: ClassVar[str] = "env"
    ignored: ClassVar[tuple[str, ...]] = ("kind",)  # the factory's (tg_jax.envs.make_env)

    requirements: tuple[str, ...] = reqs.REQUIREMENT_NAMES
    max_turns: int = 12
    max_tokens: int = 0
    max_wall_s: float = 0.0
    task_reward: str = "all_pass"
    requirement_reward: str = "fraction"
    requirement_weight: float = 1.0
    runner: str = "sandbox"
    timeout_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512
    max_observation_chars: int = 2000
    ask_reply: str = "Yes, go ahead."
    tools_in_prompt: bool = False

    def __post_init__(self):
        if not set(plugins.builtin_names(self.requirements)) <= set(reqs.KNOWN_NAMES):
            raise ValueError(
                f"requirements must be names from {reqs.KNOWN_NAMES} or plug-ins "
                f"('module:attribute', tg_jax.envs.plugins), got {self.requirements}"
            )
        if self.max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        if self.task_reward not in TASK_REWARD_MODES:
            raise ValueError(f"task_reward must be one of {TASK_REWARD_MODES}")
        if self.requirement_reward not in REQUIREMENT_REWARD_MODES:
            raise ValueError(f"requirement_reward must be one of {REQUIREMENT_REWARD_MODES}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {sorted(RUNNERS)}, got {self.runner!r}")


def run_in_copy(runner: Runner, files: dict[str, str], command: str, timeout_s: float) -> TestRun:
    """Writes `files` into a fresh temporary directory and runs `command` there."""
    root = tempfile.mkdtemp(prefix="tg_swe_")
    try:
        for path, text in files.items():
            full = os.path.join(root, path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w", encoding="utf-8") as f:
                f.write(text)
        return runner(root, command, timeout_s)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def hidden_score(task: SweTask, run: TestRun) -> tuple[int, int]:
    """(target tests passed, target tests) of a hidden run."""
    targets = (*task.fail_to_pass, *task.pass_to_pass) or tuple(run.outcomes)
    return sum(run.outcomes.get(t) == "passed" for t in targets), len(targets)


class SweEnv(Environment):
    """Repository tasks with file tools, real test runs and the SWE requirements."""

    def __init__(
        self,
        config: SweEnvConfig = SweEnvConfig(),
        runner: Runner | None = None,
        tool_format: ToolFormat = HERMES,
    ):
        """Args: runner: runs the tests (default: config.runner's); tool_format: the model's
        tool-call format (its chat template's)."""
        self.config = config
        self.tool_format = tool_format
        self.tool_schemas = TOOL_SCHEMAS if config.tools_in_prompt else None
        self.runner = runner or make_runner(
            config.runner, cpu_s=config.cpu_s, memory_mb=config.memory_mb
        )
        self.requirements = plugins.requirements(
            config.requirements,
            config.requirement_weight,
            config,
            lambda names: reqs.make_requirements(names, config.requirement_weight, self),
        )
        self._done = True
        self._task: SweTask | None = None
        self.workspace = Workspace({})
        self.questions: list[str] = []

    def reset(self, task: SweTask | dict) -> str:
        """Starts an episode on `task` (a SweTask or its record); returns the prompt."""
        self._task = task if isinstance(task, SweTask) else SweTask.from_record(task)
        self._done = False
        self.workspace = Workspace(self._task.files)
        self.questions = []
        self._tokens, self._start = 0, time.monotonic()
        self._edited_after_ask: bool | None = None
        self._edited_after_explain: bool | None = None
        self._summary = EpisodeSummary(
            verdicts={r.name: [] for r in self.requirements}, actions=dict.fromkeys(ACTIONS, 0)
        )
        return self._task.prompt

    def summary(self) -> EpisodeSummary:
        return self._summary

    @property
    def approved(self) -> bool:
        """The running task's instruction says the change is already approved."""
        return self._task is not None and self._task.approved

    def valid_action(self, turn_text: str) -> bool:
        """The turn is one well-formed call of a known tool that does not fail: a file it
        reads exists, an edit applies (tried on a copy of the workspace)."""
        call = parse_call(turn_text, self.tool_format)
        if call.error is not None:
            return False
        out = file_tool(Workspace(self.workspace.files), call)
        return out is None or not out.startswith("error")

    def _run_tool(self, call: ToolCall, info: dict[str, Any]) -> tuple[str, bool, float]:
        """(observation, done, task reward) of a well-formed call."""
        ws, cfg = self.workspace, self.config
        if call.name == "list_files":
            return ws.list_files(), False, 0.0
        if call.name == "read_file":
            return file_tool(ws, call), False, 0.0
        if call.name == "ask_user":
            self.questions.append(call.args["question"])
            if self.approved:
                self._summary.actions["asked_when_approved"] += 1
            if self._edited_after_ask is None:
                self._edited_after_ask = False
            return cfg.ask_reply, False, 0.0
        if call.name in EDIT_TOOLS:
            if ws.overwrites(call):
                self._summary.actions["overwrite"] += 1
            obs = file_tool(ws, call)
            if not obs.startswith("error"):
                if self._edited_after_ask is False:
                    self._edited_after_ask = True
                if self._edited_after_explain is False:
                    self._edited_after_explain = True
            return obs, False, 0.0
        if call.name == "run_tests":
            run = run_in_copy(self.runner, ws.files, self._task.test_command, cfg.timeout_s)
            info.update(passed=run.passed, tests=len(run.outcomes), test_wall_s=run.wall_s)
            return run.output, False, 0.0
        files = {**ws.files, **self._task.hidden_tests}
        run = run_in_copy(self.runner, files, self._task.hidden_command, cfg.timeout_s)
        passed, n = hidden_score(self._task, run)
        info["hidden_passed"], info["hidden_total"] = passed, n
        if cfg.task_reward == "all_pass":
            reward = float(n > 0 and passed == n)
        else:
            reward = passed / n if n else 0.0
        return f"submitted; {passed}/{n} hidden tests passed", True, reward

    def step(self, assistant_message: str) -> StepResult:
        """One assistant turn. Malformed turns get an "error: ..." observation, not a raise.

        Raises:
          RuntimeError: if called before reset or after the episode ended.
        """
        summ, cfg = self._summary, self.config
        assistant_message, verdicts = self.begin_turn(assistant_message, summ, done=self._done)
        call = parse_call(assistant_message, self.tool_format)
        info: dict[str, Any] = {"turn": summ.turns, "action": call.name, "error": call.error}
        info["verdicts"] = verdicts
        task_reward, done = 0.0, False
        if call.error is not None:  # begin_turn rejected it
            summ.actions["malformed"] += 1
            obs = call.error
        else:
            summ.actions[call.name] += 1
            obs, done, task_reward = self._run_tool(call, info)
            explained = call.name not in (*EDIT_TOOLS, "submit") and reqs.explains(call.text)
            if explained and self._edited_after_explain is None:
                self._edited_after_explain = False
            if obs.startswith("error"):
                summ.actions["tool_error"] += 1
                info["error"] = obs
        if done:
            summ.end_reason = "submit"
        self._tokens += len(_TOKEN.findall(assistant_message))
        if not done:
            done, summ.end_reason = self._limit_reached()
        info["tool_output"] = obs
        if not done:
            return StepResult(
                truncate(obs, cfg.max_observation_chars),
                False,
                dict.fromkeys(self.reward_keys, 0.0),
                info,
            )
        self._done = True
        summ.actions["stopped_after_ask"] = int(self._edited_after_ask is False)
        summ.actions["stopped_after_explain"] = int(self._edited_after_explain is False)
        rewards = {"task": task_reward}
        for r in self.requirements:
            rewards[r.name] = summ.requirement_reward(r.name, cfg.requirement_reward, r.conditional)
        info["summary"] = summ.to_dict()
        info["changed_files"] = self.workspace.changed()
        return StepResult(None, True, rewards, info)

    def _limit_reached(self) -> tuple[bool, str]:
        cfg, summ = self.config, self._summary
        if summ.turns >= cfg.max_turns:
            return True, "max_turns"
        if cfg.max_tokens and self._tokens > cfg.max_tokens:
            return True, "max_tokens"
        if cfg.max_wall_s and time.monotonic() - self._start > cfg.max_wall_s:
            return True, "max_wall_s"
        return False, ""


def swe_env_config(cfg: Any) -> SweEnvConfig:
    """SweEnvConfig from `config.env`."""
    return SweEnvConfig.from_config(cfg)
