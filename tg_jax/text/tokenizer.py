"""Tokenizers: a byte-level one for the embedded default model, and a wrapper for Qwen3's.

Both map the chat-format markers (`<|im_start|>`, `<think>`, `<tool_call>`, ...) to single
special ids wherever the literal string occurs in text, so rendering a conversation to text and
encoding it gives the same ids as the model's own chat template, and decoding gives the text back.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

# Markers of Qwen3's chat format, in the id order the byte tokenizer gives them (after 256 bytes).
BYTE_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)

IdsLike = Sequence[int] | np.ndarray


@runtime_checkable
class Tokenizer(Protocol):
    """What the rest of tg_jax needs from a tokenizer (text <-> ids, special ids)."""

    @property
    def vocab_size(self) -> int:
        """Number of ids the model's embedding must cover (may exceed the ids in use)."""
        ...

    @property
    def pad_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; literal special-token strings become their special ids; no BOS/EOS."""
        ...

    def decode(self, ids: IdsLike) -> str:
        """Text of `ids` (special tokens included as text); never raises on odd byte sequences."""
        ...

    def special_id(self, name: str) -> int:
        """Id of a special token by its literal string, e.g. "<|im_end|>"; KeyError if none."""
        ...


def token_at_char(tokenizer: Tokenizer, ids: IdsLike, offset: int) -> int:
    """Index in `ids` of the token that holds character `offset` of `tokenizer.decode(ids)`:
    the first i whose decoded prefix ids[: i + 1] is longer than `offset` (binary search);
    len(ids) when the text is not longer than `offset`."""
    ids = list(ids)
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[: mid + 1])) > offset:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then the chat specials of `BYTE_SPECIAL_TOKENS`.

    vocab_size is padded to a multiple of `pad_to` (272 by default); the padding ids decode to "".
    """

    def __init__(self, special_tokens: Sequence[str] = BYTE_SPECIAL_TOKENS, pad_to: int = 8):
        self._specials: dict[str, int] = {s: 256 + i for i, s in enumerate(special_tokens)}
        if len(self._specials) != len(special_tokens):
            raise ValueError(f"duplicate special tokens: {special_tokens}")
        self._by_id: dict[int, str] = {i: s for s, i in self._specials.items()}
        self._vocab_size = _round_up(256 + len(special_tokens), pad_to)
        # Longest first so that no special is matched as a prefix of a longer one.
        alternation = "|".join(re.escape(s) for s in sorted(special_tokens, key=len, reverse=True))
        self._split = re.compile(f"({alternation})")
        self._pad_id = self._specials.get("<|pad|>", self._specials["<|endoftext|>"])
        self._eos_id = self._specials["<|endoftext|>"]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:  # re.split puts the captured separators (the specials) at odd positions.
                ids.append(self._specials[piece])
            elif piece:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: IdsLike) -> str:
        parts: list[str] = []
        buf = bytearray()
        for t in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
            if 0 <= t < 256:
                buf.append(t)
                continue
            # Decode byte runs as a whole so multi-byte characters survive; sampled ids may form
            # invalid UTF-8, which becomes U+FFFD instead of an exception.
            parts.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            parts.append(self._by_id.get(t, ""))
        parts.append(buf.decode("utf-8", errors="replace"))
        return "".join(parts)

    def special_id(self, name: str) -> int:
        return self._specials[name]


def _token_content(value: object) -> str | None:
    """tokenizer_config.json stores tokens as strings or as {"content": ...} dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` (e.g. Qwen3's tokenizer.json) behind `Tokenizer`."""

    def __init__(
        self,
        tokenizer: object,
        *,
        eos_token: str = "<|im_end|>",
        pad_token: str = "<|endoftext|>",
        chat_template: str | None = None,
        vocab_size: int | None = None,
    ):
        """Wraps `tokenizer` (a `tokenizers.Tokenizer`).

        Args:
          eos_token, pad_token: literal strings of the EOS and padding tokens.
          chat_template: the checkpoint's Jinja chat template, kept for reference checks.
          vocab_size: the model's embedding size (Qwen3 pads 151,669 ids up to 151,936);
            defaults to the number of ids the tokenizer knows.
        """
        self._tok = tokenizer
        self._n_ids = tokenizer.get_vocab_size(with_added_tokens=True)
        self._added = frozenset(tokenizer.get_added_tokens_decoder())
        self._vocab_size = vocab_size if vocab_size is not None else self._n_ids
        if self._vocab_size < self._n_ids:
            raise ValueError(f"vocab_size {self._vocab_size} < tokenizer size {self._n_ids}")
        self._eos_id = self.special_id(eos_token)
        self._pad_id = self.special_id(pad_token)
        self.chat_template = chat_template

    @classmethod
    def from_dir(cls, path: str, *, vocab_size: int | None = None) -> HFTokenizer:
        """Loads `path/tokenizer.json` and, if present, `tokenizer_config.json` and
        `chat_template.jinja` (EOS / pad tokens and the chat template)."""
        import tokenizers  # Lazy: the byte tokenizer path must not need it.

        tok = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        config: dict = {}
        config_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(config_path):
            with open(config_path) as f:
                config = json.load(f)
        template = config.get("chat_template")
        if isinstance(template, list):  # Named templates: [{"name": ..., "template": ...}].
            template = {t["name"]: t["template"] for t in template}.get("default")
        template_path = os.path.join(path, "chat_template.jinja")
        if os.path.exists(template_path):
            with open(template_path) as f:
                template = f.read()
        eos = _token_content(config.get("eos_token")) or "<|im_end|>"
        pad = _token_content(config.get("pad_token")) or "<|endoftext|>"
        return cls(tok, eos_token=eos, pad_token=pad, chat_template=template, vocab_size=vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: IdsLike) -> str:
        flat = np.asarray(ids, dtype=np.int64).reshape(-1).tolist()
        # Embedding-padding ids (>= the tokenizer's size) can be sampled but have no text.
        known = [t for t in flat if 0 <= t < self._n_ids]
        return self._tok.decode(known, skip_special_tokens=False)

    def special_id(self, name: str) -> int:
        """Id of an added token (special or not) by its literal string; KeyError otherwise."""
        t = self._tok.token_to_id(name)
        if t is None:
            raise KeyError(f"token {name!r} is not in the vocabulary")
        if t not in self._added:
            raise KeyError(f"token {name!r} is not an added (special) token of the tokenizer")
        return t


def load_tokenizer(spec: str, *, vocab_size: int | None = None) -> Tokenizer:
    """`"byte"` -> ByteTokenizer; otherwise a directory holding a Hugging Face tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer.from_dir(spec, vocab_size=vocab_size)
