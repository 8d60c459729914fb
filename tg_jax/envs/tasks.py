"""Procedurally generated coding tasks: find a hidden integer function from 3 examples.

A task is a hidden function `f(x)` from one of a few families, shown through visible examples
(by default x = 0, 1 and one random x, so the constant and slope can be read off directly and
the third point tells families apart). Hidden tests are more inputs, including negative ones,
so a guess that only fits the visible points (e.g. `x+1` for `abs(x)+1` seen at x >= 0) fails.

Two family sets:
  * EASY_FAMILIES (the embedded default): one parameter each, `b = f(0)` in -64..64 is copied
    from the prompt (`b+x`, `b-x`, `b+abs(x)`, `b+x*x`); the family is read from f(1) and the third
    point, and is ambiguous when that point is positive (`x+b` vs `abs(x)+b`), which caps the
    pass rate of any policy below 1.
  * the two-parameter families (`lin`, `quad`, `abs`, `mod`, `max`, `min`): slopes must be
    computed (f(1) - f(0)); a 0.4M-parameter byte model trained for minutes solves few.

Splits are disjoint by construction: every function (family + parameters) belongs to exactly
one split, fixed by a stable hash, so no held-out function is ever seen in training. Tasks are
drawn in rounds, every family once per round, each family's functions without replacement
until all were drawn: the first n tasks of a split cover min(n, its functions) distinct
functions, balanced over families.
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from collections.abc import Callable, Sequence

SPLITS = ("train", "dev", "heldout")
HELDOUT_FRACTION = 0.2
DEV_FRACTION = 0.1  # of each family's functions: the SFT model-selection split
_B = tuple(range(-9, 10))
# The easy families' constants: 129 per family, so the held-out split has 4 x 26 = 104
# distinct functions (the bootstrap's independent units; with -9..9 it had 16).
_B1 = tuple((b,) for b in range(-64, 65))


@dataclasses.dataclass(frozen=True)
class Family:
    """A family of hidden functions.

    Attributes:
      name: short name, also used as the family label in transcripts.
      fn: (params, x) -> f(x).
      code: params -> the canonical Python source defining f.
      grid: every allowed parameter tuple.
    """

    name: str
    fn: Callable[[tuple[int, ...], int], int]
    code: Callable[[tuple[int, ...]], str]
    grid: tuple[tuple[int, ...], ...]


def _affine(a: int, term: str, b: int) -> str:
    """Canonical short expression for a*term+b, e.g. 'x+3', '-2*x', '2*abs(x)-1'."""
    head = {1: term, -1: "-" + term}.get(a, f"{a}*{term}")
    if b == 0:
        return head
    return f"{head}{b:+d}"


def _def(expr: str) -> str:
    return f"def f(x): return {expr}"


FAMILIES: dict[str, Family] = {
    fam.name: fam
    for fam in (
        Family(
            "lin",
            lambda p, x: p[0] * x + p[1],
            lambda p: _def(_affine(p[0], "x", p[1])),
            tuple((a, b) for a in (-3, -2, -1, 1, 2, 3) for b in _B),
        ),
        Family(
            "quad",
            lambda p, x: p[0] * x * x + p[1],
            lambda p: _def(_affine(p[0], "x*x", p[1])),
            tuple((a, b) for a in (-2, -1, 1, 2) for b in _B),
        ),
        Family(
            "abs",
            lambda p, x: p[0] * abs(x) + p[1],
            lambda p: _def(_affine(p[0], "abs(x)", p[1])),
            tuple((a, b) for a in (-2, -1, 1, 2) for b in _B),
        ),
        Family(
            "mod",
            lambda p, x: x % p[0] + p[1],
            lambda p: _def(_affine(1, f"x%{p[0]}", p[1])),
            tuple((m, b) for m in (2, 3, 4) for b in _B),
        ),
        Family(
            "max",
            lambda p, x: max(x, p[0]),
            lambda p: _def(f"max(x,{p[0]})"),
            tuple((c,) for c in range(-3, 6)),
        ),
        Family(
            "min",
            lambda p, x: min(x, p[0]),
            lambda p: _def(f"min(x,{p[0]})"),
            tuple((c,) for c in range(-3, 6)),
        ),
        # Constant first (`b+x`, `b-x`, `b+abs(x)`, `b+x*x`): the code starts with the exact
        # text of f(0) in the prompt, so solving is copying plus choosing the family.
        Family("add", lambda p, x: x + p[0], lambda p: _def(f"{p[0]}+x"), _B1),
        Family("sub", lambda p, x: p[0] - x, lambda p: _def(f"{p[0]}-x"), _B1),
        Family("vee", lambda p, x: abs(x) + p[0], lambda p: _def(f"{p[0]}+abs(x)"), _B1),
        Family("bowl", lambda p, x: x * x + p[0], lambda p: _def(f"{p[0]}+x*x"), _B1),
    )
}

# The embedded default's families (see the module docstring).
EASY_FAMILIES = ("add", "sub", "vee", "bowl")
# The two-parameter families.
HARD_FAMILIES = ("lin", "quad", "abs", "mod", "max", "min")


def check_families(families: Sequence[str]) -> tuple[str, ...]:
    """The family names as a tuple; a clear error for an empty list or an unknown name."""
    families = tuple(families)
    if not families:
        raise ValueError("tasks.families is empty: name at least one family")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown task families {unknown}; known: {sorted(FAMILIES)}")
    return families


def split_of(family: str, params: Sequence[int]) -> str:
    """The split a function belongs to, fixed forever by a stable hash of its identity.

    Within each family the functions are ordered by hash; the first HELDOUT_FRACTION go to
    "heldout", the next DEV_FRACTION to "dev" (SFT model selection: functions neither trained
    on nor tested on), the rest to "train". Every family has functions in each split, and the
    split never changes.
    """
    held, dev = _split_params(family)
    p = tuple(params)
    return "heldout" if p in held else "dev" if p in dev else "train"


def _key_hash(family: str, params: Sequence[int]) -> int:
    return zlib.crc32(f"{family}:{','.join(map(str, params))}".encode())


_SPLIT_CACHE: dict[str, tuple[frozenset, frozenset]] = {}


def _split_params(family: str) -> tuple[frozenset, frozenset]:
    """(held-out params, dev params) of a family."""
    if family not in _SPLIT_CACHE:
        grid = sorted(FAMILIES[family].grid, key=lambda p: _key_hash(family, p))
        n = max(1, round(HELDOUT_FRACTION * len(grid)))
        d = max(1, round(DEV_FRACTION * len(grid)))
        _SPLIT_CACHE[family] = (frozenset(grid[:n]), frozenset(grid[n : n + d]))
    return _SPLIT_CACHE[family]


@dataclasses.dataclass(frozen=True)
class Task:
    """One coding task.

    Attributes:
      task_id: unique id, e.g. "train/0/17".
      split: "train", "dev" or "heldout".
      family: key of FAMILIES.
      params: the family's parameters.
      visible: (x, f(x)) pairs shown in the prompt and used by run_tests.
      hidden: (x, f(x)) pairs used by submit.
    """

    task_id: str
    split: str
    family: str
    params: tuple[int, ...]
    visible: tuple[tuple[int, int], ...]
    hidden: tuple[tuple[int, int], ...]

    @property
    def prompt(self) -> str:
        """First user message, e.g. 'f(0)=3 f(1)=5 f(-2)=-1. Write f(x); run_tests, submit.'"""
        shown = " ".join(f"f({x})={y}" for x, y in self.visible)
        return f"{shown}. Write f(x); run_tests, submit."

    @property
    def function_id(self) -> str:
        """The hidden function's identity, e.g. "add:3": tasks sharing it are one cluster."""
        return f"{self.family}:{','.join(map(str, self.params))}"

    def fn(self, x: int) -> int:
        """The hidden function."""
        return FAMILIES[self.family].fn(self.params, x)

    def solution(self) -> str:
        """Canonical correct code, e.g. 'def f(x): return 2*x+3'."""
        return FAMILIES[self.family].code(self.params)

    def to_record(self) -> dict:
        """JSON-serialisable dict; inverse of Task.from_record."""
        return {
            "task_id": self.task_id,
            "split": self.split,
            "family": self.family,
            "params": list(self.params),
            "visible": [list(p) for p in self.visible],
            "hidden": [list(p) for p in self.hidden],
        }

    @classmethod
    def from_record(cls, record: dict) -> Task:
        """Validates and loads a record.

        Raises:
          ValueError: naming the first bad field (missing, wrong type, unknown family, wrong
            number of params, an example that disagrees with the function, wrong split).
        """
        if not isinstance(record, dict):
            raise ValueError(f"task record must be a dict, got {type(record).__name__}")
        for field in ("task_id", "split", "family", "params", "visible", "hidden"):
            if field not in record:
                raise ValueError(f"task record: missing field {field!r}")
        if not isinstance(record["task_id"], str) or not record["task_id"]:
            raise ValueError("task record: field 'task_id' must be a non-empty str")
        if record["split"] not in SPLITS:
            raise ValueError(f"task record: field 'split' must be one of {SPLITS}")
        if record["family"] not in FAMILIES:
            raise ValueError(f"task record: field 'family' must be one of {sorted(FAMILIES)}")
        family = FAMILIES[record["family"]]
        params = record["params"]
        if not (isinstance(params, (list, tuple)) and all(_is_int(p) for p in params)):
            raise ValueError("task record: field 'params' must be a list of ints")
        params = tuple(params)
        if params not in family.grid:
            raise ValueError(
                f"task record: field 'params' {list(params)} not valid for family {family.name!r}"
            )
        if split_of(family.name, params) != record["split"]:
            raise ValueError("task record: field 'split' disagrees with the function's split")
        pairs = {}
        for field in ("visible", "hidden"):
            val = record[field]
            ok = isinstance(val, (list, tuple)) and len(val) > 0
            ok = ok and all(
                isinstance(p, (list, tuple)) and len(p) == 2 and all(_is_int(v) for v in p)
                for p in val
            )
            if not ok:
                raise ValueError(
                    f"task record: field {field!r} must be a non-empty list of [x, y] int pairs"
                )
            for x, y in val:
                if family.fn(params, x) != y:
                    raise ValueError(
                        f"task record: field {field!r} has f({x})={y} but the "
                        f"function gives {family.fn(params, x)}"
                    )
            pairs[field] = tuple((int(x), int(y)) for x, y in val)
        return cls(record["task_id"], record["split"], family.name, params, **pairs)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def make_task(
    task_id: str,
    family: str,
    params: Sequence[int],
    visible_xs: Sequence[int],
    hidden_xs: Sequence[int],
) -> Task:
    """Builds a task from a function and inputs (outputs are computed)."""
    fam = FAMILIES[family]
    params = tuple(params)
    pairs = lambda xs: tuple((x, fam.fn(params, x)) for x in xs)
    return Task(
        task_id, split_of(family, params), family, params, pairs(visible_xs), pairs(hidden_xs)
    )


def generate_tasks(
    split: str,
    n: int,
    seed: int = 0,
    *,
    families: Sequence[str] = HARD_FAMILIES,
    anchors: Sequence[int] = (0, 1),
    n_visible: int = 3,
    n_hidden: int = 8,
    x_range: tuple[int, int] = (-3, 5),
    hidden_range: tuple[int, int] = (-9, 9),
) -> list[Task]:
    """Deterministic list of tasks of one split.

    Args:
      split: "train", "dev" or "heldout"; only functions of that split are drawn.
      n: number of tasks.
      seed: same (split, n, seed, knobs) -> same tasks.
      families: families to draw from (in rounds of every family in a shuffled order; each
        family's functions without replacement, reshuffled once all were drawn).
      anchors: visible inputs always shown first (read-off points for a small model).
      n_visible: total visible examples (anchors + random distinct xs from x_range).
      n_hidden: hidden tests, distinct xs from hidden_range not among the visible xs.
      x_range: inclusive range of the random visible xs.
      hidden_range: inclusive range of the hidden xs.

    Returns:
      n Tasks with ids f"{split}/{seed}/{i}".
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    families = check_families(families)
    rng = random.Random(f"tg_jax.envs.tasks:{split}:{seed}")
    pools = {}
    for name in families:
        pool = [p for p in FAMILIES[name].grid if split_of(name, p) == split]
        if pool:
            pools[name] = pool
    names = sorted(pools)
    decks: dict[str, list[tuple[int, ...]]] = {name: [] for name in names}
    order: list[str] = []
    tasks = []
    for i in range(n):
        if not order:
            order = rng.sample(names, len(names))
        family = order.pop()
        if not decks[family]:
            decks[family] = rng.sample(pools[family], len(pools[family]))
        params = decks[family].pop()
        free = [x for x in range(x_range[0], x_range[1] + 1) if x not in anchors]
        visible = list(anchors) + rng.sample(free, n_visible - len(anchors))
        pool = [x for x in range(hidden_range[0], hidden_range[1] + 1) if x not in visible]
        hidden = sorted(rng.sample(pool, n_hidden))
        tasks.append(make_task(f"{split}/{seed}/{i}", family, params, visible, hidden))
    return tasks


def heldout_functions(families: Sequence[str]) -> list[str]:
    """The `function_id`s of the held-out split's functions of `families`, sorted: the pool
    that registered attempts draw their held-out tasks from (`draw_heldout`)."""
    return sorted(
        f"{name}:{','.join(map(str, p))}"
        for name in check_families(families)
        for p in _split_params(name)[0]
    )


def draw_heldout(
    n: int,
    seed: int,
    n_functions: int,
    *,
    families: Sequence[str] = HARD_FAMILIES,
    exclude: Sequence[str] = (),
    anchors: Sequence[int] = (0, 1),
    n_visible: int = 3,
    n_hidden: int = 8,
    x_range: tuple[int, int] = (-3, 5),
    hidden_range: tuple[int, int] = (-9, 9),
) -> list[Task]:
    """A registered attempt's own held-out tasks: `n_functions` functions of the held-out
    split not in `exclude` (function ids: those read by earlier attempts of the claim, or
    trained on), balanced over families, and `n` tasks over them in turn (task i shows
    function i mod n_functions with its own visible and hidden inputs). Deterministic in
    (n, seed, n_functions, families, exclude, knobs); ids f"heldout/draw{seed}/{i}".

    Raises:
      ValueError: fewer than `n_functions` held-out functions are left outside `exclude`.
    """
    if n < 1 or n_functions < 1:
        raise ValueError(f"draw_heldout: n and n_functions must be >= 1, got {n}, {n_functions}")
    gone = set(exclude)
    rng = random.Random(f"tg_jax.envs.tasks:draw:{seed}")
    pools = {}
    for name in check_families(families):
        fresh = sorted(
            p for p in _split_params(name)[0] if f"{name}:{','.join(map(str, p))}" not in gone
        )
        if fresh:
            pools[name] = rng.sample(fresh, len(fresh))
    left = sum(map(len, pools.values()))
    if left < n_functions:
        raise ValueError(
            f"{left} held-out function(s) of {list(families)} are left outside the {len(gone)} "
            f"excluded (read by earlier attempts or trained on); an attempt draws {n_functions}"
        )
    picked: list[tuple[str, tuple[int, ...]]] = []
    while len(picked) < n_functions:  # rounds over the families with functions left
        for name in rng.sample(sorted(pools), len(pools)):
            if pools[name] and len(picked) < n_functions:
                picked.append((name, pools[name].pop()))
        pools = {k: v for k, v in pools.items() if v}
    free = [x for x in range(x_range[0], x_range[1] + 1) if x not in anchors]
    tasks = []
    for i in range(n):
        family, params = picked[i % n_functions]
        visible = list(anchors) + rng.sample(free, n_visible - len(anchors))
        pool = [x for x in range(hidden_range[0], hidden_range[1] + 1) if x not in visible]
        hidden = sorted(rng.sample(pool, n_hidden))
        tasks.append(make_task(f"heldout/draw{seed}/{i}", family, params, visible, hidden))
    return tasks
