"""Hugging Face chat templates, rendered as transformers renders them.

`render_template` renders a checkpoint's Jinja chat template the way transformers'
`apply_chat_template(..., tokenize=False)` does (same sandboxed environment, filters, globals and
message preparation), without importing transformers. `tg_jax.text.chat.ChatRenderer` builds
every token sequence of a run from these renderings.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

QWEN3_TEMPLATE_PATH = os.path.join(os.path.dirname(__file__), "qwen3_chat_template.jinja")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # As transformers aliases them.


class TemplateError(ValueError):
    """A chat template that cannot render a run's conversations token-in/token-out."""


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
