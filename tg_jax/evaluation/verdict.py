"""A registered attempt's verdict from its results ledger alone (`tg_jax.evaluation.ledger`).

    python -m tg_jax.evaluation.verdict --attempt=<claim>#<k> [--registry=FILE] [--json]

reads <registry's dir>/ledger/<claim>/<k>/ (attempt.json and one file per finished (arm,
seed)), pairs the candidate's and the baseline's runs by training seed and held-out task, and
decides as the report does (`stats.compare_arms`: `stats.noninferiority_interval` at the
level the registry gave the attempt, pass iff its lower bound >= the margin, "exploratory"
under stats.MIN_SEEDS seeds, "not meaningful" when a baseline seed collapsed under the floor
or, with base.json, more than collapse_drop under the base model). Exit 0 with the verdict,
1 while (arm, seed) pairs are missing (listed), 2 on a bad attempt id or ledger.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from tg_jax.evaluation import ledger, registry
from tg_jax.evaluation.report_settings import ReportSettings

BASE_ARM = "base"  # report.BASE_REFERENCE: the base model's evaluation, base.json


def compute(directory: str) -> dict[str, Any]:
    """The verdict of the attempt in ledger `directory`: {"attempt", "verdict", "difference",
    "low", "high", "level", "margin", "seeds", "tasks", "clusters", "spent", "missing",
    "why", "per_seed"} ("verdict" None while pairs are missing).

    Raises:
      ledger.LedgerError: the directory is no ledger attempt, or its runs read other tasks.
    """
    from tg_jax.evaluation import stats  # noqa: PLC0415 (numpy / scipy only when computing)

    attempt, runs = ledger.read_attempt(directory)
    out: dict[str, Any] = {
        "attempt": attempt["id"],
        "hypothesis": attempt.get("hypothesis"),
        "candidate": attempt["candidate"],
        "baseline": attempt["baseline"],
        "margin": float(attempt["margin"]),
        "level": float(attempt["level"]),
        "spent": (attempt.get("spend") or {}).get("share"),
        "missing": [f"{a}_seed{s}" for a, s in ledger.missing(attempt, runs)],
        "verdict": None,
    }
    if out["missing"]:
        return out
    seeds = [int(s) for s in attempt["seeds"]]
    cand = {s: ledger.episodes(runs[(attempt["candidate"], s)]) for s in seeds}
    base = {s: ledger.episodes(runs[(attempt["baseline"], s)]) for s in seeds}
    base_run = runs.get((BASE_ARM, None))
    drop = attempt.get("collapse_drop")
    base_success = None
    if base_run is not None and drop is not None and float(drop) >= 0:
        _, table = stats.task_means(ledger.episodes(base_run))
        base_success = float(table["task_success"].mean())
    try:
        res = stats.compare_arms(
            cand,
            base,
            margin=out["margin"],
            floor=float(attempt.get("floor") or 0.0),
            base_success=base_success,
            collapse_drop=float(drop) if drop is not None else ReportSettings.collapse_drop,
            level=out["level"],
        )
    except ValueError as e:
        raise ledger.LedgerError(f"{directory}: {e}") from e
    ni, diff = res["noninferiority"], res["difference"]["task_success"]
    out.update(
        {
            "verdict": ni["verdict"],
            "difference": diff["mean"],
            "low": diff["low"],
            "high": diff["high"],
            "seeds": len(seeds),
            "clusters": diff["clusters"],
            "tasks": len(runs[(attempt["candidate"], seeds[0])]["outcomes"]),
            "why": ni.get("why"),
            "per_seed": res["per_seed"].get("task_success"),
            "base_success": base_success,
        }
    )
    return out


def describe(v: dict[str, Any]) -> str:
    """One line: the attempt, its verdict, the interval, the level and the alpha it spent."""
    head = (
        f"{v['attempt']} ({v.get('hypothesis') or 'no label'}): {v['candidate']} vs {v['baseline']}"
    )
    spent = f", one-sided alpha {v['spent']:.5f} of the claim's" if v.get("spent") else ""
    if v["verdict"] is None:
        return f"{head}: no verdict yet, missing {', '.join(v['missing'])}"

    def f(x: float) -> str:
        return "nan" if x is None or math.isnan(x) else f"{x:+.3f}"

    line = (
        f"{head}: {v['verdict']}: difference {f(v['difference'])} [{f(v['low'])}, "
        f"{f(v['high'])}] at level {v['level']:.4g}{spent}; margin {v['margin']:+g}; "
        f"{v['seeds']} seeds, {v['tasks']} tasks in {v['clusters']} clusters"
    )
    return line + (f" ({v['why']})" if v.get("why") else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--attempt", required=True, help="the attempt id, <claim>#<k>")
    parser.add_argument(
        "--registry",
        default=registry.DEFAULT_REGISTRY,
        help="the registry beside which the ledger lies",
    )
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON")
    args = parser.parse_args(argv)
    try:
        v = compute(ledger.dir_of(args.registry, args.attempt))
    except ledger.LedgerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(v, indent=1, sort_keys=True) if args.json else describe(v))
    return 0 if v["verdict"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
