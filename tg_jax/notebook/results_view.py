"""Reading a workdir's results back, as tables and plots (the results notebook's library).

Inputs are what the pipeline writes: `results.json` of the report (tg_jax.evaluation.report:
every run's curves and held-out episodes, and every derived number) and each run's
`metrics.jsonl` (tg_jax.metrics.read_metrics). Nothing here recomputes a statistic: the CIs
come from results.json as the report computed them.

Plots use `matplotlib.pyplot` with whatever backend is active (inline in a notebook) and return
their figure.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tg_jax import paths
from tg_jax.evaluation import report
from tg_jax.evaluation.stats import RATE_METRICS
from tg_jax.metrics import METRICS_FILE, last_per_step, read_metrics

SOURCES = {stage: (tmpl, title) for stage, tmpl, title in report.CURVE_SOURCES}


def find_results_file(workdir: str | os.PathLike) -> str:
    """Path of the report's results.json in `workdir`: at its top, in `report/`, or else the
    only one below it.

    Raises:
      FileNotFoundError: none, or several with none at the usual places.
    """
    workdir = os.fspath(workdir)
    root = paths.as_path(workdir)
    for candidate in (root, root / "report"):
        path = candidate / report.RESULTS_FILE
        if path.is_file():
            return os.fspath(path)
    found = sorted(
        os.fspath(d / report.RESULTS_FILE)
        for d, _, files in root.walk()
        if report.RESULTS_FILE in files
    )
    if len(found) != 1:
        what = "no" if not found else f"{len(found)} ({found})"
        raise FileNotFoundError(f"{what} {report.RESULTS_FILE} under {workdir}")
    return found[0]


def load_results(workdir: str | os.PathLike) -> dict[str, Any]:
    """The report's results.json of `workdir` (see `find_results_file`)."""
    return paths.read_json(find_results_file(workdir))


def load_run_metrics(workdir: str | os.PathLike) -> dict[str, list[dict[str, Any]]]:
    """Every metrics.jsonl under `workdir`, by directory relative to it ("." for the top).

    Records are deduplicated after resumes (the last one of each (stage, step) wins) and
    ordered by stage, then step.
    """
    root = paths.as_path(workdir)
    out = {}
    for d, _, files in sorted(root.walk(), key=lambda w: os.fspath(w[0])):
        if METRICS_FILE in files:
            out[os.fspath(d.relative_to(root))] = last_per_step(read_metrics(d))
    return out


def metric_curve(
    records: Sequence[Mapping[str, Any]], key: str, stage: str = "train"
) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of `key` in one run's records of `stage`, by step."""
    latest = {
        int(r["step"]): float(r[key]) for r in records if r.get("stage") == stage and key in r
    }
    steps = np.array(sorted(latest), np.int64)
    return steps, np.array([latest[s] for s in steps], np.float64)


def arm_curves(
    results: Mapping[str, Any], metric: str, source: str = "train"
) -> dict[str, dict[str, np.ndarray]]:
    """Per arm: the mean and std over training seeds of one curve of results.json.

    Args:
      results: `load_results` output.
      metric: "compliance", "task_success" or "joint".
      source: "train" (training rollouts, every step) or "eval" (periodic held-out evaluation).

    Returns:
      arm -> {"steps", "mean", "std", "n" (seeds)}, over the steps every seed logged.
    """
    tmpl, _ = SOURCES[source]
    key = f"{source}:{tmpl.format(metric)}"
    out = {}
    for arm in results["arms"]:
        curves = [
            dict(map(tuple, r["curves"].get(key, []))) for r in results["runs"] if r["arm"] == arm
        ]
        steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        if not steps:
            continue
        vals = np.array([[c[s] for s in steps] for c in curves], np.float64)
        out[arm] = {
            "steps": np.array(steps),
            "mean": vals.mean(0),
            "std": vals.std(0),
            "n": len(curves),
        }
    return out


def plot_arm_curves(
    results: Mapping[str, Any],
    metrics: Sequence[str] = report.CURVE_METRICS,
    sources: Sequence[str] = ("train", "eval"),
):
    """A grid of curves (rows: metrics, columns: sources), one line per arm with a +-1 std band
    over training seeds. Returns the figure."""
    import matplotlib.pyplot as plt  # noqa: PLC0415 (plots only)

    fig, axes = plt.subplots(
        len(metrics), len(sources), figsize=(5 * len(sources), 3 * len(metrics)), squeeze=False
    )
    for i, metric in enumerate(metrics):
        for j, source in enumerate(sources):
            ax = axes[i][j]
            for arm, c in arm_curves(results, metric, source).items():
                (line,) = ax.plot(c["steps"], c["mean"], label=f"{arm} (n={c['n']})")
                if c["n"] > 1:
                    ax.fill_between(
                        c["steps"],
                        c["mean"] - c["std"],
                        c["mean"] + c["std"],
                        color=line.get_color(),
                        alpha=0.2,
                    )
            ax.set_title(f"{metric.replace('_', ' ')}: {SOURCES[source][1]}", fontsize=10)
            ax.set_xlabel("training step")
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize=8)
    fig.suptitle("mean over training seeds; band = +-1 std over seeds (not a CI)", fontsize=10)
    fig.tight_layout()
    return fig


def heldout_rows(results: Mapping[str, Any], condition: str = "plain") -> list[dict[str, Any]]:
    """Held-out rates per arm with their bootstrap CIs over tasks (as the report computed).

    Returns:
      Rows {"arm", "group", "seeds", "tasks", "<metric>", "<metric>_low", "<metric>_high"} for
      each rate metric; arms without that condition are left out.
    """
    rows = []
    for arm, a in results["arms"].items():
        h = a.get("heldout", {}).get(condition)
        if not h:
            continue
        row = {"arm": arm, "group": a["group"], "seeds": len(a["seeds"]), "tasks": h["num_tasks"]}
        for m in RATE_METRICS:
            ci = h["bootstrap"].get(m) or {}
            row.update({m: ci.get("mean"), f"{m}_low": ci.get("low"), f"{m}_high": ci.get("high")})
        rows.append(row)
    return rows


def train_rows(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Last-K training-rollout mean and std per arm (step-to-step spread: NOT a CI)."""
    rows = []
    for arm, a in results["arms"].items():
        row = {"arm": arm, "group": a["group"]}
        for m in RATE_METRICS:
            t = a["train_last_k"].get(m) or {}
            row.update({m: t.get("mean"), f"{m}_std": t.get("std")})
        rows.append(row)
    return rows


def noninferiority_line(results: Mapping[str, Any]) -> str:
    """The headline verdict in one line ("" when the report has none)."""
    ni = results.get("noninferiority")
    if not ni:
        return ""
    s = results["settings"]
    num = lambda x: "n/a" if x is None else f"{x:+.3f}"
    return (
        f"non-inferiority of {s['candidate']} vs {s['baseline']} on held-out task success: "
        f"{ni['verdict'].upper()} (difference {num(ni.get('mean'))}, lower bound "
        f"{num(ni.get('lower'))} of the {ni.get('interval', '')} interval, margin "
        f"{num(ni.get('margin'))})"
    )


def plot_heldout(
    results: Mapping[str, Any],
    metrics: Sequence[str] = RATE_METRICS,
    conditions: Sequence[str] = ("plain", "hinted"),
):
    """Held-out rates per arm with bootstrap-CI error bars; one panel per condition.

    Returns the figure.
    """
    import matplotlib.pyplot as plt  # noqa: PLC0415 (plots only)

    level = results.get("settings", {}).get("level", 0.95)
    conditions = [c for c in conditions if heldout_rows(results, c)]
    fig, axes = plt.subplots(
        1, max(1, len(conditions)), figsize=(5 * max(1, len(conditions)), 3.4), squeeze=False
    )
    for ax, cond in zip(axes[0], conditions, strict=False):
        rows = heldout_rows(results, cond)
        width = 0.8 / max(1, len(rows))
        x = np.arange(len(metrics))
        for k, row in enumerate(rows):
            mean = np.array([np.nan if row[m] is None else row[m] for m in metrics], float)
            low = np.array(
                [np.nan if row[f"{m}_low"] is None else row[f"{m}_low"] for m in metrics], float
            )
            high = np.array(
                [np.nan if row[f"{m}_high"] is None else row[f"{m}_high"] for m in metrics], float
            )
            err = np.stack([mean - low, high - mean])
            ax.bar(
                x + (k - (len(rows) - 1) / 2) * width,
                mean,
                width,
                yerr=err,
                capsize=3,
                label=f"{row['arm']} (seeds {row['seeds']})",
            )
        ax.set_xticks(x, [m.replace("_", " ") for m in metrics])
        ax.set_ylim(0, 1.05)
        ax.set_title(
            f"held-out, {cond} prompts ({rows[0]['tasks']} tasks; "
            f"{round(100 * level)}% bootstrap CI over tasks)",
            fontsize=9,
        )
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_run_metric(
    run_metrics: Mapping[str, Sequence[Mapping[str, Any]]], key: str, stage: str = "train", ax=None
):
    """One line per run of `key` (e.g. "tg_kl", "loss"); runs without it are skipped. Returns
    the axes."""
    import matplotlib.pyplot as plt  # noqa: PLC0415 (plots only)

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3))
    for name, records in run_metrics.items():
        steps, values = metric_curve(records, key, stage)
        if len(steps):
            ax.plot(steps, values, label=name, lw=1)
    ax.set_title(f"{key} ({stage})", fontsize=10)
    ax.set_xlabel("training step")
    ax.grid(alpha=0.3)
    if ax.has_data():
        ax.legend(fontsize=7)
    ax.figure.tight_layout()
    return ax
