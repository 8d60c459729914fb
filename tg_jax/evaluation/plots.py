"""Report figures: training curves per arm group, the held-out differences forest plot, the
learning-rate trials and where an RL step's time goes.

Inputs are `tg_jax.evaluation.report.compute_results` dicts (or their results.json).
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np

from tg_jax.paths import as_path

CURVE_METRICS = ("compliance", "task_success")
CURVE_SOURCES = (("train", "rollout/{}", "training rollouts"), ("eval", "heldout/{}", "held-out"))
ACTIONS_PREFIX = "actions/"  # rollout/actions/<a>, heldout/actions/<a>: per-episode counts
ACTIONS_FIGURE = "actions"  # curve_actions.png (curve_file)


def action_names(res: dict[str, Any]) -> list[str]:
    """The actions with a curve in any run of `res` (e.g. run_tests, submit, malformed)."""
    names = set()
    for r in res["runs"]:
        for key in r["curves"]:
            metric = key.split(":", 1)[1]
            for _, tmpl, _ in CURVE_SOURCES:
                prefix = tmpl.format(ACTIONS_PREFIX)
                if metric.startswith(prefix):
                    names.add(metric[len(prefix) :])
    return sorted(names)


def curve_groups(res: dict[str, Any]) -> dict[str, list[str]]:
    """Arms per curve figure: "main" has the main group (and the baseline); every other group
    (ablation, stress) gets its own figure with the baseline and the candidate as references.
    Eight arms on one axis are unreadable; a figure per question is not."""
    st = res["settings"]
    groups: dict[str, list[str]] = {}
    for arm, a in res["arms"].items():
        groups.setdefault(a.get("group") or "main", []).append(arm)
    refs = [a for a in (st["baseline"], st["candidate"]) if a in res["arms"]]
    out = {"main": list(dict.fromkeys(refs + groups.pop("main", [])))}
    for group, arms in groups.items():
        out[group] = list(dict.fromkeys(refs + arms))
    return out


def curve_file(metric: str, group: str) -> str:
    """curve_<metric>.png for the main group, curve_<metric>_<group>.png for the others."""
    return f"curve_{metric}.png" if group == "main" else f"curve_{metric}_{group}.png"


def _plot_seed_band(ax: Any, res: dict[str, Any], arm: str, key: str, style: str) -> None:
    """One arm's curve `key`: mean over seeds at the steps every seed has, +-1 std band."""
    runs = [r for r in res["runs"] if r["arm"] == arm]
    curves = [dict(map(tuple, r["curves"].get(key, []))) for r in runs]
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    if not steps:
        return
    vals = np.array([[c[s] for s in steps] for c in curves])
    mean, std = vals.mean(0), vals.std(0)
    (line,) = ax.plot(steps, mean, style, label=f"{arm} (n={len(curves)})")
    if len(curves) > 1:
        ax.fill_between(steps, mean - std, mean + std, alpha=0.2, color=line.get_color())


def plot_curves(res: dict[str, Any], out_dir: str) -> list[str]:
    """Per curve group (`curve_groups`) and metric: per arm, mean over seeds with a +-1 std band
    (steps all seeds have); reference arms of a non-main group are drawn dashed. With logged
    actions, one more figure per group: curve_actions[_<group>].png, one row per action
    (counts per episode, e.g. whether a policy still runs the tests before it submits)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    refs = {res["settings"]["baseline"], res["settings"]["candidate"]}
    actions = action_names(res)
    for group, group_arms in curve_groups(res).items():
        figures = [(m, [m], "", (-0.02, 1.02)) for m in CURVE_METRICS]
        if actions:
            rows = [ACTIONS_PREFIX + a for a in actions]
            figures.append((ACTIONS_FIGURE, rows, " per episode", (0.0, None)))
        for name, rows, unit, ylim in figures:
            height = 4 if len(rows) == 1 else 3 * len(rows)
            fig, axes = plt.subplots(
                len(rows), len(CURVE_SOURCES), figsize=(11, height), squeeze=False
            )
            for row, metric in zip(axes, rows, strict=True):
                for ax, (stage, tmpl, title) in zip(row, CURVE_SOURCES, strict=True):
                    key = f"{stage}:{tmpl.format(metric)}"
                    for arm in group_arms:
                        style = "--" if group != "main" and arm in refs else "-"
                        _plot_seed_band(ax, res, arm, key, style)
                    label = metric.removeprefix(ACTIONS_PREFIX).replace("_", " ")
                    ax.set_title(f"{label}{unit}: {title}")
                    ax.set_xlabel("training step")
                    ax.set_ylim(*ylim)
                    ax.grid(alpha=0.3)
                    if ax.has_data():
                        ax.legend(fontsize=8)
            suffix = "" if group == "main" else f" ({group})"
            fig.suptitle(f"mean over training seeds, band = +-1 std over seeds{suffix}")
            fig.tight_layout()
            path = os.fspath(as_path(out_dir) / curve_file(name, group))
            _save_png(fig, path)
            plt.close(fig)
            paths.append(path)
    return paths


def _save_png(fig: Any, path: str) -> None:
    """Renders into memory and writes the bytes once (``path`` may be a gs:// URL)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    as_path(path).write_bytes(buf.getvalue())


FOREST_FILE = "heldout_differences.png"


def plot_differences(res: dict[str, Any], out_dir: str) -> str | None:
    """heldout_differences.png: every arm minus the baseline on held-out tasks, compliance and
    task success, the verdict's intervals over training seeds, the non-inferiority margin drawn
    on the task panel.
    None when there is nothing to compare."""
    comps = res.get("comparisons") or {}
    arms = [a for a in res["arms"] if a in comps]
    if not arms:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    st = res["settings"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(arms) + 1.6), squeeze=False)
    y = np.arange(len(arms))[::-1]
    for ax, metric in zip(axes[0], ("compliance", "task_success"), strict=True):
        for yi, arm in zip(y, arms, strict=True):
            d = comps[arm]["difference"].get(metric)
            if not d:
                continue
            group = res["arms"][arm].get("group") or "main"
            color = {"main": "C0", "ablation": "C1", "stress": "C3"}.get(group, "C2")
            ends = (d.get("low"), d.get("high"))  # None / NaN: under two seeds, no interval
            finite = all(e is not None and np.isfinite(e) for e in ends)
            err = [[d["mean"] - ends[0]], [ends[1] - d["mean"]]] if finite else None
            ax.errorbar(d["mean"], yi, xerr=err, fmt="o", color=color, capsize=3)
        ax.axvline(0.0, color="k", lw=0.8)
        if metric == "task_success":
            ax.axvline(st["margin"], color="r", ls="--", lw=1, label=f"margin {st['margin']:+g}")
            ax.legend(fontsize=8, loc="lower right")
        ax.set_yticks(y, arms if metric == "compliance" else [""] * len(arms))
        ax.set_title(f"held-out {metric.replace('_', ' ')}: arm - {st['baseline']}")
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle(
        f"{int(round(100 * st['level']))}% intervals over training seeds and held-out tasks "
        "(blue: main, orange: ablation, red: stress)"
    )
    fig.tight_layout()
    path = os.fspath(as_path(out_dir) / FOREST_FILE)
    _save_png(fig, path)
    plt.close(fig)
    return path


TUNING_FILE = "tuning.png"


def plot_tuning(res: dict[str, Any], out_dir: str) -> str | None:
    """tuning.png: each arm's validation score against the learning rates tried (log x), its
    chosen rate marked. None without learning-rate trials."""
    t = (res.get("context") or {}).get("tuning")
    if not t or not t.get("arms"):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, (arm, a) in enumerate(t["arms"].items()):
        lrs = [x["lr"] for x in a["trials"]]
        scores = [x["score"] for x in a["trials"]]
        (line,) = ax.plot(lrs, scores, "o-", color=f"C{i % 10}", label=arm)
        best = lrs.index(a["chosen_lr"])
        ax.plot([lrs[best]], [scores[best]], "*", ms=14, color=line.get_color())
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("validation score")
    ax.set_title(f"learning-rate trials on {t['val_tasks']} validation tasks (star: chosen)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.fspath(as_path(out_dir) / TUNING_FILE)
    _save_png(fig, path)
    plt.close(fig)
    return path


PHASES_FILE = "step_phases.png"


def plot_phases(res: dict[str, Any], out_dir: str) -> str | None:
    """step_phases.png: one stacked bar per arm, its step's phase shares
    (`tg_jax.evaluation.step_phases`, in the order a step runs them). None without timed
    steps."""
    arms = {a: v["step_phases"] for a, v in res["arms"].items() if v.get("step_phases")}
    if not arms:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(next(iter(arms.values()))["shares"])
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(arms) + 1.4))
    y, left = np.arange(len(arms))[::-1], np.zeros(len(arms))
    for i, name in enumerate(names):
        widths = np.asarray([100 * p["shares"][name] for p in arms.values()])
        ax.barh(y, widths, left=left, color=f"C{i}", label=name)
        left += widths
    ax.set_yticks(y, [f"{a} ({p['step_s']:.2f} s)" for a, p in arms.items()])
    ax.set_xlabel("% of an RL step")
    ax.set_xlim(0, 100)
    ax.legend(fontsize=8, ncol=len(names), loc="upper center", bbox_to_anchor=(0.5, -0.35))
    ax.set_title("Where an RL step's time goes")
    fig.tight_layout()
    path = os.fspath(as_path(out_dir) / PHASES_FILE)
    _save_png(fig, path)
    plt.close(fig)
    return path
