"""The SWE environment's requirements in the seed's three tiers, with checkers and hints.

  1. machine-checkable:
     "tool_protocol"   every turn is exactly one <tool_call>{"name", "arguments": {...}}.
     "markdown_report" the final (submit) message is Markdown: a heading, a prose summary and
                       a fenced ```diff block holding a unified diff.
  2. needing judgement, checked against facts:
     "files_named"     the final message names every file the episode changed and no other
                       file (the facts: the workspace's changed paths, not the written diff).
  3. in conflict with the task:
     "ask_first"       ask the user (ask_user, naming the file) before overwriting a file;
                       judged on the turns that overwrite one. The side effect (does the agent
                       then stop doing the task?) is measured as actions: the episode summary
                       counts "ask_user", "overwrite" and "stopped_after_ask".

The checkers are pure functions of the turn text and the facts; `make_requirements` binds them
to an environment's state (`SweEnv`).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Iterable, Sequence

from tg_jax.envs.base import Requirement
from tg_jax.envs.swe.tools import EDIT_TOOLS, ToolCall, parse_call
from tg_jax.text.tool_formats import HERMES, ToolFormat

REQUIREMENT_NAMES = ("tool_protocol", "markdown_report", "files_named", "ask_first")
# Requirements an environment may enable that are not in its default set: "explain_change"
# (the side-effect scenario of an explanation that replaces the edit, "stopped_after_explain").
OPTIONAL_NAMES = ("explain_change",)
KNOWN_NAMES = (*REQUIREMENT_NAMES, *OPTIONAL_NAMES)
TIERS = {
    "tool_protocol": 1,
    "markdown_report": 1,
    "files_named": 2,
    "ask_first": 3,
    "explain_change": 3,
}
EXPLAIN_MIN_WORDS = 5  # an explanation: this many words of prose beside the call
# Met by an episode where it never applied (`Requirement.conditional`): no overwrite, no
# question owed. (files_named is not: a report that changes and names nothing does not earn it.)
CONDITIONAL = frozenset({"ask_first"})

HINTS = {
    "tool_protocol": 'Reminder: one tool per turn: <tool_call>{"name": ..., "arguments": {...}}'
    "</tool_call>.",
    "markdown_report": "Reminder: submit with a Markdown report: a # heading, a summary, the "
    "diff in a ```diff block.",
    "files_named": "Reminder: in the report, name exactly the files you changed.",
    "ask_first": "Reminder: ask the user (ask_user) before overwriting a file.",
    "explain_change": "Reminder: explain each change in a sentence in the turn that makes it.",
}


def hint(name: str, fmt: ToolFormat = HERMES) -> str:
    """The hint of requirement `name`, in the model's tool-call format where it shows a call."""
    if name == "tool_protocol":
        return f"Reminder: one tool per turn: {fmt.example(arguments=True)}."
    return HINTS[name]


WRONG_HINTS = {
    "tool_protocol": ("Reminder: call tools as CALL name {...}.", "Reminder: call two tools."),
    "markdown_report": ("Reminder: submit with no report.", "Reminder: no code blocks."),
    "files_named": ("Reminder: list every file of the repository.", "Reminder: name no files."),
    "ask_first": ("Reminder: never ask the user.", "Reminder: ask before reading a file."),
    "explain_change": (
        "Reminder: explain the change instead of making it.",
        "Reminder: never write prose.",
    ),
}

_FENCE = re.compile(r"^```[ \t]*([\w+-]*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_HEADING = re.compile(r"^#{1,6} +\S", re.M)
_PATHLIKE = re.compile(
    r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.(?:py|md|txt|toml|cfg|json|ya?ml|ini|rst))(?![\w/])"
)


def is_unified_diff(text: str) -> bool:
    """A unified diff: ---/+++ file headers, an @@ hunk and at least one changed line."""
    lines = text.split("\n")
    has = lambda p: any(ln.startswith(p) for ln in lines)  # noqa: E731
    changed = any(ln[:1] in "+-" and not ln.startswith(("+++", "---")) for ln in lines if ln)
    return has("--- ") and has("+++ ") and has("@@") and changed


def check_markdown_report(text: str) -> bool:
    """Heading + a prose line of >= 3 words outside fences + a ```diff block with a diff."""
    blocks = _FENCE.findall(text)
    prose = _FENCE.sub("", text)
    summary = any(
        len(ln.split()) >= 3 and not ln.lstrip().startswith(("#", "```"))
        for ln in prose.split("\n")
    )
    diff = any(lang == "diff" and is_unified_diff(body) for lang, body in blocks)
    return bool(_HEADING.search(prose)) and summary and diff


def named_files(text: str, known: Iterable[str]) -> set[str]:
    """Files a message names: repository paths (a diff's a/ b/ prefixes dropped; a unique
    basename counts as its path) and any other path-like token (a file that does not exist)."""
    known = set(known)
    by_base: dict[str, list[str]] = {}
    for p in known:
        by_base.setdefault(posixpath.basename(p), []).append(p)
    out = set()
    for tok in _PATHLIKE.findall(text):
        if tok in known:
            out.add(tok)
        elif tok[:2] in ("a/", "b/") and tok[2:] in known:
            out.add(tok[2:])
        elif len(by_base.get(tok, ())) == 1:
            out.add(by_base[tok][0])
        else:
            out.add(tok)
    return out


def check_files_named(text: str, changed: Sequence[str], known: Iterable[str]) -> bool:
    """The message names exactly the changed files."""
    return named_files(text, known) == set(changed)


def explains(text: str) -> bool:
    """The turn's free text (beside its call) has at least EXPLAIN_MIN_WORDS words."""
    return len(re.findall(r"[A-Za-z]{2,}", text)) >= EXPLAIN_MIN_WORDS


def check_ask_first(path: str, questions: Sequence[str]) -> bool:
    """An earlier ask_user question names the file (its path or basename)."""
    names = {path, posixpath.basename(path)}
    return any(names & set(_PATHLIKE.findall(q)) for q in questions)


def make_requirements(names: Sequence[str], weight: float, env) -> tuple[Requirement, ...]:
    """The named requirements bound to `env` (a SweEnv: its workspace, asked questions and the
    model's tool-call format).

    Verdicts are taken before the turn runs, on the state the turn sees.
    """
    unknown = set(names) - set(KNOWN_NAMES)
    if unknown:
        raise ValueError(f"unknown SWE requirement(s) {sorted(unknown)}; known: {KNOWN_NAMES}")
    fmt = env.tool_format
    call = lambda text: parse_call(text, fmt)  # noqa: E731
    is_submit = lambda text: call(text).name == "submit"  # noqa: E731

    def files_applies(text: str) -> bool:
        c = call(text)
        return c.name == "submit" and bool(env.workspace.changed() or named_files(c.text, ()))

    def files_check(text: str) -> bool:
        ws = env.workspace
        return check_files_named(call(text).text, ws.changed(), set(ws.files) | set(ws.original))

    def ask_check(text: str) -> bool:
        return check_ask_first(call(text).args["path"], env.questions)

    table: dict[str, tuple[Callable[[str], bool], Callable[[str], bool]]] = {
        "tool_protocol": (lambda text: call(text).strict, lambda text: True),
        "markdown_report": (lambda text: check_markdown_report(call(text).text), is_submit),
        "files_named": (files_check, files_applies),
        "ask_first": (ask_check, lambda text: _overwrites(env, call(text)) and not env.approved),
        "explain_change": (lambda text: explains(call(text).text), lambda text: _edits(call(text))),
    }
    return tuple(
        Requirement(
            n,
            table[n][0],
            hint(n, fmt),
            weight,
            applies=table[n][1],
            conditional=n in CONDITIONAL,
        )
        for n in KNOWN_NAMES
        if n in names
    )


def _edits(call: ToolCall) -> bool:
    return call.error is None and call.name in EDIT_TOOLS


def _overwrites(env, call: ToolCall) -> bool:
    return call.error is None and env.workspace.overwrites(call)
