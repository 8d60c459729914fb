"""The assistant-turn protocol of the coding environment: parsing, requirement checkers, hints.

A turn may open with `<think>...</think>`, then carries code defining `f` and one tool call.
Two syntaxes are accepted, so the task skill never depends on meeting a requirement:

  strict (what the requirements ask for)      legacy (what the base model writes)
    ```python                                    def f(x): return 2*x+3
    def f(x): return 2*x+3                       CALL run_tests
    ```
    <tool_call>{"name": "run_tests"}</tool_call>

Tools: `run_tests` (runs the code on the visible examples) and `submit` (runs the hidden
tests and ends the episode; a submit turn may omit code to submit the last code written).
"""

from __future__ import annotations

import dataclasses
import json
import re

from tg_jax.envs.base import Requirement

TOOLS = ("run_tests", "submit")

FENCE_HINT = "Reminder: put code in a ```python block."
FENCE_OPENING = "```python\n"  # how a fenced turn starts (`Requirement.opening`)
TOOL_JSON_HINT = 'Reminder: use <tool_call>{"name": ...}</tool_call>.'

_THINK = re.compile(r"\A\s*<think>(.*?)</think>[ \t]*\n?", re.S)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
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


def parse_turn(text: str) -> ParsedTurn:
    """Parses one assistant turn (see module docstring).

    Args:
      text: the assistant message; any str, including garbage.

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
    if "<tool_call>" in body:
        calls = _TOOL_CALL.findall(body)
        rest = _TOOL_CALL.sub("", body)
        if not calls or "<tool_call>" in rest:
            error = "error: <tool_call> is not closed"
        else:
            tool, error = _parse_json_call(calls[-1])
            json_call = error is None and len(calls) == 1 and not _LEGACY.search(rest)
        body = rest.split("<tool_call>")[0]
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


def _parse_json_call(payload: str) -> tuple[str | None, str | None]:
    try:
        obj = json.loads(payload)
    except (ValueError, RecursionError):
        return None, "error: bad tool_call JSON"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, 'error: tool_call needs {"name": ...}'
    if obj["name"] not in TOOLS:
        return None, f"error: unknown tool {obj['name'][:_MAX_NAME]!r}"
    return obj["name"], None


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


def check_fence(turn_text: str) -> bool:
    """Requirement "fence": the code is in a ```python fenced block, nothing left outside."""
    return parse_turn(turn_text).fenced


def check_tool_json(turn_text: str) -> bool:
    """Requirement "tool_json": one valid <tool_call>{"name": TOOL}</tool_call>, no CALL line."""
    return parse_turn(turn_text).json_call


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


def _first_call(text: str, off: int) -> int | None:
    """Start of the first tool call (a CALL line or a <tool_call>) in text[off:], else None."""
    legacy = _LEGACY.search(text, off)
    json_call = text.find("<tool_call>", off)
    starts = ([legacy.start()] if legacy else []) + ([json_call] if json_call >= 0 else [])
    return min(starts) if starts else None


def _tool_call_end(text: str, off: int) -> int | None:
    """End of a tool call (a JSON call or a CALL line) starting at text[off:], else None."""
    if text.startswith("<tool_call>", off):
        end = text.find("</tool_call>", off)
        return None if end < 0 else end + len("</tool_call>")
    m = _LEGACY.match(text, off)
    return m.end() if m else None


def fence_breaks_at(turn_text: str) -> int | None:
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
        call = _first_call(turn_text, off)
        return len(turn_text) if call is None else _skip(turn_text, call, " \t")
    if not turn_text[off + 1 : close].strip():
        return close
    off = close + 3
    while True:
        off = _skip(turn_text, off, " \t\n")
        if off >= len(turn_text):
            return None
        end = _tool_call_end(turn_text, off)
        if end is None:
            return off
        off = end


def tool_json_breaks_at(turn_text: str) -> int | None:
    """Where a turn that fails "tool_json" breaks it (`Requirement.breaks_at`): the first
    CALL line, or the payload of a bad <tool_call>, or a second call after a good one, or
    the end of a turn without any call; None when none of these applies (an unclosed call)."""
    off = _answer_start(turn_text)
    if off is None:
        return None
    call = _first_call(turn_text, off)
    if call is None:
        return len(turn_text)
    start = turn_text.find("<tool_call>", off)
    if call != start:  # a CALL line first
        return _skip(turn_text, call, " \t")
    end = turn_text.find("</tool_call>", start)
    payload = start + len("<tool_call>")
    if end < 0:
        return None
    if _parse_json_call(turn_text[payload:end])[1] is not None:
        return payload
    call = _first_call(turn_text, end + len("</tool_call>"))
    return None if call is None else _skip(turn_text, call, " \t")


def make_requirement(name: str, weight: float = 1.0) -> Requirement:
    """The named requirement of the coding environment ("fence" or "tool_json")."""
    if name == "fence":
        return Requirement(
            "fence", check_fence, FENCE_HINT, weight, applies=fence_applies,
            breaks_at=fence_breaks_at, opening=FENCE_OPENING,
        )  # fmt: skip
    if name == "tool_json":
        return Requirement(
            "tool_json", check_tool_json, TOOL_JSON_HINT, weight, breaks_at=tool_json_breaks_at
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
