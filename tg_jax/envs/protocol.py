"""The assistant-turn protocol of the coding environment: parsing, requirement checkers, hints.

A turn may open with `<think>...</think>`, then carries code defining `f` and one tool call.
Two syntaxes are accepted, so the task skill never depends on meeting a requirement:

  strict (what the requirements ask for)      legacy (what the base model writes)
    ```python                                    def f(x): return 2*x+3
    def f(x): return 2*x+3                       CALL run_tests
    ```
    <tool_call>{"name": "run_tests"}</tool_call>

The strict call is written in the model's tool-call format (`tg_jax.text.tool_formats`: the
Hermes JSON above, or Qwen3-Coder's `<function=run_tests>` XML); every function here takes
that format (`fmt`, Hermes by default) and reads calls with its parser. Requirement
"tool_json" asks for exactly one well-formed call in that format.

Tools: `run_tests` (runs the code on the visible examples) and `submit` (runs the hidden
tests and ends the episode; a submit turn may omit code to submit the last code written).
"""

from __future__ import annotations

import dataclasses
import functools
import re

from tg_jax.envs.base import Requirement
from tg_jax.text import tool_formats
from tg_jax.text.tool_formats import HERMES, ToolFormat

TOOLS = ("run_tests", "submit")

FENCE_HINT = "Reminder: put code in a ```python block."
FENCE_OPENING = "```python\n"  # how a fenced turn starts (`Requirement.opening`)


def tool_json_hint(fmt: ToolFormat = HERMES) -> str:
    """The hint of requirement "tool_json" in the model's tool-call format."""
    return f"Reminder: use {fmt.example()}."


TOOL_JSON_HINT = tool_json_hint()  # the Hermes one (the embedded default's)

_THINK = re.compile(r"\A\s*<think>(.*?)</think>[ \t]*\n?", re.S)
_LEGACY = re.compile(r"^[ \t]*CALL[ \t]+(\S*)[ \t]*$", re.M)
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\n(.*?)\n?[ \t]*```", re.S)
_MAX_NAME = 16


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """One assistant turn, parsed. Parsing never raises.

    Attributes:
      think: content of a leading <think> block, or None.
      code: the code found (fenced content, else the text left over), "" if none.
      tool: "run_tests", "submit" or None when no valid tool call was found.
      error: observation text for a malformed turn ("error: ..."), else None.
      fenced: the code came from a ```python block and no other text is left over.
      json_call: the tool call is exactly one valid <tool_call> JSON object, no legacy line.
    """

    think: str | None
    code: str
    tool: str | None
    error: str | None
    fenced: bool
    json_call: bool


def parse_turn(text: str, fmt: ToolFormat = HERMES) -> ParsedTurn:
    """Parses one assistant turn (see module docstring).

    Args:
      text: the assistant message; any str, including garbage.
      fmt: the model's tool-call format.

    Returns:
      A ParsedTurn; malformed turns get `error` set and `tool` None.
    """
    think = None
    body = text
    m = _THINK.match(body)
    if m:
        think, body = m.group(1), body[m.end() :]
    elif body.lstrip().startswith("<think>"):
        return ParsedTurn(None, "", None, "error: <think> is not closed", False, False)

    tool, error, json_call = None, None, False
    if fmt.open_tag in body:
        blocks = fmt.blocks(body)
        rest = fmt.strip(body)
        if blocks[-1].end is None:
            error = f"error: {blocks[-1].error}"
        else:
            tool, error = _call_tool(blocks[-1])
            json_call = error is None and len(blocks) == 1 and not _LEGACY.search(rest)
        body = rest.split(fmt.open_tag)[0]
    else:
        names = _LEGACY.findall(body)
        if names:
            tool = names[-1]
            if tool not in TOOLS:
                error, tool = f"error: unknown tool {tool[:_MAX_NAME]!r}", None
        else:
            error = "error: no tool call (run_tests or submit)"
    body = _LEGACY.sub("", body)

    blocks = _FENCE.findall(body)
    if blocks:
        code = "\n".join(c for lang, c in blocks if lang in ("python", "py", "")).strip("\n")
        leftover = _FENCE.sub("", body).strip()
        fenced = bool(code.strip()) and not leftover and all(lang == "python" for lang, _ in blocks)
    else:
        # An unclosed fence line is dropped so the code under it still runs.
        code = "\n".join(ln for ln in body.split("\n") if not ln.lstrip().startswith("```"))
        code, fenced = code.strip("\n"), False
    if not code.strip():
        code = ""
    if error:
        tool = None
    return ParsedTurn(think, code, tool, error, fenced, json_call)


def _call_tool(block: tool_formats.Block) -> tuple[str | None, str | None]:
    """(tool, None) of a block holding a call of a known tool, else (None, error)."""
    if block.call is None:
        return None, f"error: {block.error}"
    if block.call.name not in TOOLS:
        return None, f"error: unknown tool {block.call.name[:_MAX_NAME]!r}"
    return block.call.name, None


def has_code(turn_text: str) -> bool:
    """Whether the turn carries any code."""
    return bool(parse_turn(turn_text).code)


def fence_applies(turn_text: str) -> bool:
    """Whether the fence requirement judges the turn: it carries code, or opens a code fence.

    A fence with no code in it (e.g. "````python\n````") is a broken fence, not a turn the
    requirement does not concern: otherwise such turns would escape both the fence reward and
    the targeted-guidance gate.
    """
    return has_code(turn_text) or "```" in turn_text


def check_fence(turn_text: str, fmt: ToolFormat = HERMES) -> bool:
    """Requirement "fence": the code is in a ```python fenced block, nothing left outside."""
    return parse_turn(turn_text, fmt).fenced


def check_tool_json(turn_text: str, fmt: ToolFormat = HERMES) -> bool:
    """Requirement "tool_json": exactly one well-formed call of a tool in the model's format
    (Hermes: <tool_call>{"name": TOOL}</tool_call>), no CALL line."""
    return parse_turn(turn_text, fmt).json_call


def _answer_start(text: str) -> int | None:
    """Offset of the answer after a leading <think> block (None: the block is not closed)."""
    m = _THINK.match(text)
    if m:
        return m.end()
    return None if text.lstrip().startswith("<think>") else 0


def _match_literal(text: str, off: int, literal: str) -> tuple[int, bool]:
    """(offset after the longest prefix of `literal` at text[off:], whether all of it matched)."""
    for ch in literal:
        if off >= len(text) or text[off] != ch:
            return off, False
        off += 1
    return off, True


def _skip(text: str, off: int, chars: str) -> int:
    while off < len(text) and text[off] in chars:
        off += 1
    return off


def _first_call(text: str, off: int, fmt: ToolFormat) -> int | None:
    """Start of the first tool call (a CALL line or a <tool_call>) in text[off:], else None."""
    legacy = _LEGACY.search(text, off)
    json_call = text.find(fmt.open_tag, off)
    starts = ([legacy.start()] if legacy else []) + ([json_call] if json_call >= 0 else [])
    return min(starts) if starts else None


def _tool_call_end(text: str, off: int, fmt: ToolFormat) -> int | None:
    """End of a tool call (a <tool_call> block or a CALL line) starting at text[off:], else
    None."""
    if text.startswith(fmt.open_tag, off):
        end = text.find(fmt.close_tag, off)
        return None if end < 0 else end + len(fmt.close_tag)
    m = _LEGACY.match(text, off)
    return m.end() if m else None


def fence_breaks_at(turn_text: str, fmt: ToolFormat = HERMES) -> int | None:
    """Where a turn that fails "fence" breaks it (`Requirement.breaks_at`): the first character
    that differs from an opening ```python line after the thinking block; with a good
    opening, the tool call written before the closing fence, or the closing fence of an empty
    block, or the first text left outside the block; None when none of these applies."""
    off = _answer_start(turn_text)
    if off is None:
        return None
    off, ok = _match_literal(turn_text, _skip(turn_text, off, " \t\n"), "```python")
    if not ok:
        return off
    off = _skip(turn_text, off, " \t")
    if off >= len(turn_text) or turn_text[off] != "\n":
        return off
    close = turn_text.find("```", off + 1)
    if close < 0:  # not closed: the tool call (if any) came where the closing fence belongs
        call = _first_call(turn_text, off, fmt)
        return len(turn_text) if call is None else _skip(turn_text, call, " \t")
    if not turn_text[off + 1 : close].strip():
        return close
    off = close + 3
    while True:
        off = _skip(turn_text, off, " \t\n")
        if off >= len(turn_text):
            return None
        end = _tool_call_end(turn_text, off, fmt)
        if end is None:
            return off
        off = end


def tool_json_breaks_at(turn_text: str, fmt: ToolFormat = HERMES) -> int | None:
    """Where a turn that fails "tool_json" breaks it (`Requirement.breaks_at`): the first
    CALL line, or the payload of a bad <tool_call>, or a second call after a good one, or
    the end of a turn without any call; None when none of these applies (an unclosed call)."""
    off = _answer_start(turn_text)
    if off is None:
        return None
    call = _first_call(turn_text, off, fmt)
    if call is None:
        return len(turn_text)
    start = turn_text.find(fmt.open_tag, off)
    if call != start:  # a CALL line first
        return _skip(turn_text, call, " \t")
    block = fmt.blocks(turn_text, start=start)[0]
    if block.end is None:
        return None
    if _call_tool(block)[1] is not None:
        return block.payload_start
    call = _first_call(turn_text, block.end, fmt)
    return None if call is None else _skip(turn_text, call, " \t")


def make_requirement(name: str, weight: float = 1.0, fmt: ToolFormat = HERMES) -> Requirement:
    """The named requirement of the coding environment ("fence" or "tool_json"), judging
    calls in tool-call format `fmt`."""
    if name == "fence":
        return Requirement(
            "fence",
            functools.partial(check_fence, fmt=fmt),
            FENCE_HINT,
            weight,
            applies=fence_applies,
            breaks_at=functools.partial(fence_breaks_at, fmt=fmt),
            opening=FENCE_OPENING,
        )
    if name == "tool_json":
        return Requirement(
            "tool_json",
            functools.partial(check_tool_json, fmt=fmt),
            tool_json_hint(fmt),
            weight,
            breaks_at=functools.partial(tool_json_breaks_at, fmt=fmt),
        )
    raise ValueError(f"unknown requirement {name!r}; known: {REQUIREMENT_NAMES}")


REQUIREMENT_NAMES = ("fence", "tool_json")


def format_turn(
    code: str | None,
    tool: str,
    *,
    fence: bool = False,
    tool_json: bool = False,
    think: str | None = None,
) -> str:
    """Writes an assistant turn in the strict or legacy syntax.

    Args:
      code: source defining f, or None (a submit turn that submits the last code).
      tool: "run_tests" or "submit".
      fence: put the code in a ```python block (else bare).
      tool_json: call the tool as <tool_call>{"name": tool}</tool_call> (else "CALL tool").
      think: content of a leading <think> block, or None for no block.

    Returns:
      The turn text.
    """
    if tool not in TOOLS:
        raise ValueError(f"tool must be one of {TOOLS}, got {tool!r}")
    parts = [] if think is None else [f"<think>{think}</think>"]
    if code:
        parts.append(f"```python\n{code}\n```" if fence else code)
    parts.append(f'<tool_call>{{"name": "{tool}"}}</tool_call>' if tool_json else f"CALL {tool}")
    return "\n".join(parts)
