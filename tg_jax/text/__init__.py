"""Tokenizers and Qwen3 chat rendering (token-in/token-out, append-only)."""

from tg_jax.text.chat import ChatRenderer, Drift, Message, Role, hint_message
from tg_jax.text.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "ChatRenderer",
    "Drift",
    "HFTokenizer",
    "Message",
    "Role",
    "Tokenizer",
    "hint_message",
    "load_tokenizer",
]
