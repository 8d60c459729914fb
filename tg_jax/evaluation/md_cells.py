"""Cells, rows and tables of report.md (`tg_jax.evaluation.markdown`): numbers, intervals, sizes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any


def num(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{digits}f}"


def ci(d: Mapping[str, Any] | None, digits: int = 2) -> str:
    if not d:
        return "n/a"
    return f"{num(d['mean'], digits)} [{num(d['low'], digits)}, {num(d['high'], digits)}]"


def pm(d: Mapping[str, Any] | None, digits: int = 2) -> str:
    if not d or d.get("n", 0) == 0:
        return "n/a"
    return f"{num(d['mean'], digits)} +- {num(d['std'], digits)}"


def minutes(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds / 60:.1f} min"


def big(x: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def arm_rows(res: Mapping[str, Any], group: str) -> list[str]:
    """The arms of `group` ("main", "stress", "ablation"), in their order: a table's rows."""
    return [a for a, v in res["arms"].items() if v["group"] == group]
