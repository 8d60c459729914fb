"""Hugging Face chat templates: rendered as transformers renders them, and checked against ours.

`render_template` renders a checkpoint's Jinja chat template the way transformers'
`apply_chat_template(..., tokenize=False)` does (same sandboxed environment, filters, globals and
message preparation), without importing transformers.

`check_chat_template` proves that a checkpoint's template and `ChatRenderer` agree on every
conversation shape a rollout produces, so that the policy is trained on exactly the tokens its
own chat format gives those conversations. Why only these shapes: a rollout is append-only
(token-in/token-out) and never re-renders, while a chat template renders the whole conversation
each time. The two agree only when the template is append-only on the shape, i.e. rendering
`messages[:k]` (with the generation header before an assistant turn) is a text prefix of
rendering `messages[:k+1]`. Qwen3's template is append-only on a tool episode (user query,
assistant turns with thinking and tool calls, tool results), but it drops the thinking of every
assistant turn before the last user query, so a user message after an assistant turn re-renders
history. That is why hints are inserted at token level in the teacher row (rendered as a message
of role `hint_role` right before the targeted assistant header) and never re-rendered through
the template; the check compares a hint against the template only where the template can agree:
as a user message before the first assistant turn.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from tg_jax.text.chat import ChatRenderer, Message, hint_message

QWEN3_TEMPLATE_PATH = os.path.join(os.path.dirname(__file__), "qwen3_chat_template.jinja")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # As transformers aliases them.
_WINDOW = 40  # Characters of context shown on each side of a difference.


class TemplateError(ValueError):
    """A chat template disagrees with `ChatRenderer` (or fails) on a conversation shape."""


def qwen3_chat_template() -> str:
    """Qwen3's official chat template text (as in the Qwen3 checkpoints' tokenizer_config.json)."""
    with open(QWEN3_TEMPLATE_PATH) as f:
        return f.read()


# Rendering, as transformers.utils.chat_template_utils does it.


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    """The template compiled in transformers' environment (`_cached_compile_jinja_template`)."""
    import jinja2  # Lazy: only checkpoints with a chat template need it.
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers tracks it)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """A namespace that refuses underscore attributes (no reach into CPython internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} not allowed")

    class Dict:
        """`dict(...)` and `dict.fromkeys(...)` without the type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Not Jinja's own tojson, which HTML-escapes.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception, strftime_now=strftime_now, dict=Dict(), namespace=Namespace
    )
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """Plain JSON-like copies of the inputs (transformers' `_plain_template_data`, for data)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    return value


def _prepare(message: Mapping[str, Any]) -> dict[str, Any]:
    """None-valued keys dropped, the reasoning copied under all its names (as transformers)."""
    m = {k: _plain(v) for k, v in message.items() if v is not None}
    reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
    if reasoning is not None:
        m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    return m


def render_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    enable_thinking: bool | None = None,
    **kw: Any,
) -> str:
    """The text of `messages` under a Hugging Face chat template, as transformers renders it.

    Equals `tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, ...)`, except
    that transformers also passes the tokenizer's special tokens (`bos_token`, `eos_token`, ...):
    pass them in `kw` for templates that use them.

    Args:
      template: the Jinja source (chat_template.jinja or tokenizer_config.json's chat_template).
      messages: chat messages (dicts with "role", "content", "reasoning_content", "tool_calls").
      tools: JSON schemas of the tools, or None.
      add_generation_prompt: append the header of the next assistant turn.
      enable_thinking: passed to the template when not None (Qwen3: False adds an empty
        `<think>` block after the generation header); None leaves it undefined.
      **kw: further template variables.
    Returns:
      The rendered text.
    Raises:
      jinja2.TemplateError: the template fails (e.g. its own `raise_exception`).
    """
    if enable_thinking is not None:
        kw["enable_thinking"] = enable_thinking
    return _compile(template).render(
        messages=[_prepare(m) for m in messages],
        tools=_plain(list(tools)) if tools is not None else None,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **_plain(kw),
    )


def template_variables(template: str) -> frozenset[str]:
    """Names the template reads from its context (e.g. "enable_thinking", "tools")."""
    import jinja2.meta

    env = _compile(template).environment
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))


# Checking a template against the append-only rendering.

_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the hidden tests on a Python function.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "The function's code."}},
                "required": ["code"],
            },
        },
    }
]
_SYSTEM: Message = {"role": "system", "content": "You are a careful coding agent."}
_USER: Message = {"role": "user", "content": "Write f(x) with f(1)=2 and f(2)=4. Héllo ✓ 数学."}


def _call(code: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "run_tests", "arguments": {"code": code}}}


_EPISODE: list[Message] = [
    {
        "role": "assistant",
        "reasoning_content": "Looks like doubling; test it first.",
        "content": "Let me run the tests.",
        "tool_calls": [_call("def f(x):\n    return 2 * x")],
    },
    {"role": "tool", "content": "1/2 tests passed: f(0) should be 1"},
    {
        "role": "assistant",
        "reasoning_content": "\nf(0)=1 too, so maybe 2**x.\n",
        "content": "",
        "tool_calls": [_call("def f(x):\n    return 2 ** x")],
    },
    {"role": "tool", "content": "2/2 tests passed"},
    {
        "role": "assistant",
        "reasoning_content": "All pass.",
        "content": "```python\ndef f(x):\n    return 2 ** x\n```",
    },
]


class _Shape(NamedTuple):
    name: str
    messages: list[Message]
    tools: list[dict[str, Any]] | None
    enable_thinking: bool | None


def _shapes(thinking_switch: bool) -> list[_Shape]:
    """The conversation shapes a rollout produces (prompts end with the generation header)."""
    modes: list[bool | None] = [True, False] if thinking_switch else [None]
    hint = hint_message("Call the tool with <tool_call> JSON, then answer in a code block.")
    shapes = []
    for on in modes:
        mode = "" if on is None else f", thinking {'on' if on else 'off'}"
        shapes.append(_Shape(f"prompt (user{mode})", [_USER], None, on))
        shapes.append(_Shape(f"prompt (system + tools{mode})", [_SYSTEM, _USER], _TOOLS, on))
    on = True if thinking_switch else None
    shapes.append(_Shape("tool episode", [_SYSTEM, _USER, *_EPISODE], _TOOLS, on))
    shapes.append(_Shape("hinted tool episode", [_SYSTEM, _USER, hint, *_EPISODE], _TOOLS, on))
    return shapes


def _window(text: str, at: int) -> str:
    return repr(text[max(0, at - _WINDOW) : at + _WINDOW])


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """First index where `a` and `b` differ (the shorter length if one extends the other)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), None if len(a) == len(b) else n)


class _State(NamedTuple):
    """A point a rollout passes through: messages[:end] (+ the generation header)."""

    end: int
    generation_prompt: bool
    ids: list[int]  # The append-only rendering, built as a rollout builds it.


def _rollout_states(renderer: ChatRenderer, shape: _Shape) -> list[_State]:
    """Before every assistant turn (with the header) and after it, as rollout.py appends."""
    msgs, header = shape.messages, renderer.assistant_header()
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    first = turns[0] if turns else len(msgs)
    ids = renderer.render_with_roles(
        msgs[:first], True, tools=shape.tools, enable_thinking=shape.enable_thinking is not False
    )[0]
    states = [_State(first, True, list(ids))]
    for k, i in enumerate(turns):
        turn = renderer.render_message(msgs[i])
        assert turn[: len(header)] == header, "an assistant turn starts with the header"
        ids = ids + turn[len(header) :]  # The sampled turn and the separator.
        states.append(_State(i + 1, False, ids))
        if k + 1 < len(turns):
            ids = ids + renderer.render_messages(msgs[i + 1 : turns[k + 1]]) + header
            states.append(_State(turns[k + 1], True, ids))
    return states


def _owner(renderer: ChatRenderer, shape: _Shape, text_pos: int) -> str:
    """ "message i (role)" whose append-only text holds character `text_pos`."""
    msgs = shape.messages
    for i in range(len(msgs)):
        ids = renderer.render_with_roles(msgs[: i + 1], tools=shape.tools)[0]
        if len(renderer.tokenizer.decode(ids)) > text_pos:
            return f"message {i} ({msgs[i]['role']})"
    return f"the generation header after message {len(msgs) - 1}"


def check_chat_template(renderer: ChatRenderer, template: str) -> None:
    """Raises TemplateError unless `template` renders every rollout shape as `renderer` does.

    Shapes (see the module docstring for why these): a user prompt and a system + tools prompt
    with the generation header (thinking on and off when the template reads `enable_thinking`);
    a tool episode (system, user, assistant with thinking and a tool call, tool result, assistant
    with thinking and a tool call, tool result, final assistant answer with thinking); the same
    with a hint (a message of role `renderer.hint_role`) before the first assistant turn.

    At every point the rollout passes through (the prompt with the header, after each assistant
    turn, after each observation with the next header) it checks that: the template's rendering
    extends its rendering at the previous point (append-only); its text equals the decoded
    append-only ids; and tokenizing its text gives exactly those ids (the tokenizer does not merge
    across message boundaries).

    Args:
      renderer: the chat renderer of the checkpoint's tokenizer.
      template: the checkpoint's Jinja chat template.
    Raises:
      TemplateError: naming the shape, the message and the first difference.
    """
    try:
        thinking_switch = "enable_thinking" in template_variables(template)
    except Exception as e:  # A template that does not even parse.
        raise TemplateError(f"chat template does not compile: {type(e).__name__}: {e}") from e
    for shape in _shapes(thinking_switch):
        previous = None
        for state in _rollout_states(renderer, shape):
            text = _render_state(template, renderer, shape, state)
            if previous is not None and not text.startswith(previous):
                _raise_not_append_only(renderer, shape, state, previous, text)
            ours = renderer.tokenizer.decode(state.ids)
            at = _first_difference(text, ours)
            if at is not None:
                raise TemplateError(
                    f"chat template differs from ChatRenderer on {_where(shape, state)}, in "
                    f"{_owner(renderer, shape, at)}, at character {at}: the template renders "
                    f"{_window(text, at)} where ChatRenderer has {_window(ours, at)}"
                )
            _check_ids(renderer, shape, state, text)
            previous = text


def _where(shape: _Shape, state: _State) -> str:
    header = " + generation header" if state.generation_prompt else ""
    return f"conversation {shape.name!r} (messages[:{state.end}]{header})"


def _render_state(template: str, renderer: ChatRenderer, shape: _Shape, state: _State) -> str:
    hint_role, tok = renderer.hint_role, renderer.tokenizer
    messages = [
        {**m, "role": hint_role} if m["role"] == "hint" else m for m in shape.messages[: state.end]
    ]
    try:
        return render_template(
            template,
            messages,
            tools=shape.tools,
            add_generation_prompt=state.generation_prompt,
            enable_thinking=shape.enable_thinking,
            # transformers passes the tokenizer's special tokens too.
            eos_token=tok.decode([tok.eos_id]),
            pad_token=tok.decode([tok.pad_id]),
        )
    except Exception as e:  # Template errors, raise_exception, type errors inside the template.
        raise TemplateError(
            f"chat template fails on {_where(shape, state)}: {type(e).__name__}: {e}"
        ) from e


def _raise_not_append_only(
    renderer: ChatRenderer, shape: _Shape, state: _State, previous: str, text: str
) -> None:
    at = _first_difference(previous, text)
    assert at is not None
    raise TemplateError(
        f"chat template is not append-only on {_where(shape, state)}: it re-renders "
        f"{_owner(renderer, shape, at)} at character {at}: the shorter conversation renders "
        f"{_window(previous, at)}, the longer one {_window(text, at)}. A rollout never "
        "re-renders earlier turns, so the policy would train on tokens its template never makes."
    )


def _check_ids(renderer: ChatRenderer, shape: _Shape, state: _State, text: str) -> None:
    tok = renderer.tokenizer
    ids = tok.encode(text)
    t = _first_difference(ids, state.ids)
    if t is None:
        return
    at = len(tok.decode(state.ids[:t]))
    raise TemplateError(
        f"tokenizing the template's text differs from ChatRenderer's per-message ids on "
        f"{_where(shape, state)}, in {_owner(renderer, shape, at)}, at token {t}: "
        f"{ids[t : t + 4]} (text {_window(tok.decode(ids), at)}) vs {state.ids[t : t + 4]}: "
        "the tokenizer merges text across a message boundary"
    )
