"""No requirement reward for junk: a requirement is met only on a turn that is
a valid action of its environment (`Environment.valid_action`).

Junk episodes (no code, code that does not parse, a NameError, a function of another name,
fenced junk, an edit that does not apply) are played through each environment with the format
met (`Environment.judge` says so, so these tests fail where junk is paid): every requirement
reward is 0, the turns are rejected and count as failed (compliance, TG gate). A valid turn,
even a wrong one, still earns the reward.
"""

import dataclasses
import os
import re

import pytest

from tests.plugin_example import WordEnv
from tg_jax.config_files import load_config_file
from tg_jax.config_lib import env_config
from tg_jax.envs import code_check, env_factory
from tg_jax.envs.base import EpisodeSummary
from tg_jax.envs.coding import CodingEnv, coding_env_config
from tg_jax.envs.protocol import format_turn
from tg_jax.envs.swe import requirements as swe_reqs
from tg_jax.envs.swe.env import SweEnv, SweEnvConfig
from tg_jax.envs.swe.runner import TestRun
from tg_jax.envs.swe.task import SweTask
from tg_jax.envs.swe.tools import format_call
from tg_jax.envs.tasks import make_task
from tg_jax.sampling.episode import episode_compliance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = make_task("t", "lin", (2, 3), (0, 1, 4), (-2, 5, 7))  # f(x) = 2x + 3
RIGHT, WRONG = "def f(x): return 2*x+3", "def f(x): return 0"

JUNK_CODE = {
    "load-time NameError": "a",
    "unparsable": "x = ",
    "no function": "pass",
    "wrong function name": "def g(x): return 2*x+3",
    "call-time NameError": "def f(x): return 2*x+b",
    "NameError after f": "def f(x): return 2*x+3\nprint(y)",
    "f not a function": "f = 0",
}


@pytest.mark.parametrize("code, reason", [
    ("", "no code"), ("a", "does not define f"), ("x = ", "does not parse"),
    ("pass", "does not define f"), ("def g(x): return x", "does not define f"),
    ("f = 0", "does not define f"), ("def f(x): return y", "undefined name 'y'"),
    ("def f(x): return x\nprint(z)", "undefined name 'z'"),
    ("def f(x): return [y for y in r(x)]", "undefined name 'r'"),
    (RIGHT, None), (WRONG, None), ("f = lambda x: abs(x)+3", None), ("f = abs", None),
    ("from math import factorial as f", None),
    ("import math\ndef f(x): return math.floor(x)", None),
    ("from math import *\ndef f(x): return floor(x)", None),  # a star import may bind it
    ("def f(x):\n    return x + k\nk = 2", None), ("if True:\n    def f(x): return x", None),
])  # fmt: skip
def test_code_check_reasons(code, reason):
    assert code_check.problem(code) == reason


def _coding_env(config_name: str, **overrides) -> CodingEnv:
    """The coding environment of configs/NAME.py, running code in-process (trusted)."""
    cfg = load_config_file(os.path.join(ROOT, "configs", f"{config_name}.py"))
    return CodingEnv(dataclasses.replace(coding_env_config(cfg.env, "trusted"), **overrides))


def _play(env, task, turns):
    env.reset(task)
    res = [env.step(t) for t in turns]
    assert res[-1].done
    return res


def _assert_junk(env, turns, results):
    """Every turn met a requirement's format, yet no requirement reward is paid: the turns are
    rejected and their verdicts failed (not compliant, targeted by the TG gate)."""
    names = [r.name for r in env.requirements]
    assert any(v for t in turns for v in env.judge(t).values()), "no format met: paid nothing"
    assert results[-1].rewards == {"task": 0.0, **dict.fromkeys(names, 0.0)}
    summ = env.summary()
    assert summ.rejected == list(range(len(turns)))
    assert all(v is not True for r in results for v in r.info["verdicts"].values())
    assert not any(episode_compliance(summ.verdicts).values())
    assert any(summ.failed_turns(n) for n in names)


@pytest.mark.parametrize("config_name", ["default", "fence", "joint"])
@pytest.mark.parametrize("junk", sorted(JUNK_CODE))
def test_junk_code_earns_no_requirement_reward_in_the_coding_env(config_name, junk):
    env = _coding_env(config_name, max_turns=3)
    turns = [format_turn(JUNK_CODE[junk], "run_tests", fence=True, tool_json=True)] * 2
    turns.append(format_turn(None, "submit", fence=True, tool_json=True))  # submits the junk
    _assert_junk(env, turns, _play(env, TASK, turns))


def test_code_less_turns_earn_nothing():
    env = _coding_env("joint", max_turns=3)
    turns = [format_turn(None, t, tool_json=True) for t in ("run_tests", "submit")]
    turns.append("```python\n```\n" + turns[0])  # an empty fence around no code
    _assert_junk(env, turns, _play(env, TASK, turns))


def test_a_valid_turn_still_earns_it_wrong_or_right():
    env = _coding_env("joint", max_turns=3)
    res = _play(env, TASK, [format_turn(WRONG, "submit", fence=True, tool_json=True)])
    assert res[-1].rewards == {"task": 0.0, "fence": 1.0, "tool_json": 1.0}
    res = _play(env, TASK, [format_turn(RIGHT, "submit", fence=True, tool_json=True)])
    assert res[-1].rewards == {"task": 1.0, "fence": 1.0, "tool_json": 1.0}
    assert env.summary().rejected == []
    # Valid, junk, then a code-less submit of the junk: 1 of 3 turns earns tool_json, 1 of 2
    # the fence (it does not apply to a turn without code).
    turns = [format_turn(c, "run_tests", fence=True, tool_json=True) for c in (WRONG, "a")]
    res = _play(env, TASK, [*turns, format_turn(None, "submit", fence=True, tool_json=True)])
    assert res[-1].rewards == {"task": 0.0, "fence": 1 / 2, "tool_json": 1 / 3}
    assert env.summary().failed_turns("tool_json") == [1, 2]
    # A code-less submit of valid code written before is valid.
    turns = [format_turn(RIGHT, "run_tests", tool_json=True), format_turn(None, "submit")]
    res = _play(env, TASK, turns)
    assert res[-1].rewards == {"task": 1.0, "fence": 0.0, "tool_json": 0.5}
    assert env.summary().rejected == []


def test_fenced_junk_earns_no_fence_reward_with_either_call_syntax():
    env = _coding_env("fence", max_turns=2)
    for code in ("a", "x = ", "def g(x): return x"):
        turns = [format_turn(code, "run_tests", fence=True), format_turn(None, "submit")]
        _assert_junk(env, turns, _play(env, TASK, turns))
    turns = [format_turn(WRONG, "run_tests", fence=True), format_turn(None, "submit")]
    assert _play(env, TASK, turns)[-1].rewards == {"task": 0.0, "fence": 1.0}


# --- SWE -------------------------------------------------------------------------------------

FILES = {
    "pkg/__init__.py": "",
    "pkg/ops.py": "def add(a, b):\n    return a - b\n",
    "tests/test_ops.py": "from pkg.ops import add\n\n\ndef test_add():\n"
    "    assert add(1, 2) == 3\n",
}
SWE_TASK = SweTask.from_record({
    "task_id": "t1", "files": FILES, "instruction": "Fix add.",
    "test_command": "pytest -rA tests/test_ops.py",
    "hidden_tests": {"tests/test_hidden.py": "def test_h():\n    pass\n"},
})  # fmt: skip
REPORT = (
    "# Fix\n\nFixed add in pkg/ops.py.\n\n```diff\n--- a/pkg/ops.py\n+++ b/pkg/ops.py\n"
    "@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n```\n"
)


def _runner(repo_dir, command, timeout_s):
    """No test process: the hidden test passes iff add is fixed."""
    with open(os.path.join(repo_dir, "pkg/ops.py")) as f:
        fixed = "a + b" in f.read()
    return TestRun("ok", {"tests/test_hidden.py::test_h": "passed" if fixed else "failed"}, "")


def _swe_env(**kw) -> SweEnv:
    return SweEnv(SweEnvConfig(requirements=swe_reqs.KNOWN_NAMES, **kw), runner=_runner)


SWE_JUNK = {
    "edit that does not apply": format_call(
        "str_replace", {"path": "pkg/ops.py", "old": "a * b", "new": "a + b"}
    ),
    "edit of a missing file": format_call(
        "str_replace", {"path": "pkg/nope.py", "old": "a - b", "new": "a + b"}
    ),
    "read of a missing file": format_call("read_file", {"path": "pkg/nope.py"}),
}


@pytest.mark.parametrize("junk", sorted(SWE_JUNK))
def test_swe_turns_that_do_nothing_earn_no_requirement_reward(junk):
    env = _swe_env(max_turns=2)
    explained = "I change add in pkg/ops.py so it adds the numbers.\n" + SWE_JUNK[junk]
    turns = [explained, SWE_JUNK[junk]]
    # Before: tool_protocol 1.0 (a well-formed call), ask_first 1.0 (conditional, never applied).
    _assert_junk(env, turns, _play(env, SWE_TASK, turns))


def test_swe_valid_turns_still_earn_it():
    env = _swe_env(max_turns=4)
    edit = format_call("str_replace", {"path": "pkg/ops.py", "old": "a - b", "new": "a + b"})
    turns = ["I change add in pkg/ops.py so it adds the numbers.\n" + edit,
             REPORT + format_call("submit")]  # fmt: skip
    res = _play(env, SWE_TASK, turns)
    assert res[-1].rewards == {
        "task": 1.0, "tool_protocol": 1.0, "markdown_report": 1.0, "files_named": 1.0,
        "ask_first": 1.0, "explain_change": 1.0,
    }  # fmt: skip
    # One edit that does not apply, then the valid ones: tool_protocol 2 of 3.
    bad = format_call("str_replace", {"path": "pkg/ops.py", "old": "a * b", "new": "a + b"})
    res = _play(env, SWE_TASK, [bad, *turns])
    assert res[-1].rewards["tool_protocol"] == pytest.approx(2 / 3)
    assert env.summary().rejected == [0] and env.summary().failed_turns("tool_protocol") == [0]


# --- a plug-in environment -------------------------------------------------------------------


class WordOnlyEnv(WordEnv):
    """A plug-in environment that says what a valid action is: words of letters only."""

    def valid_action(self, turn_text: str) -> bool:
        return re.fullmatch(r"[A-Za-z]+( [A-Za-z]+)*", turn_text.strip()) is not None


def _plugin_env(cls_name):
    kind = (
        "tests.plugin_example:WordEnv"
        if cls_name == "WordEnv"
        else f"tests.test_junk_rewards:{cls_name}"
    )
    cfg = env_config(kind=kind,
                     requirements=("tests.plugin_example:short_turns",))  # fmt: skip
    return env_factory(cfg)()  # loaded by import path, as a user names theirs


@pytest.mark.parametrize("junk", ["!!!", "", "12 34", "a|b"])
def test_a_plugin_environment_says_what_a_valid_action_is(junk):
    env = _plugin_env("WordOnlyEnv")
    assert isinstance(env, WordOnlyEnv)
    _assert_junk(env, [junk], _play(env, {"word": "apple"}, [junk]))
    assert _play(env, {"word": "apple"}, ["river"])[-1].rewards == {
        "task": 0.0, "short_turns": 1.0}  # fmt: skip
    # The default accepts every turn: an environment that does not say pays the format.
    base = _plugin_env("WordEnv")
    assert _play(base, {"word": "apple"}, [junk])[-1].rewards["short_turns"] == 1.0


def test_conditional_requirements_need_a_valid_action():
    summ = EpisodeSummary({"ask": [None, None]}, {}, turns=2, rejected=[0, 1])
    assert summ.requirement_reward("ask", conditional=True) == 0.0
    summ.rejected = [0]
    assert summ.requirement_reward("ask", conditional=True) == 1.0
    assert summ.requirement_reward("ask", conditional=False) == 0.0
