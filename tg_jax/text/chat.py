"""Qwen3 chat format as token ids, append-only, with per-token role codes.

Two renderings of a conversation:

* `render_prompt` follows Qwen3's chat template exactly (it equals Hugging Face's
  `apply_chat_template(..., tokenize=True)` with Qwen3's template). Use it for the initial prompt
  of a rollout. The template rewrites history: it drops the thinking of assistant turns before
  the last user query, and gives the final assistant turn an empty `<think>` block when it has
  none, so the one-shot rendering of a grown conversation is not an extension of the earlier one.
* The append-only rendering (`render_message(s)`, `render_with_roles`) keeps exactly what each
  message was: an assistant turn keeps its thinking forever, as the sampler generated it. This is
  what a multi-turn rollout builds (token-in/token-out) and what the trainer sees; it is never
  re-rendered. `find_drift` says where the two renderings part, i.e. where re-rendering the
  conversation with the real template would change the tokens the policy was trained on.

A rollout appends, after a generated assistant turn (which ends with `<|im_end|>`):
`separator_ids` + `render_messages(observations)` + `assistant_header()`, then samples again.
A hint (`hint_message`) renders as an ordinary message of role `hint_role` ("user" by default);
its tokens carry `Role.HINT`, so removing them from a teacher sequence gives the student sequence.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from typing import Any, NamedTuple, TypedDict

import numpy as np

from tg_jax.text.tokenizer import IdsLike, Tokenizer

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
THINK_START, THINK_END = "<think>", "</think>"
SEPARATOR = "\n"  # What the template puts after every <|im_end|>.

_TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


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
    ANSWER = 2  # The rest of an assistant turn, up to and including its <|im_end|>.
    ENV = 3  # Tool / environment observation messages, whole (header to trailing separator).
    HINT = 4  # Hint messages, whole (header to trailing separator).


class Drift(NamedTuple):
    """Where the append-only rendering first differs from the one-shot template rendering."""

    message_index: int  # The message whose tokens differ.
    token_index: int  # The first differing position.


def hint_message(text: str) -> Message:
    """A hint, to insert right before a targeted assistant turn (in the teacher sequence)."""
    return {"role": "hint", "content": text}


def _content(message: Message) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


def _split_reasoning(message: Message) -> tuple[str, str]:
    """(reasoning, answer) of an assistant message, parsed the way Qwen3's template does."""
    content = _content(message)
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str):
        return reasoning, content
    if THINK_END in content:
        parts = content.split(THINK_END)
        return parts[0].rstrip("\n").split(THINK_START)[-1].lstrip("\n"), parts[-1].lstrip("\n")
    return "", content


def _think_block(reasoning: str) -> str:
    return f"{THINK_START}\n" + reasoning.strip("\n") + f"\n{THINK_END}"


def _tool_calls_text(tool_calls: Sequence[dict[str, Any]] | None, content: str) -> str:
    out = []
    for i, call in enumerate(tool_calls or ()):
        if i > 0 or content:
            out.append("\n")
        fn = call.get("function") or call
        args = fn.get("arguments")
        # Same as the template's `tojson` (json.dumps, ensure_ascii=False); strings go in as is.
        args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        call_json = f'{{"name": "{fn["name"]}", "arguments": {args_text}}}'
        out.append(f"<tool_call>\n{call_json}\n</tool_call>")
    return "".join(out)


def _system_block(system: Message | None, tools: Sequence[dict[str, Any]] | None) -> str:
    """The leading system message, which also lists the tools when there are any."""
    if not tools:
        return f"{IM_START}system\n{_content(system)}{IM_END}\n" if system else ""
    head = _content(system) + "\n\n" if system else ""
    listing = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return f"{IM_START}system\n{head}{_TOOLS_INTRO}{listing}{_TOOLS_OUTRO}"


def _is_tool_response(text: str) -> bool:
    return text.startswith("<tool_response>") and text.endswith("</tool_response>")


class ChatRenderer:
    """Renders Qwen3-format conversations to token ids for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer, *, hint_role: str = "user"):
        """Args: hint_role: the chat role hint messages are rendered as ("user" or "system")."""
        self.tokenizer = tokenizer
        self.hint_role = hint_role
        self.separator = SEPARATOR
        self.separator_ids: list[int] = tokenizer.encode(SEPARATOR)
        self._header_ids = tokenizer.encode(f"{IM_START}assistant\n")
        self._think_start = tokenizer.special_id(THINK_START)
        self._think_end = tokenizer.special_id(THINK_END)
        self._im_end = tokenizer.special_id(IM_END)
        self._end_of_text = tokenizer.special_id(END_OF_TEXT)

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """Ids that end a sampled assistant turn: <|im_end|> and <|endoftext|>."""
        return (self._im_end, self._end_of_text)

    def assistant_header(self) -> list[int]:
        """Ids of "<|im_start|>assistant\\n", the prompt for the next assistant turn."""
        return list(self._header_ids)

    # One-shot rendering: Qwen3's chat template, history rewriting included.

    def prompt_text(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        enable_thinking: bool = True,
    ) -> str:
        """The text Qwen3's chat template makes of `messages` (hints as `hint_role`)."""
        msgs = [self._as_chat_message(m) for m in messages]
        first_system = msgs[0] if msgs and msgs[0]["role"] == "system" else None
        out = [_system_block(first_system, tools)]
        last_query = len(msgs) - 1
        for i in reversed(range(len(msgs))):
            content = msgs[i].get("content")
            if msgs[i]["role"] == "user" and isinstance(content, str):
                if not _is_tool_response(content):
                    last_query = i
                    break
        for i, m in enumerate(msgs):
            role, content = m["role"], _content(m)
            if role == "user" or (role == "system" and i > 0):
                out.append(f"{IM_START}{role}\n{content}{IM_END}\n")
            elif role == "assistant":
                reasoning, content = _split_reasoning(m)
                # Thinking survives only after the last user query, and the final assistant
                # turn always shows a <think> block.
                if i > last_query and (i == len(msgs) - 1 or reasoning):
                    out.append(f"{IM_START}assistant\n" + _think_block(reasoning))
                    out.append("\n\n" + content.lstrip("\n"))
                else:
                    out.append(f"{IM_START}assistant\n{content}")
                out.append(_tool_calls_text(m.get("tool_calls"), content) + f"{IM_END}\n")
            elif role == "tool":
                if i == 0 or msgs[i - 1]["role"] != "tool":
                    out.append(f"{IM_START}user")
                out.append(f"\n<tool_response>\n{content}\n</tool_response>")
                if i == len(msgs) - 1 or msgs[i + 1]["role"] != "tool":
                    out.append(f"{IM_END}\n")
            elif role != "system":
                raise ValueError(f"unknown role {role!r}")
        if add_generation_prompt:
            out.append(self._generation_prompt(enable_thinking))
        return "".join(out)

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
        """Ids `message` adds when appended after a separator (ends with <|im_end|> "\\n")."""
        return self.render_messages([message])

    def render_messages(self, messages: Sequence[Message]) -> list[int]:
        """Ids `messages` add when appended together; consecutive tool results share one block."""
        segments = self._segments(messages, tools=None, start=False)
        return self._encode(segments, add_generation_prompt=False, enable_thinking=True)[0]

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
        renders (a system block's tokens: 0; consecutive tool results: the first one's).

        Returns:
          (ids, role_ids, owners), three lists of equal length T.
        """
        segments = self._segments(messages, tools=tools, start=True)
        return self._encode(segments, add_generation_prompt, enable_thinking)

    def find_drift(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> Drift | None:
        """Where the append-only tokens of `messages` differ from the one-shot template's.

        None means a rollout that appended these messages one by one holds exactly the tokens
        the real chat template gives the whole conversation.
        """
        segments = self._segments(messages, tools=tools, start=True)
        ids, _, owners = self._encode(segments, add_generation_prompt, enable_thinking=True)
        ref = self.render_prompt(messages, add_generation_prompt, tools=tools)
        n = min(len(ids), len(ref))
        diff = [i for i in range(n) if ids[i] != ref[i]][:1]
        if not diff and len(ids) == len(ref):
            return None
        t = diff[0] if diff else n
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
        </think> (included); an unclosed block runs to the end of the turn (<|im_end|>,
        <|endoftext|>, padding or the end of `ids`, excluded). Note that with
        `enable_thinking=False` the empty block in the generation prompt is marked too.

        Args:
          ids: [T] or [B, T] token ids.
        Returns:
          bool array of the same shape.
        """
        arr = np.asarray(ids)
        if arr.ndim == 2:
            return np.stack([self.split_thinking(row) for row in arr]).reshape(arr.shape)
        mask = np.zeros(arr.shape, dtype=bool)
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

    # Internals.

    def _as_chat_message(self, message: Message) -> Message:
        if message["role"] == "hint":
            return {**message, "role": self.hint_role}
        return message

    def _generation_prompt(self, enable_thinking: bool) -> str:
        empty_think = "" if enable_thinking else f"{THINK_START}\n\n{THINK_END}\n\n"
        return f"{IM_START}assistant\n{empty_think}"

    def _segments(
        self, messages: Sequence[Message], *, tools: Sequence[dict[str, Any]] | None, start: bool
    ) -> list[tuple[str, Role, int]]:
        """(text, role, message index) pieces; each piece is tokenized on its own.

        Pieces meet at special tokens (<|im_start|>, </think>, <|im_end|>) or at the header's
        "\\n", so tokenizing them apart matches tokenizing the whole text for Qwen3's tokenizer.
        """
        segs: list[tuple[str, Role, int]] = []
        i = 0
        if start and (tools or (messages and messages[0]["role"] == "system")):
            first_system = messages[0] if messages and messages[0]["role"] == "system" else None
            segs.append((_system_block(first_system, tools), Role.PROMPT, 0))
            i = 1 if first_system else 0
        while i < len(messages):
            m, role = messages[i], messages[i]["role"]
            if role == "assistant":
                segs.extend((text, r, i) for text, r in self._assistant_pieces(m))
            elif role == "tool":
                j = i
                while j < len(messages) and messages[j]["role"] == "tool":
                    j += 1
                body = "".join(
                    f"\n<tool_response>\n{_content(t)}\n</tool_response>" for t in messages[i:j]
                )
                segs.append((f"{IM_START}user{body}{IM_END}\n", Role.ENV, i))
                i = j
                continue
            elif role in ("user", "system", "hint"):
                chat_role = self.hint_role if role == "hint" else role
                code = Role.HINT if role == "hint" else Role.PROMPT
                segs.append((f"{IM_START}{chat_role}\n{_content(m)}{IM_END}\n", code, i))
            else:
                raise ValueError(f"unknown role {role!r}")
            i += 1
        return segs

    def _assistant_pieces(self, message: Message) -> list[tuple[str, Role]]:
        """Header | think block | answer + <|im_end|> | separator, as generated."""
        content = _content(message)
        reasoning = message.get("reasoning_content")
        if isinstance(reasoning, str):
            think = _think_block(reasoning)
            answer = "\n\n" + content.lstrip("\n")
        elif content.startswith(THINK_START) and THINK_END in content:
            k = content.index(THINK_END) + len(THINK_END)
            think, answer = content[:k], content[k:]
        else:
            think, answer = "", content
        answer += _tool_calls_text(message.get("tool_calls"), _split_reasoning(message)[1])
        pieces = [(f"{IM_START}assistant\n", Role.PROMPT)]
        if think:
            pieces.append((think, Role.THINK))
        pieces += [(answer + IM_END, Role.ANSWER), (SEPARATOR, Role.PROMPT)]
        return pieces

    def _encode(
        self,
        segments: list[tuple[str, Role, int]],
        add_generation_prompt: bool,
        enable_thinking: bool,
    ) -> tuple[list[int], list[int], list[int]]:
        """(ids, role per token, message index per token)."""
        if add_generation_prompt:
            owner = segments[-1][2] if segments else 0
            segments = [*segments, (self._generation_prompt(enable_thinking), Role.PROMPT, owner)]
        ids: list[int] = []
        roles: list[int] = []
        owners: list[int] = []
        for text, role, owner in segments:
            piece = self.tokenizer.encode(text)
            ids += piece
            roles += [int(role)] * len(piece)
            owners += [owner] * len(piece)
        return ids, roles, owners
