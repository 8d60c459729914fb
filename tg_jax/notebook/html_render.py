"""HTML for notebooks: token sequences coloured by role, mask or per-token value; small tables.

Every function returns an HTML string; a notebook shows it with `IPython.display.HTML`.
Token i is drawn as one span: its background is the colour of its `Role` (or, when `values`
are given, a white-to-red scale of its value), a thick outline marks tokens where `mask` is
set, and hovering shows its index, id, role, mask bit and value.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from tg_jax.text import Role, Tokenizer

ROLE_COLOURS: dict[Role, str] = {
    Role.PROMPT: "#e8e8e8",
    Role.THINK: "#fff1b8",
    Role.ANSWER: "#c6ecc6",
    Role.ENV: "#cfe3fa",
    Role.HINT: "#f9c7dd",
}
MASK_STYLE = "outline:2px solid #c62828;outline-offset:-1px;"
_SPAN = "padding:0 1px;margin:0;border-radius:2px;"
_BOX = (
    "font-family:monospace;font-size:12px;line-height:1.9;white-space:pre-wrap;"
    "word-break:break-all;border:1px solid #ccc;padding:6px;"
)


def token_texts(tokenizer: Tokenizer, ids: Sequence[int] | np.ndarray) -> list[str]:
    """The text of each token decoded on its own (a byte of a multi-byte character shows as
    U+FFFD; special tokens as their literal string)."""
    return [tokenizer.decode([int(t)]) for t in np.asarray(ids).reshape(-1)]


def _value_colour(value: float, max_value: float) -> str:
    """White (0) to red (max_value) background."""
    x = 0.0 if max_value <= 0 else float(np.clip(value / max_value, 0.0, 1.0))
    green_blue = int(round(255 * (1.0 - 0.75 * x)))
    return f"rgb(255,{green_blue},{green_blue})"


def _shown(text: str) -> str:
    """Escaped token text; newlines and tabs made visible."""
    return html.escape(text).replace("\n", "\u21b5\n").replace("\t", "\u2192\t")


def tokens_html(
    tokenizer: Tokenizer,
    ids: Sequence[int] | np.ndarray,
    *,
    roles: Sequence[int] | np.ndarray | None = None,
    mask: Sequence[bool] | np.ndarray | None = None,
    values: Sequence[float] | np.ndarray | None = None,
    max_value: float | None = None,
    value_name: str = "value",
    title: str = "",
) -> str:
    """A token sequence as coloured spans.

    Args:
      tokenizer: decodes each id.
      ids: [n] token ids.
      roles: [n] `Role` codes (background colour); ignored where `values` is given.
      mask: [n] bool, outlined tokens (e.g. the distillation mask, shifted to tokens).
      values: [n] floats (e.g. per-token divergences), background white -> red; NaN = no value.
      max_value: value drawn fully red; default the largest finite value.
      value_name: name of the value in the tooltip.
      title: a caption above the box.

    Returns:
      An HTML string.
    """
    ids = np.asarray(ids).reshape(-1)
    n = len(ids)
    for name, arr in (("roles", roles), ("mask", mask), ("values", values)):
        if arr is not None and len(arr) != n:
            raise ValueError(f"{name} has length {len(arr)}, ids has {n}")
    vals = None if values is None else np.asarray(values, np.float64)
    if vals is not None and max_value is None:
        finite = vals[np.isfinite(vals)]
        max_value = float(finite.max()) if finite.size else 0.0
    spans = []
    for i, (tok, text) in enumerate(zip(ids.tolist(), token_texts(tokenizer, ids), strict=True)):
        style, tip = _SPAN, [f"#{i}", f"id {tok}"]
        if roles is not None:
            role = Role(int(roles[i]))
            tip.append(role.name)
            if vals is None:
                style += f"background:{ROLE_COLOURS[role]};"
        if vals is not None and np.isfinite(vals[i]):
            style += f"background:{_value_colour(vals[i], max_value)};"
            tip.append(f"{value_name} {vals[i]:.4g}")
        if mask is not None and bool(mask[i]):
            style += MASK_STYLE
            tip.append("in mask")
        spans.append(f'<span style="{style}" title="{html.escape(" | ".join(tip))}">')
        spans.append(f"{_shown(text)}</span>")
    caption = f"<div><b>{html.escape(title)}</b></div>" if title else ""
    return f'{caption}<div style="{_BOX}">{"".join(spans)}</div>'


def legend_html(*, roles: bool = True, mask: bool = False, value_name: str | None = None) -> str:
    """A one-line legend for `tokens_html`."""
    items = []
    if roles:
        items += [
            f'<span style="{_SPAN}background:{c};">{r.name}</span>' for r, c in ROLE_COLOURS.items()
        ]
    if mask:
        items.append(f'<span style="{_SPAN}{MASK_STYLE}">in mask</span>')
    if value_name:
        low, high = _value_colour(0, 1), _value_colour(1, 1)
        items.append(
            f'<span style="{_SPAN}background:linear-gradient(to right,{low},{high});">'
            f"{html.escape(value_name)}: 0 &rarr; max</span>"
        )
    return '<div style="font-family:monospace;font-size:12px;">' + " ".join(items) + "</div>"


def _cell(value: Any, fmt: str | Callable[[Any], str] | None) -> str:
    if callable(fmt):
        return fmt(value)
    if fmt and isinstance(value, int | float | np.number) and not isinstance(value, bool):
        return format(value, fmt)
    return str(value)


def table_html(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str] | None = None,
    *,
    formats: Mapping[str, str | Callable[[Any], str]] | None = None,
    title: str = "",
) -> str:
    """A small HTML table of dict rows.

    Args:
      rows: one mapping per row.
      columns: keys to show, in order (default: the first row's keys).
      formats: column -> format spec for numbers (e.g. ".3f") or a callable value -> str.
      title: a caption.

    Returns:
      An HTML string.
    """
    columns = list(columns if columns is not None else (rows[0].keys() if rows else ()))
    formats = formats or {}
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in columns)
    body = "".join(
        "<tr>"
        + "".join(f"<td>{html.escape(_cell(r.get(c, ''), formats.get(c)))}</td>" for c in columns)
        + "</tr>"
        for r in rows
    )
    caption = f"<caption>{html.escape(title)}</caption>" if title else ""
    return f'<table style="font-size:12px;">{caption}<tr>{head}</tr>{body}</table>'
