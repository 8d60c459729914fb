"""One registry of every pre-registered claim, and one error budget per claim.

A claim is what a verdict asserts: "in environment E with requirements R, the candidate arm's
held-out metric M is no worse than the baseline arm's by more than the margin, both trained
from the base model B". Its key is derived from those parts (`claim_key`; B by the sha256 of
its weight files, `protocol.weights_sha256`), not typed: renaming a hypothesis
(`eval.hypothesis`, a label only) keeps its claim, and any change of a part is a new claim.

A run that tests a claim sets `eval.hypothesis` (its label) and `eval.registry` (a JSONL
file; the project's is docs/preregistrations.jsonl). Before its first RL step the run appends
its registration (`register`):

    {"id": "<claim>#<k>", "claim", "attempt": k, "parts", "hypothesis", "date", "config" (the
     sha256 of the workdir's preregistration.json), "candidate", "baseline", "seeds",
     "margin", "level", "spend": {"alpha", "rule", "share"}, "heldout": {"seed", "units",
     "tasks"}, "interval", "machine", "earlier": [ids], "workdir", "outcome": null}

and when its verdict is known one line {"id", "date", "outcome": {"verdict", "difference",
"low", "level"}}. Lines are only ever appended; a reader merges them by id.

The error budget (the convention, also in docs/design.md): a claim has a total one-sided
alpha (1 - eval.level at its first registration: 0.05), spent over its attempts by a rule
fixed then ("alpha/2^k": attempt k spends alpha/2^k, so that the attempts together never
spend more than alpha). A verdict reads the lower bound of a two-sided interval, so attempt k,
spending the one-sided alpha_k, is decided at the two-sided level 1 - 2 alpha_k: 95% for the
first attempt, 97.5% for the second, 98.75% for the third (`corrected_level`). An attempt
spent the one-sided error of the level its verdict was decided at, nothing when it was
abandoned before any verdict, and its share while it is running; `budget` adds them up, and
an attempt that was decided at more than its share (earlier rules: Bonferroni, or no split at
all) is "superseded": its verdict does not stand under the claim's budget. A registration
whose share exceeds what is left is refused.

Each attempt draws its own held-out tasks (`heldout`): units (functions, repositories) read
by no earlier attempt of the claim and used in no training, from a seed fixed at
registration (`draw_seed`).

    python -m tg_jax.evaluation.registry [--registry=docs/preregistrations.jsonl]

prints every claim's attempts, what each spent, and what is left.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from tg_jax import paths
from tg_jax.errors import ConfigError

# How a claim's alpha is split over its attempts (k = 1, 2, ...): fixed at the first
# registration, recorded in every entry's "spend".
RULES: dict[str, Callable[[float, int], float]] = {"alpha/2^k": lambda alpha, k: alpha / 2**k}
DEFAULT_RULE = "alpha/2^k"
# The parts a claim's key is derived from (`claim_key`).
CLAIM_PARTS = ("env", "requirements", "metric", "margin", "candidate", "baseline", "base_sha256")
# An attempt's outcome: a report's verdict, or "abandoned" (stopped before its verdict, with
# the reason; it keeps its place among the attempts).
OUTCOMES = ("pass", "fail", "exploratory", "not meaningful", "undetermined", "abandoned")
DEFAULT_REGISTRY = "docs/preregistrations.jsonl"


class RegistryError(ConfigError):
    """A registration that the registry refuses (the budget spent, a bad file)."""


def read(path: str) -> dict[str, dict[str, Any]]:
    """{id: entry} with every later line merged into its entry (the last outcome wins)."""
    out: dict[str, dict[str, Any]] = {}
    p = paths.as_path(path)
    if not p.exists():
        return out
    for n, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            key = rec["id"]
        except (ValueError, KeyError, TypeError) as e:
            raise RegistryError(f"{path}:{n}: not a registry line ({e})") from e
        entry = out.setdefault(key, {})
        outcome = rec.get("outcome")
        entry.update({k: v for k, v in rec.items() if k not in ("outcome", "date")})
        entry.setdefault("date", rec.get("date"))
        if outcome is not None or "outcome" not in entry:
            entry["outcome"] = outcome
    return out


def claim_key(parts: dict[str, Any]) -> str:
    """The claim's key: 16 hex digits of the sha256 of its parts (`CLAIM_PARTS`, all of
    them, JSON with sorted keys; a margin as a float)."""
    missing = [k for k in CLAIM_PARTS if k not in parts]
    if missing:
        raise ValueError(f"claim parts missing: {missing}")
    plain = {k: parts[k] for k in CLAIM_PARTS}
    plain["margin"] = float(plain["margin"])
    plain["requirements"] = list(plain["requirements"])
    text = json.dumps(plain, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def claim_of(entry: dict[str, Any]) -> str:
    """An entry's claim: its "claim", else (a line from before derived keys) "legacy:" and its
    hypothesis."""
    return str(entry.get("claim") or f"legacy:{entry.get('hypothesis')}")


def claim_attempts(entries: dict[str, dict[str, Any]], claim: str) -> list[str]:
    """The ids of `claim`'s attempts, in order of registration."""
    return [k for k, e in entries.items() if claim_of(e) == claim]


def attempts(entries: dict[str, dict[str, Any]], hypothesis: str) -> list[str]:
    """The ids of the attempts labelled `hypothesis`, in order of registration."""
    return [k for k, e in entries.items() if e.get("hypothesis") == hypothesis]


def corrected_level(level: float, earlier: int) -> float:
    """The two-sided level of attempt `earlier + 1` of a claim whose alpha is 1 - `level`,
    under the rule alpha/2^k: 1 - 2 alpha / 2^(earlier + 1) (95%, 97.5%, 98.75%, ...)."""
    return 1.0 - 2.0 * RULES[DEFAULT_RULE](1.0 - float(level), int(earlier) + 1)


def one_sided(level: float) -> float:
    """The one-sided error of a verdict read from a two-sided interval at `level`."""
    return (1.0 - float(level)) / 2.0


def spent(entry: dict[str, Any]) -> float:
    """What the attempt spent of its claim's alpha (module docstring): the one-sided error of
    the level its verdict was decided at (the outcome's, else "decided_level", else the
    entry's level), 0 when abandoned, its share while no verdict is in."""
    outcome = entry.get("outcome")
    if outcome is None:
        return float((entry.get("spend") or {}).get("share", one_sided(entry.get("level", 0.95))))
    if outcome.get("verdict") == "abandoned":
        return 0.0
    level = outcome.get("level") or entry.get("decided_level") or entry.get("level")
    return one_sided(level)


def budget(entries: dict[str, dict[str, Any]], claim: str) -> dict[str, Any]:
    """{"claim", "alpha", "rule", "attempts": [{"id", "attempt", "share", "spent", "level",
    "verdict", "superseded"}], "spent", "left"}: the claim's alpha and rule are its first
    registration's (alpha 1 - that entry's level when it recorded none)."""
    ids = claim_attempts(entries, claim)
    if not ids:
        raise RegistryError(f"no registered attempt of claim {claim!r}")
    first = entries[ids[0]]
    spend = first.get("spend") or {}
    alpha = float(spend.get("alpha", 1.0 - float(first.get("level", 0.95))))
    rule = str(spend.get("rule", DEFAULT_RULE))
    rows, total = [], 0.0
    for k, key in enumerate(ids, start=1):
        e = entries[key]
        share, used = RULES[rule](alpha, k), spent(e)
        total += used
        outcome = e.get("outcome") or {}
        rows.append(
            {
                "id": key,
                "attempt": k,
                "share": share,
                "spent": used,
                "level": None
                if outcome.get("verdict") == "abandoned"
                else outcome.get("level") or e.get("decided_level") or e.get("level"),
                "verdict": outcome.get("verdict"),
                "superseded": used > share * (1 + 1e-9) and outcome.get("verdict") is not None,
            }
        )
    return {
        "claim": claim,
        "alpha": alpha,
        "rule": rule,
        "attempts": rows,
        "spent": total,
        "left": alpha - total,
    }


def describe_budget(b: dict[str, Any], label: str = "") -> list[str]:
    """Lines for a terminal: the claim, each attempt's share, spend and verdict, what is left."""
    head = (
        f"claim {b['claim']}{' (' + label + ')' if label else ''}: one-sided alpha "
        f"{b['alpha']:g} by {b['rule']}"
    )
    lines = [head]
    for r in b["attempts"]:
        level = f" at {r['level']:.4g}" if r["level"] else ""
        mark = "  SUPERSEDED (decided at more than its share)" if r["superseded"] else ""
        lines.append(
            f"  {r['id']}: share {r['share']:.5f}, spent {r['spent']:.5f}, "
            f"{r['verdict'] or 'no verdict yet'}{level}{mark}"
        )
    left = b["left"]
    lines.append(
        f"  spent {b['spent']:.5f}, left {max(left, 0.0):.5f}"
        + (f" (overspent by {-left:.5f})" if left < 0 else "")
    )
    return lines


def draw_seed(claim: str, attempt: int) -> int:
    """The held-out draw's seed of attempt `attempt` of `claim`: fixed by the registration,
    recomputable by anyone, chosen by no one."""
    return int(hashlib.sha256(f"{claim}#{int(attempt)}".encode()).hexdigest()[:8], 16)


def read_units(entries: dict[str, dict[str, Any]], ids: list[str]) -> list[str]:
    """The held-out units (function ids, repository fingerprints) that attempts `ids` drew."""
    out: list[str] = []
    for key in ids:
        out += list((entries[key].get("heldout") or {}).get("units") or [])
    return out


def check(ev: Any, workdir: str) -> None:
    """At start-up, before any work: a hypothesis needs a registry, which must read, and the
    ids in `ev.earlier` (optional: the registry finds a claim's attempts) must be in it."""
    del workdir
    if not ev.get("hypothesis"):
        return
    if not ev.get("registry"):
        raise RegistryError(
            f"eval.hypothesis={ev.hypothesis!r} needs eval.registry (a JSONL file, e.g. "
            f"{DEFAULT_REGISTRY})"
        )
    entries = read(ev.registry)
    unknown = [k for k in ev.get("earlier", ()) if k not in entries]
    if unknown:
        raise RegistryError(
            f"eval.earlier names {unknown}, which {ev.registry} does not hold; leave "
            "eval.earlier empty (the registry finds the claim's earlier attempts)"
        )


def _check_no_legacy(
    entries: dict[str, dict[str, Any]],
    known: list[str],
    claim: str,
    label: str,
    record: dict[str, Any],
) -> None:
    """A first attempt of a derived claim whose label, candidate and baseline name attempts
    registered before derived keys (keyed "legacy:<label>"): refused. Those attempts read a
    fixed held-out set (the first eval.num_tasks tasks of the split), not a recorded draw, so
    neither the alpha they spent nor the held-out tasks they read would carry over: the claim
    would start afresh on tasks it has already seen."""
    old = f"legacy:{label}"
    if known:  # the claim has derived attempts already: it was checked at its first
        return
    ids = [
        k
        for k in claim_attempts(entries, old)
        if (entries[k].get("candidate"), entries[k].get("baseline"))
        in ((record.get("candidate"), record.get("baseline")), (None, None))
    ]
    if not ids:
        return
    spent_alpha = budget(entries, old)["spent"]
    raise RegistryError(
        f"claim {claim} ({label}): the registry holds {len(ids)} attempt(s) of {old!r} from "
        f"before derived claim keys ({', '.join(ids)}; one-sided alpha spent "
        f"{spent_alpha:.5f}). They read a fixed held-out set, not a recorded draw: their "
        "spend and the tasks they read cannot be carried into this claim, so it would start "
        "afresh on held-out tasks it has seen. A new claim needs held-out tasks no attempt "
        "read (other tasks.families, or a task file) and a label of its own; else run it "
        "unregistered (no eval.hypothesis: exploratory)"
    )


def register(
    ev: Any,
    record: dict[str, Any],
    prereg_sha256: str,
    workdir: str,
    parts: dict[str, Any],
    draw: Callable[[int, list[str]], tuple[list[str], int]],
) -> dict[str, Any]:
    """Appends this run's registration to `ev.registry` once and returns its entry (a resumed
    run or a later sitting of the attempt finds its entry by the claim and the pre-registration's
    sha256). `draw(seed, exclude)` draws the attempt's held-out tasks: (their units, their
    count), none of `exclude` (the units of the claim's earlier attempts).

    Raises:
      RegistryError: the claim's alpha is spent (its share exceeds what is left), eval.level
        differs from the alpha fixed at the first registration, `ev.earlier` is given and is
        not the claim's earlier attempts, or the label names attempts registered before derived
        keys (`_check_no_legacy`).
    """
    claim = claim_key(parts)
    entries = read(ev.registry)
    known = claim_attempts(entries, claim)
    for key in known:
        if entries[key].get("config") == prereg_sha256:
            return entries[key]
    _check_no_legacy(entries, known, claim, str(ev.hypothesis), record)
    k = len(known) + 1
    level = float(record.get("level") if record.get("level") is not None else 0.95)
    if known:
        b = budget(entries, claim)
        alpha, rule = b["alpha"], b["rule"]
        if abs(alpha - (1.0 - level)) > 1e-12:
            raise RegistryError(
                f"claim {claim} ({ev.hypothesis}) has a one-sided alpha of {alpha:g}, fixed at "
                f"its first registration {known[0]}; set eval.level={1.0 - alpha:g} (attempt "
                f"{k} is then decided at its share)"
            )
        left = b["left"]
    else:
        alpha, rule, left = 1.0 - level, DEFAULT_RULE, 1.0 - level
    share = RULES[rule](alpha, k)
    if share > left * (1 + 1e-9):
        raise RegistryError(
            f"claim {claim} ({ev.hypothesis}) has {max(left, 0.0):.5f} of its alpha {alpha:g} "
            f"left, under attempt {k}'s share {share:.5f}: its budget is spent\n"
            + "\n".join(describe_budget(budget(entries, claim), str(ev.hypothesis)))
        )
    named = list(ev.get("earlier", ()))
    if named and sorted(named) != sorted(known):
        raise RegistryError(
            f"claim {claim} ({ev.hypothesis}) has the earlier attempts {known} in "
            f"{ev.registry}, not eval.earlier={named}; leave eval.earlier empty"
        )
    seed = draw_seed(claim, k)
    units, n_tasks = draw(seed, read_units(entries, known))
    entry = {
        "id": f"{claim}#{k}",
        "claim": claim,
        "attempt": k,
        "parts": parts,
        "hypothesis": ev.hypothesis,
        "date": datetime.date.today().isoformat(),
        "config": prereg_sha256,
        "candidate": record.get("candidate"),
        "baseline": record.get("baseline"),
        "seeds": list(record.get("seeds") or []),
        "margin": record.get("margin"),
        "level": 1.0 - 2.0 * share,
        "spend": {"alpha": alpha, "rule": rule, "share": share},
        "heldout": {"seed": seed, "units": list(units), "tasks": int(n_tasks)},
        "interval": record.get("ni_interval"),
        "machine": record.get("machine", ""),
        "earlier": known,
        "workdir": os.fspath(workdir),
        "outcome": None,
    }
    _append(ev.registry, entry)
    for line in describe_budget(budget(read(ev.registry), claim), str(ev.hypothesis)):
        print(f"registry: {line}")
    return entry


def record_outcome(registry: str, key: str, ni: dict[str, Any]) -> None:
    """Appends the verdict of attempt `key` (the report's noninferiority dict)."""
    outcome = {
        "verdict": ni.get("verdict"),
        "difference": ni.get("mean"),
        "low": ni.get("lower"),
        "level": ni.get("level"),
    }
    _append(registry, {"id": key, "date": datetime.date.today().isoformat(), "outcome": outcome})


def record_abandoned(registry: str, key: str, why: str) -> None:
    """Appends that attempt `key` was stopped before its verdict, and why."""
    if key not in read(registry):
        raise RegistryError(f"{registry}: no registered attempt {key!r}")
    outcome = {"verdict": "abandoned", "why": why}
    _append(registry, {"id": key, "date": datetime.date.today().isoformat(), "outcome": outcome})


def _append(path: str, rec: dict[str, Any]) -> None:
    p = paths.as_path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    text = p.read_text() if p.exists() else ""
    if text and not text.endswith("\n"):
        text += "\n"
    p.write_text(text + json.dumps(rec, sort_keys=True) + "\n")


def claims(entries: dict[str, dict[str, Any]]) -> dict[str, str]:
    """{claim: its latest label}, in order of first registration."""
    out: dict[str, str] = {}
    for e in entries.values():
        out[claim_of(e)] = str(e.get("hypothesis") or "")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--registry", default=DEFAULT_REGISTRY)
    parser.add_argument("--claim", default="", help="one claim (its key, or legacy:<label>)")
    args = parser.parse_args(argv)
    try:
        entries = read(args.registry)
    except RegistryError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for claim, label in claims(entries).items():
        if args.claim and claim != args.claim:
            continue
        print("\n".join(describe_budget(budget(entries, claim), label)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
