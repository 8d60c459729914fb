"""Checking that a checkpoint's chat template serves a rollout (`check_chat_template`).

A rollout builds its tokens piece by piece (the prompt, then per assistant turn the header, the
turn, its separator, then what follows); `tg_jax.text.chat.ChatRenderer` renders each piece with
the model's own template. This module replays the conversation shapes a rollout produces
(`episode_shapes`) through the template and raises `TemplateError` where the pieces do not
add up to the template's rendering of the whole conversation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tg_jax.text import chat, tool_formats
from tg_jax.text.chat import ChatRenderer, Message
from tg_jax.text.template import TemplateError

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
_HINT = chat.hint_message("Call the tool in the tool-call format, then answer in a code block.")


def _call(code: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "run_tests", "arguments": {"code": code}}}


def episode_shapes() -> list[tuple[str, list[Message], list[dict[str, Any]] | None]]:
    """The conversation shapes a rollout produces: (name, messages, tools)."""
    turns: list[Message] = [
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
    sampled: list[Message] = [
        {"role": "assistant", "content": "I will test it.\nCALL run_tests"},
        {"role": "tool", "content": "error: no tool call"},
        {"role": "assistant", "content": "Done."},
    ]
    return [
        ("prompt (user)", [_USER], None),
        ("prompt (system + tools)", [_SYSTEM, _USER], _TOOLS),
        ("tool episode", [_SYSTEM, _USER, *turns], _TOOLS),
        ("hinted tool episode", [_SYSTEM, _USER, _HINT, *turns[:2], _HINT, *turns[2:]], _TOOLS),
        ("sampled turns", [_USER, *sampled], None),
    ]


def check_chat_template(renderer: ChatRenderer) -> None:
    """Raises TemplateError unless `renderer`'s template serves every rollout shape.

    For each shape (`episode_shapes`) it builds the rollout's tokens as a rollout builds them
    (the prompt, then per assistant turn the header, the turn, its separator, then what follows
    it), and at each point checks against the template's rendering of the same messages:
    append-only points must match exactly (text, and the ids of tokenizing the text in one go:
    the tokenizer must not merge across pieces); where the template re-renders history (or
    rewrites a sampled turn, which stays as sampled), the template's text must end with what the
    rollout appended. Every tool call the template writes
    must read back through `renderer.tool_format`.

    Raises:
      TemplateError: naming the conversation, the message and the first difference.
    """
    tok = renderer.tokenizer
    for name, messages, tools in episode_shapes():
        if tools is not None and renderer.tool_format is None:
            raise TemplateError(
                f"no registered tool-call format reads back the calls this chat template writes "
                f"({renderer.tool_calls_text!r}); set model.tool_format or register one "
                f"(tg_jax.text.tool_formats: {', '.join(tool_formats.names())})"
            )
        previous_text, previous_ids, diverged = None, None, False
        for end, gen in _rollout_points(messages):
            where = f"conversation {name!r} (messages[:{end}]{' + header' if gen else ''})"
            ids = renderer.render_with_roles(messages[:end], gen, tools=tools)[0]
            text = renderer.prompt_text(messages[:end], gen, tools=tools)
            ours = tok.decode(ids)
            rerendered = previous_text is not None and not text.startswith(previous_text)
            diverged = diverged or rerendered
            last = messages[end - 1] if end else None
            if not diverged and not gen and last and not chat.is_structured(last) and text != ours:
                diverged = True  # the template rewrites a sampled turn, which stays as sampled
            elif not diverged:
                at = chat.first_difference(text, ours)
                if at is not None:
                    raise TemplateError(
                        f"chat template is not append-only on {where}, in "
                        f"{_owner(renderer, messages[:end], tools, at)}: at character {at} the "
                        f"template renders {chat.text_window(text, at)} where the rollout has "
                        f"{chat.text_window(ours, at)}"
                    )
                _check_ids(renderer, where, text, ids)
            else:
                added = tok.decode(ids[len(previous_ids) :])
                if not text.endswith(added):
                    at = chat.first_difference(text[len(text) - len(added) :], added)
                    raise TemplateError(
                        f"chat template re-renders {where} and does not end with what the "
                        f"rollout appended: {chat.text_window(added, at or 0)} vs the template's "
                        f"{chat.text_window(text[len(text) - len(added) :], at or 0)}"
                    )
            previous_text, previous_ids = text, ids
        for i, m in enumerate(messages):
            if m["role"] == "assistant" and m.get("tool_calls"):
                _check_calls(renderer, name, i, m)


def _rollout_points(messages: Sequence[Message]) -> list[tuple[int, bool]]:
    """(end, generation header) of each point a rollout passes through: before every assistant
    turn (with the header) and after it."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        return [(len(messages), True)]
    points = []
    for i in turns:
        points += [(i, True), (i + 1, False)]
    return points


def _owner(renderer, messages, tools, at: int) -> str:
    """ "message i (role)" whose rendering holds character `at`."""
    for i in range(len(messages)):
        try:
            text = renderer.prompt_text(messages[: i + 1], False, tools=tools)
        except TemplateError:
            continue
        if len(text) > at:
            return f"message {i} ({messages[i]['role']})"
    return f"the generation header after message {len(messages) - 1}"


def _check_ids(renderer: ChatRenderer, where: str, text: str, ids: list[int]) -> None:
    tok = renderer.tokenizer
    want = tok.encode(text)
    t = chat.first_difference(want, ids)
    if t is None:
        return
    at = len(tok.decode(ids[:t]))
    raise TemplateError(
        f"tokenizing the template's text differs from the rollout's pieces on {where} at token "
        f"{t}: {want[t : t + 4]} (text {chat.text_window(text, at)}) vs {ids[t : t + 4]}: the "
        "tokenizer merges text across a piece boundary"
    )


def _check_calls(renderer: ChatRenderer, name: str, i: int, message: Message) -> None:
    fmt = renderer.tool_format
    assert fmt is not None
    text = renderer.turn_body(message)
    want = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", ())
    ]
    got = [(c.name, c.arguments) for c in fmt.calls(text)]
    if got != want:
        raise TemplateError(
            f"the tool calls the chat template writes in conversation {name!r}, message {i} "
            f"({text!r}) do not read back through tool format {fmt.name!r}: {got} != {want}"
        )
