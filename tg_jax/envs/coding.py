"""The embedded agentic coding environment (docs/design.md section 3).

Episode: the user message shows 3 examples of a hidden f; each assistant turn writes Python
defining f and calls a tool (see protocol.py). `run_tests` executes the code for real in the
sandbox on the visible examples and answers e.g. "2/3 passed; f(4)=8 expected 9";
`submit` runs the hidden tests and ends the episode. The episode also ends, with task
reward 0, when `max_turns` assistant turns have been taken without a submit.

Every run_tests/submit is exactly one sandboxed subprocess with all tests in it.

Rewards (all keys on every step; 0.0 except on the final step):
  "task": 1.0 iff every hidden test passes ("all_pass"), or the passing share ("fraction").
  one key per requirement: the share of applicable turns meeting it ("fraction"), or 1.0 iff
    all do ("all"); 0.0 when no turn was applicable. A turn meets none unless it is a valid
    action (`CodingEnv.valid_action`: its call parses and the code it runs parses and defines
    f, tg_jax.envs.code_check): a tool call or fence around junk earns nothing.
"""

from __future__ import annotations

import ast
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from tg_jax.config_schema import Section
from tg_jax.envs import code_check, ns_sandbox, plugins
from tg_jax.envs.base import (
    REQUIREMENT_REWARD_MODES,
    Environment,
    EpisodeSummary,
    StepResult,
)
from tg_jax.envs.protocol import REQUIREMENT_NAMES, make_requirement, parse_turn
from tg_jax.envs.sandbox import BACKENDS, run_python
from tg_jax.envs.tasks import Task
from tg_jax.text.tool_formats import HERMES, ToolFormat

_AST_LOCK = code_check.AST_LOCK  # one thread at a time builds an AST (see there)


def literal(text: str) -> Any:
    """`ast.literal_eval(text)`, one thread at a time (`_AST_LOCK`)."""
    with _AST_LOCK:
        return ast.literal_eval(text)


TASK_REWARD_MODES = ("all_pass", "fraction")
EXECUTORS = ("sandbox", "trusted")
MAX_OBSERVATION_CHARS = 60

# Test harness, run inside the sandbox (and, for trusted code only, in-process). It evaluates
# f on the inputs and returns normalised outputs; expected outputs never enter the child, so
# code cannot read them back. User prints are discarded so they cannot flood the result.
_HARNESS_LIB = r"""
def _norm(v):
    if type(v) is int:
        s = str(v)
    elif type(v) is float and v == v and abs(v) != float("inf") and v == int(v):
        s = str(int(v))
    else:
        s = repr(v)
    return s if len(s) <= 12 else s[:12] + ".."

def _short(e):
    if isinstance(e, SyntaxError):
        return "SyntaxError line %s" % e.lineno
    msg = str(e).split("\n")[0]
    return type(e).__name__ + (": " + msg if msg else "")

def _main(src, xs):
    ns = {"__name__": "solution"}
    try:
        exec(compile(src, "solution.py", "exec"), ns)
    except BaseException as e:
        return None, _short(e)
    f = ns.get("f")
    if not callable(f):
        return None, "f is not defined"
    out = []
    for x in xs:
        try:
            out.append(_norm(f(x)))
        except BaseException as e:
            out.append("!" + type(e).__name__)
    return out, None
"""

_HARNESS_RUN = r"""
import sys
class _Sink:
    def write(self, s):
        return len(s)
    def flush(self):
        pass
_real, sys.stdout = sys.stdout, _Sink()
_res = _main(SRC, XS)
sys.stdout = _real
print("@@R " + repr(_res))
"""

_MARK = "@@R "


@dataclasses.dataclass(frozen=True)
class ExecOutcome:
    """Result of running candidate code on some inputs.

    Attributes:
      values: normalised str(f(x)) per input ("!Name" if f raised), None if f never ran.
      error: short error text when f never ran ("SyntaxError line 1", "timeout", ...).
    """

    values: tuple[str, ...] | None
    error: str | None


def run_candidate(
    code: str,
    xs: Sequence[int],
    *,
    timeout_s: float = 1.0,
    cpu_s: int = 1,
    memory_mb: int = 256,
    sandbox: str = "audit",
) -> ExecOutcome:
    """Runs `code` and evaluates f on `xs` in one sandboxed subprocess (`sandbox`: the
    tg_jax.envs.sandbox backend, "audit" or "namespace")."""
    script = f"{_HARNESS_LIB}\nSRC = {code!r}\nXS = {list(xs)!r}\n{_HARNESS_RUN}"
    res = run_python(
        script,
        timeout_s=timeout_s,
        cpu_s=cpu_s,
        memory_mb=memory_mb,
        max_output_bytes=4096,
        backend=sandbox,
    )
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(_MARK)]
    if res.status == "ok" and lines:
        try:
            values, error = literal(lines[-1][len(_MARK) :])
            if values is not None:
                values = tuple(str(v) for v in values)
                if len(values) == len(xs):
                    return ExecOutcome(values, None)
            elif isinstance(error, str):
                return ExecOutcome(None, error)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
        return ExecOutcome(None, "no result")
    reason = {
        "timeout": "timeout",
        "memory": "memory limit",
        "output_limit": "too much output",
        "killed": "crashed",
    }.get(res.status, "no result")
    return ExecOutcome(None, reason)


_TRUSTED_NS: dict = {}
_TRUSTED_LOCK = threading.Lock()  # the harness is defined once, by one thread


def run_trusted(code: str, xs: Sequence[int]) -> ExecOutcome:
    """Same semantics as run_candidate, in-process. Only for code this package wrote itself
    (expert transcripts); never for model outputs."""
    with _TRUSTED_LOCK:
        if "_main" not in _TRUSTED_NS:
            exec(_HARNESS_LIB, _TRUSTED_NS)
        main = _TRUSTED_NS["_main"]
    values, error = main(code, list(xs))
    return ExecOutcome(None if values is None else tuple(values), error)


def _clip(text: str) -> str:
    return text if len(text) <= MAX_OBSERVATION_CHARS else text[: MAX_OBSERVATION_CHARS - 2] + ".."


def format_test_result(outcome: ExecOutcome, pairs: Sequence[tuple[int, int]]) -> tuple[str, int]:
    """Observation for a test run and the number passed, e.g. ("2/3 passed; f(4)=8 expected 9", 2).

    The first failing input is named; errors read "error: ...". At most 60 chars.
    """
    if outcome.values is None:
        return _clip(f"error: {outcome.error}"), 0
    n = len(pairs)
    passed = sum(v == str(y) for v, (_, y) in zip(outcome.values, pairs, strict=True))
    if passed == n:
        return f"{n}/{n} passed", passed
    v, (x, y) = next((v, p) for v, p in zip(outcome.values, pairs, strict=True) if v != str(p[1]))
    detail = f"f({x}) raised {v[1:]}" if v.startswith("!") else f"f({x})={v} expected {y}"
    return _clip(f"{passed}/{n} passed; {detail}"), passed


def _tool(name: str, description: str) -> dict[str, Any]:
    params = {"type": "object", "properties": {}, "required": []}
    fn = {"name": name, "description": description, "parameters": params}
    return {"type": "function", "function": fn}


# The tools as JSON schemas (the code goes in the turn's ```python block, not in an argument).
TOOL_SCHEMAS = (
    _tool("run_tests", "Run the code of this turn on the visible examples."),
    _tool("submit", "Submit the code (of this turn, else the last one) to the hidden tests."),
)


@dataclasses.dataclass(frozen=True)
class CodingEnvConfig(Section):
    """The coding environment: the `env` section of a run config (`env.kind` = "coding" picks
    it, tg_jax.envs.make_env).

    Attributes:
      requirements: requirements the policy is judged on and TG teaches: names from
        ("fence", "tool_json") and plug-ins ("module:attribute", tg_jax.envs.plugins).
      max_turns: assistant turns before the episode ends without a submission.
      task_reward: "all_pass" (1.0 iff all hidden tests pass) or "fraction".
      requirement_reward: "fraction" of applicable turns meeting it, or "all".
      requirement_weight: weight of each requirement reward in `weighted_total`.
      executor: "sandbox" (subprocess, for model outputs) or "trusted" (in-process, only for
        code written by this package, e.g. expert transcripts; same observations).
      timeout_s, cpu_s, memory_mb: sandbox limits per tool call (wall-clock s, CPU s, MiB of
        address space).
      sandbox: "namespace" (kernel namespaces as an unprivileged uid, the audit hook inside,
        tg_jax.envs.ns_sandbox) or "audit" (the audit hook alone: as root the child runs as
        root); see tg_jax.envs.sandbox.run_python and docs/sandbox.md for what each costs.
      tools_in_prompt: describe the tools through the chat template's `tools` argument
        (`TOOL_SCHEMAS`), as the model's format describes them; False: the task prompt alone.
    """

    section: ClassVar[str] = "env"
    ignored: ClassVar[tuple[str, ...]] = ("kind",)  # the factory's (tg_jax.envs.make_env)

    requirements: tuple[str, ...] = REQUIREMENT_NAMES
    max_turns: int = 3
    task_reward: str = "all_pass"
    requirement_reward: str = "fraction"
    requirement_weight: float = 1.0
    executor: str = "sandbox"
    timeout_s: float = 1.0
    cpu_s: int = 1
    memory_mb: int = 256
    sandbox: str = "namespace"
    tools_in_prompt: bool = False

    def __post_init__(self):
        if not set(plugins.builtin_names(self.requirements)) <= set(REQUIREMENT_NAMES):
            raise ValueError(
                f"requirements must be names from {REQUIREMENT_NAMES} or plug-ins "
                f"('module:attribute', tg_jax.envs.plugins), got {self.requirements}"
            )
        if self.max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        if self.task_reward not in TASK_REWARD_MODES:
            raise ValueError(f"task_reward must be one of {TASK_REWARD_MODES}")
        if self.requirement_reward not in REQUIREMENT_REWARD_MODES:
            raise ValueError(f"requirement_reward must be one of {REQUIREMENT_REWARD_MODES}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}")
        if self.sandbox not in BACKENDS:
            raise ValueError(f"sandbox must be one of {BACKENDS}")


class CodingEnv(Environment):
    """Hidden-function coding tasks with run_tests / submit tools and format requirements."""

    def __init__(
        self, config: CodingEnvConfig = CodingEnvConfig(), tool_format: ToolFormat = HERMES
    ):
        """Args: tool_format: the model's tool-call format (its chat template's)."""
        self.config = config
        self.tool_format = tool_format
        self.tool_schemas = TOOL_SCHEMAS if config.tools_in_prompt else None
        self.requirements = plugins.requirements(
            config.requirements,
            config.requirement_weight,
            config,
            lambda names: [
                make_requirement(n, config.requirement_weight, tool_format) for n in names
            ],
        )
        self._execute: Callable[[str, Sequence[int]], ExecOutcome]
        if config.executor == "trusted":
            self._execute = run_trusted
        else:
            if config.sandbox == "namespace":  # fail here, not at the first tool call
                try:
                    ns_sandbox.check_available()
                except ns_sandbox.SandboxUnavailable as e:
                    hint = "; env.sandbox='audit' runs the tool calls under the audit hook alone"
                    raise ns_sandbox.SandboxUnavailable(f"{e}{hint}") from e
            self._execute = lambda code, xs: run_candidate(
                code,
                xs,
                timeout_s=config.timeout_s,
                cpu_s=config.cpu_s,
                memory_mb=config.memory_mb,
                sandbox=config.sandbox,
            )
        self._task: Task | None = None
        self._done = True

    def reset(self, task: Task | dict) -> str:
        """Starts an episode on `task` (a Task or its record); returns the prompt."""
        self._task = task if isinstance(task, Task) else Task.from_record(task)
        self._done = False
        self._last_code: str | None = None
        self._summary = EpisodeSummary(
            verdicts={r.name: [] for r in self.requirements},
            actions={"run_tests": 0, "submit": 0, "malformed": 0},
        )
        return self._task.prompt

    def summary(self) -> EpisodeSummary:
        return self._summary

    def valid_action(self, turn_text: str) -> bool:
        """The turn calls a tool and the code it runs (its own, or for a submit without code
        the last code written) parses, defines f and reads no unbound name
        (`code_check.problem`)."""
        parsed = parse_turn(turn_text, self.tool_format)
        if parsed.tool is None:
            return False
        code = parsed.code or (self._last_code if parsed.tool == "submit" else None)
        return code_check.problem(code or "") is None

    def step(self, assistant_message: str) -> StepResult:
        """One assistant turn. Malformed turns get an "error: ..." observation, not a raise.

        Raises:
          RuntimeError: if called before reset or after the episode ended.
        """
        task, summ = self._task, self._summary
        assistant_message, verdicts = self.begin_turn(assistant_message, summ, done=self._done)
        parsed = parse_turn(assistant_message, self.tool_format)
        info = {"turn": summ.turns, "action": parsed.tool, "error": None, "verdicts": verdicts}
        task_reward, done, obs = 0.0, False, None

        if parsed.error is not None:
            obs = parsed.error
        elif parsed.tool == "run_tests" and not parsed.code:
            obs = "error: no code to test"
        elif parsed.tool == "submit" and not (parsed.code or self._last_code):
            obs = "error: no code to submit"
        if parsed.error is not None or obs is not None:
            # Nothing was executed: the turn is malformed (begin_turn rejected it).
            summ.actions["malformed"] += 1
            info["error"] = obs
        elif parsed.tool == "run_tests":
            self._last_code = parsed.code
            summ.actions["run_tests"] += 1
            outcome = self._execute(parsed.code, [x for x, _ in task.visible])
            obs, info["passed"] = format_test_result(outcome, task.visible)
            info["tool_error"] = outcome.error
        else:
            code = parsed.code or self._last_code
            self._last_code = code
            summ.actions["submit"] += 1
            outcome = self._execute(code, [x for x, _ in task.hidden])
            _, passed = format_test_result(outcome, task.hidden)
            info["tool_error"] = outcome.error
            n = len(task.hidden)
            info["hidden_passed"] = passed
            obs = f"{passed}/{n} hidden tests passed"
            if self.config.task_reward == "all_pass":
                task_reward = float(passed == n)
            else:
                task_reward = passed / n
            done, summ.end_reason = True, "submit"
        if not done and summ.turns >= self.config.max_turns:
            done, summ.end_reason = True, "max_turns"
        info["tool_output"] = obs

        if done:
            self._done = True
            rewards = {"task": task_reward}
            for r in self.requirements:
                rewards[r.name] = summ.requirement_reward(
                    r.name, self.config.requirement_reward, r.conditional
                )
            info["summary"] = summ.to_dict()
        else:
            rewards = dict.fromkeys(self.reward_keys, 0.0)
        return StepResult(None if done else obs, done, rewards, info)


def coding_env_config(cfg: Any, executor: str | None = None) -> CodingEnvConfig:
    """CodingEnvConfig from `config.env` (optionally with another executor)."""
    env = CodingEnvConfig.from_config(cfg)
    return env if executor is None else dataclasses.replace(env, executor=executor)
