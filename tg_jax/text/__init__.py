"""Tokenizers, chat templates as renderers (token-in/token-out, append-only), tool formats."""

from tg_jax.text.byte_hf import write_byte_tokenizer
from tg_jax.text.chat import ChatRenderer, Drift, Message, Role, hint_message
from tg_jax.text.template import TemplateError, qwen3_chat_template, render_template
from tg_jax.text.template_check import check_chat_template
from tg_jax.text.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "ChatRenderer",
    "Drift",
    "HFTokenizer",
    "Message",
    "Role",
    "TemplateError",
    "Tokenizer",
    "check_chat_template",
    "hint_message",
    "load_tokenizer",
    "qwen3_chat_template",
    "render_template",
    "write_byte_tokenizer",
]
