"""Code templates and identifier pools of the bug-fix repository generator.

A template is one small Python function with placeholders for its identifiers ({fn}, {a},
{b}, {c}, {acc}), a docstring, an input sampler and bug mutations: (family, correct fragment,
buggy fragment) text replacements inside the function. Train and held-out tasks use disjoint
templates and disjoint identifier pools, so held-out repositories are new code.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

BUG_FAMILIES = (
    "off_by_one",
    "operator",
    "comparison",
    "constant",
    "wrong_value",
    "swapped_args",  # a caller in another module passes the arguments in the wrong order
    "truncated",  # a module was cut short: the fix rewrites (overwrites) the whole file
)


@dataclasses.dataclass(frozen=True)
class Template:
    """One function template.

    Attributes:
      name: template id (the held-out bootstrap's cluster).
      arity: number of arguments ({a}, {b}, {c} in order).
      src: the function's source with placeholders.
      doc: one-line description (the docstring).
      sample: rng -> an argument tuple.
      bugs: (family, correct fragment, buggy fragment) mutations of `src`.
    """

    name: str
    arity: int
    src: str
    doc: str
    sample: Callable[[random.Random], tuple]
    bugs: tuple[tuple[str, str, str], ...]


def _ints(rng: random.Random, lo=0, hi=9, n=(2, 6)) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(*n))]


_WORDS = ("red", "Red", "blue", "BLUE", "green", "Green", "tea", "Tea")

TEMPLATES: dict[str, Template] = {
    t.name: t
    for t in (
        Template(
            "sum_upto",
            1,
            "def {fn}({a}):\n    {acc} = 0\n    for i in range({a} + 1):\n"
            "        {acc} += i\n    return {acc}\n",
            "Sum of the integers 0..{a}, inclusive.",
            lambda r: (r.randint(1, 30),),
            (
                ("off_by_one", "range({a} + 1)", "range({a})"),
                ("operator", "{acc} += i", "{acc} -= i"),
            ),
        ),
        Template(
            "count_over",
            2,
            "def {fn}({a}, {b}):\n    {acc} = 0\n    for v in {a}:\n        if v > {b}:\n"
            "            {acc} += 1\n    return {acc}\n",
            "How many items of {a} are greater than {b}.",
            lambda r: (_ints(r), r.randint(0, 9)),
            (("comparison", "v > {b}", "v >= {b}"), ("constant", "{acc} += 1", "{acc} += 2")),
        ),
        Template(
            "clamp",
            3,
            "def {fn}({a}, {b}, {c}):\n    if {a} < {b}:\n        return {b}\n"
            "    if {a} > {c}:\n        return {c}\n    return {a}\n",
            "{a} limited to the range {b}..{c}.",
            lambda r: (r.randint(-10, 20), r.randint(0, 5), r.randint(6, 12)),
            (
                ("wrong_value", "        return {c}\n", "        return {b}\n"),
                ("comparison", "if {a} < {b}:", "if {a} > {b}:"),
            ),
        ),
        Template(
            "mean_of",
            1,
            "def {fn}({a}):\n    if not {a}:\n        return 0\n    return sum({a}) / len({a})\n",
            "Arithmetic mean of {a} (0 for an empty list).",
            lambda r: (_ints(r, n=(1, 5)),),
            (
                ("off_by_one", "/ len({a})", "/ (len({a}) + 1)"),
                ("operator", "sum({a}) / len", "sum({a}) // len"),
            ),
        ),
        Template(
            "scale_all",
            2,
            "def {fn}({a}, {b}):\n    return [v * {b} for v in {a}]\n",
            "Every item of {a} multiplied by {b}.",
            lambda r: (_ints(r), r.randint(3, 9)),
            (("operator", "v * {b}", "v + {b}"),),
        ),
        Template(
            "last_items",
            2,
            "def {fn}({a}, {b}):\n    if {b} <= 0:\n        return []\n    return {a}[-{b}:]\n",
            "The last {b} items of {a}.",
            lambda r: (_ints(r, n=(3, 7)), r.randint(1, 3)),
            (
                ("off_by_one", "{a}[-{b}:]", "{a}[-{b} + 1:]"),
                ("comparison", "if {b} <= 0:", "if {b} <= 1:"),
            ),
        ),
        Template(
            "max_gap",
            1,
            "def {fn}({a}):\n    {acc} = 0\n    for i in range(1, len({a})):\n"
            "        {acc} = max({acc}, {a}[i] - {a}[i - 1])\n    return {acc}\n",
            "Largest increase between neighbouring items of {a}.",
            lambda r: (_ints(r, n=(3, 7)),),
            (
                ("off_by_one", "range(1, len({a}))", "range(2, len({a}))"),
                ("operator", "{a}[i] - {a}[i - 1]", "{a}[i - 1] - {a}[i]"),
            ),
        ),
        Template(
            "count_word",
            2,
            "def {fn}({a}, {b}):\n    return {a}.lower().split().count({b}.lower())\n",
            "How often the word {b} occurs in {a}, ignoring case.",
            lambda r: (
                " ".join(r.choice(_WORDS) for _ in range(r.randint(2, 6))),
                r.choice(_WORDS),
            ),
            (("wrong_value", "{a}.lower().split()", "{a}.split()"),),
        ),
        Template(
            "discount",
            2,
            "def {fn}({a}, {b}):\n    return round({a} * (100 - {b}) / 100, 2)\n",
            "Price {a} after a discount of {b} percent.",
            lambda r: (r.randint(1, 500), r.randint(5, 60)),
            (
                ("constant", "(100 - {b}) / 100", "(100 - {b}) / 10"),
                ("operator", "(100 - {b})", "(100 + {b})"),
            ),
        ),
        Template(
            "is_sorted",
            1,
            "def {fn}({a}):\n    for i in range(len({a}) - 1):\n"
            "        if {a}[i] > {a}[i + 1]:\n            return False\n    return True\n",
            "Whether {a} is in non-decreasing order.",
            lambda r: (sorted(_ints(r, 0, 4, (3, 6))) if r.random() < 0.6 else _ints(r, 0, 4),),
            (
                ("comparison", "{a}[i] > {a}[i + 1]", "{a}[i] >= {a}[i + 1]"),
                ("off_by_one", "range(len({a}) - 1)", "range(len({a}) - 2)"),
            ),
        ),
        Template(
            "running_total",
            1,
            "def {fn}({a}):\n    {acc} = []\n    total = 0\n    for v in {a}:\n"
            "        total += v\n        {acc}.append(total)\n    return {acc}\n",
            "Running sums of {a}.",
            lambda r: (_ints(r, 1, 9),),
            (("wrong_value", "{acc}.append(total)", "{acc}.append(v)"),),
        ),
        Template(
            "pair_sums",
            2,
            "def {fn}({a}, {b}):\n    return [x + y for x, y in zip({a}, {b})]\n",
            "Item-wise sums of {a} and {b}.",
            lambda r: (_ints(r, 2, 9, (3, 3)), _ints(r, 2, 9, (3, 3))),
            (("operator", "x + y", "x * y"),),
        ),
    )
}

HELDOUT_TEMPLATES = ("clamp", "max_gap", "discount", "running_total")
TRAIN_TEMPLATES = tuple(t for t in TEMPLATES if t not in HELDOUT_TEMPLATES)


@dataclasses.dataclass(frozen=True)
class NamePool:
    """Identifiers of one split: packages, modules, function words, argument names."""

    packages: tuple[str, ...]
    modules: tuple[str, ...]
    verbs: tuple[str, ...]
    nouns: tuple[str, ...]
    args: tuple[str, ...]
    accs: tuple[str, ...]


POOLS = {
    "train": NamePool(
        packages=("stockroom", "ledger", "garden", "harbor", "orchard", "kiln"),
        modules=("core", "ops", "util", "calc", "stats", "tools"),
        verbs=("get", "compute", "tally", "find", "make", "measure"),
        nouns=("orders", "crates", "seeds", "boats", "apples", "bricks"),
        args=("items", "limit", "count", "values", "low", "high", "size", "words"),
        accs=("total", "result", "acc"),
    ),
    "heldout": NamePool(
        packages=("meadow", "foundry", "atlas", "quarry"),
        modules=("engine", "helpers", "logic", "metrics"),
        verbs=("derive", "score", "probe", "assess"),
        nouns=("tiles", "ropes", "lamps", "coins"),
        args=("series", "bound", "amount", "data", "floor", "ceiling", "width", "text"),
        accs=("out", "answer", "running"),
    ),
    # Dev (validation, e.g. learning-rate trials): the training templates under names of its
    # own, so tuning never sees held-out code nor a training repository.
    "dev": NamePool(
        packages=("canyon", "bakery", "library"),
        modules=("main", "funcs", "parts"),
        verbs=("collect", "build", "gather"),
        nouns=("pebbles", "loaves", "books"),
        args=("entries", "cap", "number", "numbers", "lo", "hi", "length", "tokens"),
        accs=("sum_", "res", "agg"),
    ),
}
