"""Tool-call formats: how a model writes a tool call in its text, read back into calls.

A chat template writes an assistant message's `tool_calls` in its model's format; the model
then samples calls in that format, and environments read them back with the format's parser.
The template is the writer (`ChatRenderer` renders calls through it); a format here is the
reader, plus the one-line example a hint or an error message shows.

Registered formats:

  hermes        Qwen3, Qwen2.5, Hermes: a JSON object per call
                  <tool_call>
                  {"name": "read_file", "arguments": {"path": "a.py"}}
                  </tool_call>
  qwen3_coder   Qwen3-Coder: XML, one <parameter=...> block per argument
                  <tool_call>
                  <function=read_file>
                  <parameter=path>
                  a.py
                  </parameter>
                  </function>
                  </tool_call>

Adding one: subclass `ToolFormat` (its `name`, `parse_payload` and `example`), then
`register(MyFormat())`; `ChatRenderer` then detects it for every template that writes calls
the new parser reads back exactly (or name it with `model.tool_format`).
"""

from __future__ import annotations

import abc
import dataclasses
import json
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclasses.dataclass(frozen=True)
class Call:
    """One tool call read from text.

    Attributes:
      name: the function's name.
      arguments: its arguments.
      canonical: written exactly as the format asks (e.g. Hermes: the keys are exactly "name"
        and "arguments", the arguments a JSON object), not merely understood.
    """

    name: str
    arguments: dict[str, Any]
    canonical: bool = True


@dataclasses.dataclass(frozen=True)
class Block:
    """One `<tool_call>` block of a text: where it is and what it holds.

    Attributes:
      start: offset of its opening tag; end: offset after its closing tag (None: not closed).
      payload_start: offset of what the tags enclose.
      call: the call it holds, or None when `error` says why it holds none.
      error: why the payload is not a call ("bad tool_call JSON", ...), else None.
    """

    start: int
    end: int | None
    payload_start: int
    call: Call | None
    error: str | None


class ToolFormat(abc.ABC):
    """A tool-call format: blocks between `<tool_call>` tags, each holding one call."""

    name: str = ""
    open_tag: str = OPEN
    close_tag: str = CLOSE

    @abc.abstractmethod
    def parse_payload(self, payload: str, schema: Mapping[str, Any] | None = None) -> Call:
        """The call a block's payload holds.

        Args:
          payload: the text between the tags.
          schema: the tool's JSON schema ({"type": "function", "function": {...}}) when known,
            for formats that write every value as text (its parameter types convert them).
        Raises:
          ValueError: the payload is not a call in this format; the message says why.
        """

    def function_name(self, payload: str) -> str | None:
        """The called tool's name, read before parsing, for formats whose values need its schema
        (`parse_payload`'s `schema`); None: the format carries its own types."""
        del payload
        return None

    @abc.abstractmethod
    def example(self, name: str = "...", *, arguments: bool = False) -> str:
        """A short call of tool `name` in this format, for hints and error messages (with
        `arguments`, a placeholder argument too)."""

    def blocks(
        self, text: str, schemas: Mapping[str, Mapping[str, Any]] | None = None, start: int = 0
    ) -> list[Block]:
        """Every `<tool_call>` block of `text` from offset `start` on, in order; parsing never
        raises.

        Args:
          text: an assistant turn (any string).
          schemas: {tool name: JSON schema}, passed to `parse_payload`.
          start: where to start looking (offsets stay those of `text`).
        """
        out: list[Block] = []
        at = text.find(self.open_tag, start)
        while at >= 0:
            body = at + len(self.open_tag)
            close = text.find(self.close_tag, body)
            if close < 0:
                out.append(Block(at, None, body, None, f"{self.open_tag} is not closed"))
                break
            payload = text[body:close]
            call, error = None, None
            try:
                name = self.function_name(payload) if schemas else None
                call = self.parse_payload(payload, schemas.get(name) if name else None)
            except (ValueError, RecursionError) as e:
                error = str(e) or "bad tool call"
            out.append(Block(at, close + len(self.close_tag), body, call, error))
            at = text.find(self.open_tag, close + len(self.close_tag))
        return out

    def calls(self, text: str) -> list[Call]:
        """The well-formed calls of `text` (blocks that hold none are left out)."""
        return [b.call for b in self.blocks(text) if b.call is not None]

    def strip(self, text: str) -> str:
        """`text` without its closed `<tool_call>` blocks."""
        out, last = [], 0
        for b in self.blocks(text):
            if b.end is None:
                break
            out.append(text[last : b.start])
            last = b.end
        out.append(text[last:])
        return "".join(out)

    def __repr__(self) -> str:
        return f"<tool format {self.name}>"


class Hermes(ToolFormat):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen3, Qwen2.5, Hermes).

    Understood beyond the canonical form (`Call.canonical` False): no "arguments" key (a call
    without arguments, or the arguments beside the name), and the arguments as a JSON string.
    """

    name = "hermes"

    def parse_payload(self, payload, schema=None):
        del schema  # JSON carries its own types
        try:
            obj = json.loads(payload)
        except (ValueError, RecursionError) as e:
            raise ValueError("bad tool_call JSON") from e
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ValueError('tool_call needs {"name": ...}')
        canonical = set(obj) == {"name", "arguments"} and isinstance(obj["arguments"], dict)
        args = obj.get("arguments", {k: v for k, v in obj.items() if k != "name"})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError) as e:
                raise ValueError("tool_call arguments are not a JSON object") from e
        if not isinstance(args, dict):
            raise ValueError("tool_call arguments are not a JSON object")
        return Call(obj["name"], args, canonical)

    def example(self, name="...", *, arguments=False):
        quoted = name if name == "..." else json.dumps(name)
        args = ', "arguments": {...}' if arguments else ""
        return f'<tool_call>{{"name": {quoted}{args}}}</tool_call>'


_FUNCTION = re.compile(r"\A\s*<function=([^>\n]*)>\n?(.*?)</function>\s*\Z", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>\n?(.*?)\n?</parameter>", re.S)


class Qwen3Coder(ToolFormat):
    """Qwen3-Coder's XML: `<function=NAME>` then one `<parameter=P>` block per argument.

    Values are text; with the tool's schema they convert by parameter type (integer, number,
    boolean, object, array), as vLLM's qwen3_coder parser converts them; without one, or for a
    string parameter, they stay text.
    """

    name = "qwen3_coder"

    def function_name(self, payload: str) -> str | None:
        m = _FUNCTION.match(payload)
        return m.group(1).strip() if m else None

    def parse_payload(self, payload, schema=None):
        m = _FUNCTION.match(payload)
        if not m:
            raise ValueError("tool_call needs <function=NAME>...</function>")
        name, body = m.group(1).strip(), m.group(2)
        if not name:
            raise ValueError("tool_call has an empty function name")
        types = _parameter_types(schema)
        args: dict[str, Any] = {}
        last = 0
        for p in _PARAMETER.finditer(body):
            if body[last : p.start()].strip():
                raise ValueError(f"text outside <parameter> blocks in function {name[:24]!r}")
            key = p.group(1).strip()
            if key in args:
                raise ValueError(f"parameter {key[:24]!r} given twice")
            args[key] = _convert(p.group(2), types.get(key), key)
            last = p.end()
        if body[last:].strip():
            raise ValueError(f"text outside <parameter> blocks in function {name[:24]!r}")
        return Call(name, args, True)

    def example(self, name="...", *, arguments=False):
        args = "<parameter=...>\n...\n</parameter>\n" if arguments else ""
        return f"<tool_call>\n<function={name}>\n{args}</function>\n</tool_call>"


def _parameter_types(schema: Mapping[str, Any] | None) -> dict[str, str]:
    if not schema:
        return {}
    fn = schema.get("function", schema)
    props = (fn.get("parameters") or {}).get("properties") or {}
    return {k: v.get("type") for k, v in props.items() if isinstance(v, Mapping)}


def _convert(value: str, kind: Any, key: str) -> Any:
    """A parameter's text as its schema type (text when the type is unknown or string)."""
    try:
        if kind == "integer":
            return int(value.strip())
        if kind == "number":
            number = float(value.strip())
            return int(number) if number.is_integer() and "." not in value else number
        if kind == "boolean":
            word = value.strip().lower()
            if word not in ("true", "false"):
                raise ValueError(word)
            return word == "true"
        if kind in ("object", "array"):
            return json.loads(value)
    except ValueError as e:
        raise ValueError(f"parameter {key[:24]!r} is not a valid {kind}") from e
    return value


_LOCK = threading.Lock()
_FORMATS: dict[str, ToolFormat] = {}


def register(fmt: ToolFormat) -> ToolFormat:
    """Adds `fmt` to the formats `get` and `detect` know (its name must be new)."""
    if not isinstance(fmt, ToolFormat) or not fmt.name:
        raise TypeError(f"register takes a named ToolFormat instance, got {fmt!r}")
    with _LOCK:
        if fmt.name in _FORMATS and _FORMATS[fmt.name] is not fmt:
            raise ValueError(f"tool format {fmt.name!r} is already registered")
        _FORMATS[fmt.name] = fmt
    return fmt


def names() -> tuple[str, ...]:
    with _LOCK:
        return tuple(_FORMATS)


def get(name: str) -> ToolFormat:
    """The registered format called `name`; ValueError naming the known ones otherwise."""
    with _LOCK:
        fmt = _FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"unknown tool format {name!r} (registered: {', '.join(names())})")
    return fmt


def detect(written: str, calls: Sequence[Call]) -> ToolFormat | None:
    """The registered format whose parser reads back exactly `calls` from `written` (the text
    a chat template wrote for them), or None."""
    want = [(c.name, c.arguments) for c in calls]
    for name in names():
        fmt = get(name)
        blocks = fmt.blocks(written)
        got = [(b.call.name, b.call.arguments) for b in blocks if b.call is not None]
        if got == want and all(b.error is None for b in blocks):
            return fmt
    return None


HERMES = register(Hermes())
QWEN3_CODER = register(Qwen3Coder())
