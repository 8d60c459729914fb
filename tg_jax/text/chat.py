"""Conversations as token ids, rendered by the model's own chat template, append-only.

The checkpoint's Jinja chat template is the source of truth for every token a run builds:
`ChatRenderer(tokenizer, template)` renders through it (`tg_jax.text.template.render_template`,
as transformers' `apply_chat_template` does). The embedded default takes the same path with its
byte tokenizer and Qwen3's template. A multi-turn rollout is token-in/token-out:

  prompt      the template's text for the messages before the first assistant turn (system
              with the tools block, user), tokenized in one go;
  header      what the template's generation prompt adds (`assistant_header`);
  turn        the tokens the sampler drew, kept verbatim, ending with the stop token;
  separator   what the template writes after the stop token ("\\n" in ChatML);
  appended    an observation, a hint or a user message: the text the template adds for it
              (the rendering with it minus the rendering without it), tokenized alone.

What a template adds is found by rendering probe conversations when the renderer is built;
`check_chat_template` replays the conversation shapes of a rollout and compares the assembled
tokens with the template's own rendering at every point a rollout passes through.

Templates that re-render history. Some templates change earlier turns as a conversation grows:
Qwen3's drops the thinking of every assistant turn before the last user message (a hint is one)
and gives a final answer without thinking an empty `<think>` block. The policy: what was sampled
is kept (the trainer sees exactly the sampled tokens), and where the template re-renders history
the check requires that the appended part (the new message and the header) renders identically,
i.e. that the template's text ends with it. A template where not even that holds fails with one
`TemplateError` naming the conversation, the message and the first difference.

Assistant messages: one given as plain `content` is a sampled turn, kept verbatim; one with
`reasoning_content` or `tool_calls` is written as the template writes it when it is the last
turn (its thinking block, its calls in the model's tool format).

Tool calls are written by the template and read back by `tool_format`
(`tg_jax.text.tool_formats`: detected from what the template writes, or named). Thinking:
`has_thinking` says whether the template renders `reasoning_content` at all (as
`<think>...</think>`); `split_thinking` marks those tokens.

A hint (`hint_message`) renders as a message of role `hint_role` ("user" by default); its
tokens carry `Role.HINT`, so removing them from a teacher sequence gives the student sequence.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypedDict

import numpy as np

from tg_jax.text import tool_formats
from tg_jax.text.template import (
    TemplateError,
    qwen3_chat_template,
    render_template,
    template_variables,
)
from tg_jax.text.tokenizer import IdsLike, Tokenizer

THINK_START, THINK_END = "<think>", "</think>"
_WINDOW = 40  # Characters of context shown on each side of a difference.
_PROBE_USER = "Probe question?"
_PROBE_ANSWER = "Probe answer."
_PROBE_THOUGHT = "Probe thought."
_PROBE_CALL = tool_formats.Call("probe_tool", {"code": "x = 1"})


class Message(TypedDict, total=False):
    """One chat message. `role` is "system" | "user" | "assistant" | "tool" | "hint"."""

    role: str
    content: str | None
    reasoning_content: str | None  # Assistant thinking, without the <think> tags.
    tool_calls: list[dict[str, Any]]  # [{"function": {"name": str, "arguments": dict | str}}]


class Role(enum.IntEnum):
    """Per-token segment codes of a rendered conversation."""

    PROMPT = 0  # System/user messages and template tokens (incl. the assistant header).
    THINK = 1  # An assistant turn's <think> ... </think> block, tags included.
    ANSWER = 2  # The rest of an assistant turn, up to and including its stop token.
    ENV = 3  # Tool / environment observation messages, whole.
    HINT = 4  # Hint messages, whole.


class Drift(NamedTuple):
    """Where the append-only rendering first differs from the one-shot template rendering."""

    message_index: int  # The message whose tokens differ.
    token_index: int  # The first differing position.


def hint_message(text: str) -> Message:
    """A hint, to insert right before a targeted assistant turn (in the teacher sequence)."""
    return {"role": "hint", "content": text}


def _content(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


def is_structured(message: Mapping[str, Any]) -> bool:
    """An assistant message the template writes (not a sampled text kept verbatim)."""
    return message.get("reasoning_content") is not None or bool(message.get("tool_calls"))


def text_window(text: str, at: int) -> str:
    return repr(text[max(0, at - _WINDOW) : at + _WINDOW])


def first_difference(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """First index where `a` and `b` differ (the shorter length if one extends the other)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), None if len(a) == len(b) else n)


def _call_message(call: tool_formats.Call) -> dict[str, Any]:
    fn = {"name": call.name, "arguments": call.arguments}
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": fn}],
    }


class ChatRenderer:
    """Renders conversations to token ids with one tokenizer and one chat template."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        template: str | None = None,
        *,
        hint_role: str = "user",
        tool_format: str | None = None,
        stop_ids: Sequence[int] = (),
    ):
        """Renders probe conversations to learn what the template adds (see the module).

        Args:
          tokenizer: the model's tokenizer.
          template: the Jinja chat template; None: Qwen3's (the embedded default's).
          hint_role: the chat role hint messages are rendered as ("user" or "system").
          tool_format: a registered tool-call format (`tool_formats.names()`); None: the one
            that reads back what the template writes (None when none does).
          stop_ids: further ids that end a sampled turn (generation_config's eos ids).
        Raises:
          TemplateError: the template fails, or a piece a rollout needs is not append-only.
        """
        self.tokenizer = tokenizer
        self.hint_role = hint_role
        self.template = template if template is not None else qwen3_chat_template()
        try:
            variables = template_variables(self.template)
        except Exception as e:  # A template that does not even parse.
            raise TemplateError(f"chat template does not compile: {type(e).__name__}: {e}") from e
        self.thinking_switch = "enable_thinking" in variables
        self._specials = {
            "eos_token": tokenizer.decode([tokenizer.eos_id]),
            "pad_token": tokenizer.decode([tokenizer.pad_id]),
        }
        self._base: list[Message] = [{"role": "user", "content": _PROBE_USER}]
        plain = self._render(self._base, "a user message")
        self._headers: dict[bool, str] = {}
        for on in (True, False):
            gen = self._render(self._base, "a user message + generation header", True, on)
            self._headers[on] = self._suffix(plain, gen, "the generation header")
        self.header_text = self._headers[True]
        self._gen = plain + self.header_text  # the probe prompt with the header
        probe = {"role": "assistant", "content": _PROBE_ANSWER}
        turn = self._turn_text(probe, require_tail=False)
        if _PROBE_ANSWER not in turn:
            raise TemplateError("chat template drops the content of an assistant message")
        self._tail = turn[turn.rindex(_PROBE_ANSWER) + len(_PROBE_ANSWER) :]
        stop_text = self._stop_text(self._tail)
        self.separator = self._tail[len(stop_text) :]
        self.separator_ids: list[int] = tokenizer.encode(self.separator)
        self._header_ids = tokenizer.encode(self.header_text)
        self._stop_id = tokenizer.special_id(stop_text)
        ends = [self._stop_id, *stop_ids]
        try:
            ends.append(tokenizer.special_id("<|endoftext|>"))
        except KeyError:
            pass
        self._end_ids = tuple(dict.fromkeys(int(i) for i in ends))
        self._probe_thinking()
        try:
            self.tool_calls_text = self._turn_text(_call_message(_PROBE_CALL))
        except TemplateError as e:
            self.tool_calls_text = f"(the template fails on a tool call: {e})"
        if tool_format:
            self.tool_format: tool_formats.ToolFormat | None = tool_formats.get(tool_format)
        else:
            self.tool_format = tool_formats.detect(self.tool_calls_text, [_PROBE_CALL])

    @property
    def think_end_id(self) -> int | None:
        """The id of </think>, which closes a thinking block (None: the template has none)."""
        return self._think_end

    # What the template makes of probe conversations.

    def _probe_thinking(self) -> None:
        """has_thinking: the template writes an assistant's reasoning_content; then the ids of
        <think> and </think> (the only thinking block supported)."""
        thought = self._turn_text(
            {"role": "assistant", "content": _PROBE_ANSWER, "reasoning_content": _PROBE_THOUGHT}
        )
        self.has_thinking = _PROBE_THOUGHT in thought
        self._think_start = self._think_end = None
        if not self.has_thinking:
            return
        k = thought.index(_PROBE_THOUGHT)
        if THINK_START not in thought[:k] or THINK_END not in thought[k:]:
            raise TemplateError(
                f"chat template writes thinking as {thought!r}: only <think>...</think> is "
                "supported"
            )
        try:
            self._think_start = self.tokenizer.special_id(THINK_START)
            self._think_end = self.tokenizer.special_id(THINK_END)
        except KeyError as e:
            raise TemplateError(f"the template writes <think> blocks but {e}") from e

    def _render(
        self,
        messages: Sequence[Mapping[str, Any]],
        what: str,
        add_generation_prompt: bool = False,
        enable_thinking: bool | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        chat = [self._as_chat_message(m) for m in messages]
        try:
            return render_template(
                self.template,
                chat,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                enable_thinking=enable_thinking if self.thinking_switch else None,
                **self._specials,
            )
        except Exception as e:  # Template errors, raise_exception, type errors inside it.
            raise TemplateError(f"chat template fails on {what}: {type(e).__name__}: {e}") from e

    @staticmethod
    def _suffix(before: str, after: str, what: str) -> str:
        """What `after` adds to `before`; TemplateError when it is not an extension."""
        if after.startswith(before):
            return after[len(before) :]
        at = first_difference(before, after)
        raise TemplateError(
            f"chat template is not append-only for {what}: at character {at} the shorter "
            f"conversation renders {text_window(before, at)}, the longer one "
            f"{text_window(after, at)}"
        )

    def _stop_text(self, tail: str) -> str:
        ids = self.tokenizer.encode(tail)
        first = self.tokenizer.decode(ids[:1])
        try:
            self.tokenizer.special_id(first)
        except KeyError:
            raise TemplateError(
                f"chat template ends an assistant turn with {tail!r}, which does not start with "
                "a special token of the tokenizer (the stop token a sampled turn ends with)"
            ) from None
        return first

    def _turn_text(self, message: Mapping[str, Any], *, require_tail: bool = True) -> str:
        """What the template writes for assistant `message` after the generation header, as the
        last turn of a conversation, stop token and separator included."""
        full = self._render([*self._base, message], "an assistant message")
        text = self._suffix(self._gen, full, "an assistant message after the generation header")
        if require_tail and not text.endswith(self._tail):
            raise TemplateError(
                f"chat template ends an assistant message with {text[-_WINDOW:]!r}, not with "
                f"{self._tail!r} as a plain one"
            )
        return text

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (renderers live as long as the run)
    def _piece(self, messages: tuple[tuple[str, str], ...]) -> str:
        """The text the template adds for non-assistant `messages` ((role, content) pairs)
        appended after an assistant turn, or after a user message when the template rewrites
        the assistant turn before them (Qwen3: its empty thinking block)."""
        chat = [{"role": role, "content": content} for role, content in messages]
        probe = {"role": "assistant", "content": _PROBE_ANSWER}
        errors = []
        for ctx in ([*self._base, probe], self._base):
            try:
                before = self._render(ctx, "a probe conversation")
                after = self._render([*ctx, *chat], f"a {chat[0]['role']} message")
                return self._suffix(before, after, f"a {chat[0]['role']} message")
            except TemplateError as e:
                errors.append(str(e))
        raise TemplateError(" / ".join(errors))

    # The model's format.

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """Ids that end a sampled assistant turn: the template's stop token first."""
        return self._end_ids

    def assistant_header(self) -> list[int]:
        """Ids of the generation header (thinking on), the prompt of the next assistant turn."""
        return list(self._header_ids)

    def turn_body(self, message: Message) -> str:
        """The text of assistant `message` between the header and the stop token, as a policy
        samples it: plain content verbatim, structured messages as the template writes them."""
        if not is_structured(message):
            return _content(message)
        return self._turn_text(message)[: -len(self._tail)]

    # One-shot rendering: the template on the whole conversation, history rewriting included.

    def prompt_text(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        enable_thinking: bool = True,
    ) -> str:
        """The template's text of `messages` (hints as `hint_role`)."""
        return self._render(
            messages, "the conversation", add_generation_prompt, enable_thinking, tools
        )

    def render_prompt(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        enable_thinking: bool = True,
    ) -> list[int]:
        """Ids of `prompt_text(...)`, tokenized in one go (as `apply_chat_template` does)."""
        text = self.prompt_text(
            messages, add_generation_prompt, tools=tools, enable_thinking=enable_thinking
        )
        return self.tokenizer.encode(text)

    # Append-only rendering: every message keeps its own tokens.

    def render_message(self, message: Message) -> list[int]:
        """Ids `message` adds when appended after a finished turn (an assistant message:
        header, turn, stop token and separator)."""
        return self.render_messages([message])

    def render_messages(self, messages: Sequence[Message]) -> list[int]:
        """Ids `messages` add when appended together; consecutive tool results share one
        piece (the template may group them)."""
        ids: list[int] = []
        for piece, _, _ in self._appended(messages, 0):
            ids += piece
        return ids

    def render_with_roles(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = False,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        enable_thinking: bool = True,
    ) -> tuple[list[int], list[int]]:
        """Append-only rendering of a whole conversation, with a `Role` code per token.

        Returns:
          (ids, role_ids), two lists of equal length T.
        """
        ids, roles, _ = self.render_with_owners(
            messages, add_generation_prompt, tools=tools, enable_thinking=enable_thinking
        )
        return ids, roles

    def render_with_owners(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = False,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        enable_thinking: bool = True,
    ) -> tuple[list[int], list[int], list[int]]:
        """`render_with_roles` plus, per token, the index in `messages` of the message it
        renders (the prompt's tokens: its last message's; a tool group's: its first's).

        The messages before the first assistant turn are the prompt, rendered by the template
        in one go, except hints at its end, which are appended pieces (a teacher's row minus
        its hint tokens is then the student's row).

        Returns:
          (ids, role_ids, owners), three lists of equal length T.
        """
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        first = len(messages) if first is None else first
        hints = first
        while hints > 0 and messages[hints - 1]["role"] == "hint":
            hints -= 1
        if any(m["role"] == "hint" for m in messages[:hints]):
            raise ValueError("a hint must come right before an assistant turn")
        ids: list[int] = []
        roles: list[int] = []
        owners: list[int] = []
        if hints or tools:
            text = self._render(messages[:hints], "the prompt", False, enable_thinking, tools)
            ids = self.tokenizer.encode(text)
            roles, owners = [int(Role.PROMPT)] * len(ids), [max(hints - 1, 0)] * len(ids)
        for piece, role, owner in self._appended(messages[hints:], hints):
            ids += piece
            roles += role
            owners += [owner] * len(piece)
        if add_generation_prompt:
            header = self.tokenizer.encode(self._headers[enable_thinking])
            ids += header
            roles += [int(Role.PROMPT)] * len(header)
            owners += [owners[-1] if owners else 0] * len(header)
        return ids, roles, owners

    def _appended(
        self, messages: Sequence[Message], offset: int
    ) -> list[tuple[list[int], list[int], int]]:
        """(ids, roles, message index) of each piece `messages` append (see the module)."""
        out = []
        i = 0
        while i < len(messages):
            m = messages[i]
            if m["role"] == "assistant":
                out.append(self._assistant_piece(m, offset + i))
                i += 1
                continue
            j = i + 1
            if m["role"] == "tool":
                while j < len(messages) and messages[j]["role"] == "tool":
                    j += 1
            elif m["role"] not in ("user", "system", "hint"):
                raise ValueError(f"unknown role {m['role']!r}")
            key = tuple((self._as_chat_message(x)["role"], _content(x)) for x in messages[i:j])
            piece = self.tokenizer.encode(self._piece(key))
            code = {"tool": Role.ENV, "hint": Role.HINT}.get(m["role"], Role.PROMPT)
            out.append((piece, [int(code)] * len(piece), offset + i))
            i = j
        return out

    def _assistant_piece(self, message: Message, owner: int) -> tuple[list[int], list[int], int]:
        """Header | turn (thinking, answer) | stop token | separator."""
        body = self.tokenizer.encode(self.turn_body(message)) + [self._stop_id]
        think = self.split_thinking(self._header_ids + body)[len(self._header_ids) :]
        ids = self._header_ids + body + self.separator_ids
        roles = [int(Role.PROMPT)] * len(self._header_ids)
        roles += [int(Role.THINK if t else Role.ANSWER) for t in think]
        roles += [int(Role.PROMPT)] * len(self.separator_ids)
        return ids, roles, owner

    def find_drift(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> Drift | None:
        """Where the append-only tokens of `messages` differ from the one-shot template's.

        None means a rollout that appended these messages one by one holds exactly the tokens
        the chat template gives the whole conversation.
        """
        ids, _, owners = self.render_with_owners(messages, add_generation_prompt, tools=tools)
        ref = self.render_prompt(messages, add_generation_prompt, tools=tools)
        t = first_difference(ids, ref)
        if t is None:
            return None
        owner = owners[min(t, len(owners) - 1)] if owners else 0
        return Drift(message_index=owner, token_index=t)

    def is_append_only(
        self, messages: Sequence[Message], *, tools: Sequence[dict[str, Any]] | None = None
    ) -> bool:
        """True when appending `messages` one by one gives the one-shot template's tokens."""
        return self.find_drift(messages, tools=tools) is None

    def split_thinking(self, ids: IdsLike) -> np.ndarray:
        """Marks `<think>` ... `</think>` blocks that open an assistant turn.

        A block opens at a <think> that starts `ids` or follows the assistant header, and ends at
        </think> (included); an unclosed block runs to the end of the turn (a stop token,
        padding or the end of `ids`, excluded). Nothing is marked when the template has no
        thinking.

        Args:
          ids: [T] or [B, T] token ids.
        Returns:
          bool array of the same shape.
        """
        arr = np.asarray(ids)
        if arr.ndim == 2:
            return np.stack([self.split_thinking(row) for row in arr]).reshape(arr.shape)
        mask = np.zeros(arr.shape, dtype=bool)
        if not self.has_thinking:
            return mask
        header = np.asarray(self._header_ids)
        stops = np.isin(arr, [self._think_end, *self.end_of_turn_ids, self.tokenizer.pad_id])
        stop_positions = np.flatnonzero(stops)
        for p in np.flatnonzero(arr == self._think_start):
            h = p - len(header)
            if p != 0 and not (h >= 0 and np.array_equal(arr[h:p], header)):
                continue
            after = stop_positions[stop_positions > p]
            if not len(after):
                mask[p:] = True
            else:
                q = int(after[0])
                mask[p : q + 1 if arr[q] == self._think_end else q] = True
        return mask

    def _as_chat_message(self, message: Mapping[str, Any]) -> Mapping[str, Any]:
        if message["role"] == "hint":
            return {**message, "role": self.hint_role}
        return message
