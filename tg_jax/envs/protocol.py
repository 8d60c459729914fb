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


def make_requirement(name: str, weight: float = 1.0) -> Requirement:
    """The named requirement of the coding environment ("fence" or "tool_json")."""
    if name == "fence":
        return Requirement("fence", check_fence, FENCE_HINT, weight, applies=fence_applies)
    if name == "tool_json":
        return Requirement("tool_json", check_tool_json, TOOL_JSON_HINT, weight)
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
