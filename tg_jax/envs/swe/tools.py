"""The tool protocol of the SWE environment: parsing assistant turns, running file tools.

An assistant turn may open with `<think>...</think>`, may carry free text (the final report
on a submit turn), and calls one tool in the model's tool-call format (`tg_jax.text.
tool_formats`, the chat template's), e.g. Hermes JSON (Qwen3):

    <tool_call>
    {"name": "read_file", "arguments": {"path": "pkg/ops.py", "start": 1, "end": 20}}
    </tool_call>

or Qwen3-Coder's XML (values typed by the tool schemas below):

    <tool_call>
    <function=read_file>
    <parameter=path>
    pkg/ops.py
    </parameter>
    </function>
    </tool_call>

The observation comes back as a "tool" message (the template wraps it in <tool_response>).
Parsing is lenient so that the task skill never depends on the protocol requirement: what the
format understands beyond its canonical form (Hermes: a call without the "arguments" wrapper,
"arguments" as a JSON string) and a legacy line `CALL read_file {"path": ...}` are understood;
`strict` says whether the turn is exactly one canonical call (what the "tool_protocol"
requirement asks). Anything unparsable is a malformed turn with an "error: ..." observation.

Tools: list_files(), read_file(path, start=1, end=None), str_replace(path, old, new),
write_file(path, content), ask_user(question), run_tests(), submit().
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from tg_jax.envs.swe.task import check_path
from tg_jax.text.tool_formats import HERMES, ToolFormat

TOOLS = (
    "list_files",
    "read_file",
    "str_replace",
    "write_file",
    "ask_user",
    "run_tests",
    "submit",
)
EDIT_TOOLS = ("str_replace", "write_file")
# Required string arguments per tool (read_file's start/end are optional ints).
_STR_ARGS = {
    "read_file": ("path",),
    "str_replace": ("path", "old", "new"),
    "write_file": ("path", "content"),
    "ask_user": ("question",),
}


def _schema(name: str, doc: str, **params: str) -> dict[str, Any]:
    props = {k: {"type": v.rstrip("?")} for k, v in params.items()}
    required = [k for k, v in params.items() if not v.endswith("?")]
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": doc,
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


# The tools as JSON schemas, for the chat template's tools block (`ChatRenderer.prompt_text(
# ..., tools=TOOL_SCHEMAS)`); the task prompt lists them in one line instead, to stay short.
TOOL_SCHEMAS = (
    _schema("list_files", "List the repository's files."),
    _schema(
        "read_file",
        "Read a file, lines start..end.",
        path="string",
        start="integer?",
        end="integer?",
    ),
    _schema(
        "str_replace",
        "Replace the one occurrence of old by new.",
        path="string",
        old="string",
        new="string",
    ),
    _schema("write_file", "Create or overwrite a file.", path="string", content="string"),
    _schema("ask_user", "Ask the user a question.", question="string"),
    _schema("run_tests", "Run the visible tests."),
    _schema("submit", "Submit; the message text is the final report."),
)
_THINK = re.compile(r"\A\s*<think>(.*?)</think>\s*", re.S)
_LEGACY = re.compile(r"^[ \t]*CALL[ \t]+(\w+)[ \t]*(\{.*\})?[ \t]*$", re.M)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed assistant turn. Parsing never raises.

    Attributes:
      name: the tool, or None for a malformed turn.
      args: the tool's arguments.
      error: observation for a malformed turn ("error: ..."), else None.
      strict: exactly one <tool_call> holding {"name": ..., "arguments": {...}}, no legacy line.
      text: the turn's free text (think block and tool calls removed), stripped.
    """

    name: str | None
    args: dict[str, Any]
    error: str | None
    strict: bool
    text: str


def _bad(error: str, text: str) -> ToolCall:
    return ToolCall(None, {}, error, False, text)


SCHEMAS = {s["function"]["name"]: s for s in TOOL_SCHEMAS}


def parse_call(turn: str, fmt: ToolFormat = HERMES) -> ToolCall:
    """Parses one assistant turn (see the module docstring) whose calls are in format `fmt`."""
    body = turn
    m = _THINK.match(body)
    if m:
        body = body[m.end() :]
    blocks = fmt.blocks(body, SCHEMAS)
    rest = fmt.strip(body)
    legacy = _LEGACY.findall(rest)
    text = _LEGACY.sub("", rest).strip()
    example = fmt.example(arguments=True)
    if blocks and blocks[-1].end is None:
        return _bad(f"error: {fmt.open_tag} is not closed with {fmt.close_tag}", text)
    if blocks:
        call = blocks[0].call
        if call is None:
            return _bad(f"error: {blocks[0].error}; use {example}", text)
        strict = len(blocks) == 1 and not legacy and call.canonical
        return _checked(call.name, call.arguments, strict, text)
    if legacy:
        name, payload = legacy[-1]
        try:
            args = json.loads(payload) if payload else {}
        except (ValueError, RecursionError):
            return _bad("error: bad JSON arguments after CALL", text)
        return _checked(name, args, False, text)
    return _bad(f"error: no tool call; call one tool as {example}", text)


def _checked(name: str, args: Any, strict: bool, text: str) -> ToolCall:
    if name not in TOOLS:
        return _bad(f"error: unknown tool {name[:24]!r}; tools: {', '.join(TOOLS)}", text)
    if not isinstance(args, dict):
        return _bad(f"error: {name} arguments must be a JSON object", text)
    for key in _STR_ARGS.get(name, ()):
        if not isinstance(args.get(key), str):
            return _bad(f"error: {name} needs a string argument {key!r}", text)
    if name == "read_file":
        for key in ("start", "end"):
            v = args.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                return _bad(f"error: read_file {key!r} must be an integer line number", text)
    if "path" in args and name in _STR_ARGS:
        try:
            check_path(args["path"], "path")
        except ValueError:
            return _bad(f"error: {args['path'][:60]!r} is not a relative path", text)
    return ToolCall(name, dict(args), None, strict, text)


def format_call(name: str, args: dict[str, Any] | None = None, *, strict: bool = True) -> str:
    """A tool call as the scripted agents write it: strict Hermes <tool_call> JSON or a legacy
    CALL line (models write their own format, which their chat template shows them)."""
    args = args or {}
    if strict:
        payload = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
        return f"<tool_call>\n{payload}\n</tool_call>"
    return f"CALL {name} {json.dumps(args, ensure_ascii=False)}" if args else f"CALL {name}"


def truncate(text: str, limit: int) -> str:
    """`text` cut to `limit` characters with a note saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n[... {len(text) - limit} more characters truncated]"


def file_tool(ws: Workspace, call: ToolCall) -> str | None:
    """The output of a read_file, str_replace or write_file call run on `ws` ("error: ..."
    when it fails; edits change `ws`), None for the other tools."""
    a = call.args
    if call.name == "read_file":
        return ws.read_file(a["path"], a.get("start"), a.get("end"))
    if call.name == "str_replace":
        return ws.str_replace(a["path"], a["old"], a["new"])
    if call.name == "write_file":
        return ws.write_file(a["path"], a["content"])
    return None


class Workspace:
    """The repository an episode edits, in memory (path -> text), with its original state."""

    def __init__(self, files: dict[str, str]):
        self.original = dict(files)
        self.files = dict(files)

    def changed(self) -> list[str]:
        """Paths whose content differs from the original (created, edited or deleted)."""
        paths = set(self.original) | set(self.files)
        return sorted(p for p in paths if self.original.get(p) != self.files.get(p))

    def overwrites(self, call: ToolCall) -> bool:
        """Whether `call` would overwrite an existing file: write_file on an existing path, or
        a str_replace whose old text is at least half of the file."""
        path = call.args.get("path")
        if call.name == "write_file":
            return path in self.files and self.files[path] != call.args["content"]
        if call.name == "str_replace" and path in self.files and self.files[path]:
            return len(call.args["old"]) * 2 >= len(self.files[path])
        return False

    def list_files(self) -> str:
        return "\n".join(sorted(self.files)) or "(no files)"

    def read_file(self, path: str, start: int | None = None, end: int | None = None) -> str:
        if path not in self.files:
            return f"error: no file {path!r}"
        lines = self.files[path].split("\n")
        lo = max(1, start or 1)
        hi = min(len(lines), end or len(lines))
        if lo > hi:
            return f"error: {path} has {len(lines)} lines"
        return "\n".join(f"{i}|{lines[i - 1]}" for i in range(lo, hi + 1))

    def str_replace(self, path: str, old: str, new: str) -> str:
        if path not in self.files:
            return f"error: no file {path!r}"
        n = self.files[path].count(old) if old else 0
        if n != 1:
            what = "empty" if not old else "not found" if n == 0 else f"found {n} times"
            return f"error: old text {what} in {path}; it must occur exactly once"
        self.files[path] = self.files[path].replace(old, new)
        return f"edited {path}"

    def write_file(self, path: str, content: str) -> str:
        existed = path in self.files
        self.files[path] = content
        return f"{'overwrote' if existed else 'created'} {path}"
