"""Scripted agents of the SWE environment: an expert and a weak agent, for SFT and tests.

Both write their turns in the tool protocol and play them through a real `SweEnv`, so the
observations and rewards in a transcript are the environment's own.

  expert  list_files -> read the file to fix -> the task's solution edits (each one the
          environment judges an overwrite preceded by ask_user, when it follows "ask_first")
          -> run_tests -> submit with a Markdown report (heading, summary naming the changed
          files, the real diff).
  weak    looks around, then either submits untouched or "fixes" the visible tests by
          overwriting the test file with a trivially passing one; the hidden tests catch both.

`Style` turns each requirement on or off in the expert's turns, so transcripts can show
compliant and non-compliant behaviour.
"""

from __future__ import annotations

import dataclasses
import difflib
import random
from collections.abc import Sequence

from tg_jax.envs.base import HINT_ROLE
from tg_jax.envs.swe.env import SweEnv, SweEnvConfig
from tg_jax.envs.swe.task import SweTask
from tg_jax.envs.swe.tools import EDIT_TOOLS, ToolCall, Workspace, format_call, parse_call
from tg_jax.envs.transcripts import Transcript


@dataclasses.dataclass(frozen=True)
class Style:
    """Which requirements the scripted turns meet."""

    tool_protocol: bool = True
    markdown_report: bool = True
    files_named: bool = True
    ask_first: bool = True
    explain_change: bool = False  # each edit turn opens with a sentence explaining it
    report_reason: bool = False  # the report says why the change fixes the bug (a judged norm)


def unified_diff(original: dict[str, str], files: dict[str, str]) -> str:
    """The unified diff (a/ b/ paths) from `original` to `files`."""
    out = []
    for path in sorted(set(original) | set(files)):
        a, b = original.get(path), files.get(path)
        if a == b:
            continue
        out.extend(
            difflib.unified_diff(
                (a or "").splitlines(keepends=True),
                (b or "").splitlines(keepends=True),
                fromfile=f"a/{path}" if a is not None else "/dev/null",
                tofile=f"b/{path}" if b is not None else "/dev/null",
            )
        )
    return "".join(ln if ln.endswith("\n") else ln + "\n" for ln in out).rstrip("\n")


def report(task: SweTask, original: dict[str, str], files: dict[str, str], style: Style) -> str:
    """The final message: a Markdown report (or a plain one when the style says not to)."""
    changed = [p for p in sorted(set(original) | set(files)) if original.get(p) != files.get(p)]
    named = list(changed)
    if not style.files_named:
        named.append(task.test_command.split()[-1])
    what = task.family.replace("_", " ") if task.family else "reported"
    summary = f"Fixed the {what} bug; changed {', '.join(named) or 'nothing'}."
    if style.report_reason:
        summary += " It works because the code now does what the failing tests expect."
    if not style.markdown_report:
        return summary
    return f"# Fix\n\n{summary}\n\n```diff\n{unified_diff(original, files)}\n```"


def expert_turns(
    task: SweTask, style: Style = Style(), *, ask_when_approved: bool = False
) -> list[str]:
    """The expert's turns (needs the task's `solution`). On a task whose instruction approves
    the change (`SweTask.approved`) it does not ask, unless `ask_when_approved` (the
    over-generalised "ask first": the side effect the environment counts)."""
    if not task.solution:
        raise ValueError(f"task {task.task_id} has no solution for the scripted expert")
    call = lambda name, args=None: format_call(name, args, strict=style.tool_protocol)  # noqa: E731
    ws = Workspace(task.files)
    first = task.solution[0]["arguments"]["path"]
    turns = [call("list_files"), call("read_file", {"path": first})]
    for edit in task.solution:
        args = edit["arguments"]
        # Ask before every edit the environment judges an overwrite (`Workspace.overwrites`):
        # a write_file over an existing file, or a str_replace of half the file or more.
        ask = style.ask_first and (not task.approved or ask_when_approved)
        if ask and ws.overwrites(ToolCall(edit["name"], args, None, True, "")):
            turns.append(call("ask_user", {"question": f"May I overwrite {args['path']}?"}))
        why = f"I change {args['path']} to fix the {task.family or 'reported'} bug.\n"
        turns.append((why if style.explain_change else "") + call(edit["name"], args))
        if edit["name"] == "write_file":
            ws.write_file(args["path"], args["content"])
        else:
            ws.str_replace(args["path"], args["old"], args["new"])
    turns.append(call("run_tests"))
    turns.append(report(task, task.files, ws.files, style) + "\n" + call("submit"))
    return turns


def weak_turns(task: SweTask, rng: random.Random, style: Style = Style()) -> list[str]:
    """The weak agent's turns: no real fix (see the module docstring)."""
    call = lambda name, args=None: format_call(name, args, strict=style.tool_protocol)  # noqa: E731
    test_file = task.test_command.split()[-1]
    turns = [call("list_files"), call("read_file", {"path": test_file}), call("run_tests")]
    files = dict(task.files)
    if rng.random() < 0.5 and test_file in files:
        content = "def test_ok():\n    assert True\n"
        turns.append(call("write_file", {"path": test_file, "content": content}))
        files[test_file] = content
        turns.append(call("run_tests"))
    turns.append(report(task, task.files, files, style) + "\n" + call("submit"))
    return turns


def play(
    env: SweEnv,
    task: SweTask,
    turns: Sequence[str],
    hints: Sequence[Sequence[str]] | None = None,
) -> Transcript:
    """Plays `turns` in `env` (stopping when the episode ends) and records the transcript;
    `hints[i]` names the requirements whose hint message comes right before turn i."""
    messages = [{"role": "user", "content": env.reset(task)}]
    res = None
    for i, text in enumerate(turns):
        if hints and hints[i]:
            messages.append({"role": HINT_ROLE, "content": env.hint(hints[i])})
        messages.append({"role": "assistant", "content": text})
        res = env.step(text)
        if res.done:
            break
        messages.append({"role": "tool", "content": res.observation})
    if res is None or not res.done:
        raise ValueError(f"the scripted turns did not end the episode of {task.task_id}")
    correct = res.rewards["task"] == 1.0
    hinted = any(hints or ())
    return Transcript(task.task_id, messages, res.rewards, correct, hinted, env.summary().to_dict())


def make_swe_transcripts(
    tasks: Sequence[SweTask],
    seed: int = 0,
    *,
    p_weak: float = 0.0,
    p_comply: float = 1.0,
    env_config: SweEnvConfig = SweEnvConfig(),
) -> list[Transcript]:
    """One transcript per task: the expert (or the weak agent with probability `p_weak`),
    each requirement met with probability `p_comply`; deterministic in the arguments."""
    rng = random.Random(f"tg_jax.envs.swe.agents:{seed}")
    env = SweEnv(env_config)
    out = []
    for task in tasks:
        style = Style(*(rng.random() < p_comply for _ in range(4)))
        weak = rng.random() < p_weak or not task.solution
        turns = weak_turns(task, rng, style) if weak else expert_turns(task, style)
        out.append(play(env, task, turns))
    return out


def _meets_at(name: str, text: str) -> bool:
    """Whether the compliant turn `text` is where requirement `name` is met (so where its
    hint goes): an explained edit, the question before an overwrite, the report, any call."""
    call = parse_call(text)
    if name == "explain_change":
        return call.name in EDIT_TOOLS
    if name == "ask_first":
        return call.name == "ask_user"
    if name in ("markdown_report", "files_named"):
        return call.name == "submit"
    return True  # tool_protocol: every turn


def make_swe_sft_transcripts(
    tasks: Sequence[SweTask],
    seed: int = 0,
    *,
    targets: Sequence[str],
    p_hinted: float,
    p_other_hint: float = 0.5,
    env_config: SweEnvConfig = SweEnvConfig(),
) -> list[Transcript]:
    """The expert's SFT transcripts for a base model that RL can teach `targets`.

    Each requirement `env_config` enables that is not a target is met in every transcript,
    and one it does not enable is not (calls stay in the strict protocol). A transcript is
    hinted with probability `p_hinted`: it meets every target, and each of its turns comes
    right after a hint message naming each target met in that turn (`_meets_at`: where a TG
    teacher sees its hint) and each other requirement of the environment with probability
    `p_other_hint` (hints that do not apply to the turn, as in the hinted evaluation, which
    reminds of every requirement before every turn); an unhinted transcript meets no target
    and shows no hint. So the base model follows the targets' hints, meets them only after
    one, and is not thrown by a hint that does not apply. Deterministic in the arguments.
    """
    enabled = set(env_config.requirements)
    known = set(Style.__dataclass_fields__) - {"report_reason"}
    if not targets or not set(targets) <= known & enabled:
        raise ValueError(
            f"SFT targets must be some of the environment's requirements "
            f"{sorted(known & enabled)}, got {list(targets)}"
        )
    if not 0.0 <= p_hinted <= 1.0:
        raise ValueError(f"p_hinted must be in [0, 1], got {p_hinted}")
    rng = random.Random(f"tg_jax.envs.swe.agents.sft:{seed}")
    env = SweEnv(env_config)
    out = []
    for task in tasks:
        hinted = rng.random() < p_hinted
        on = {n: hinted if n in targets else n in enabled or n == "tool_protocol" for n in known}
        turns = expert_turns(task, Style(**on))
        hints = [
            [
                n
                for n in env_config.requirements
                if hinted and ((n in targets and _meets_at(n, text)) or rng.random() < p_other_hint)
            ]
            for text in turns
        ]
        out.append(play(env, task, turns, hints))
    return out
