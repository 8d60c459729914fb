"""The experiment report: report.md, results.json and training-curve PNGs from run results.

Input: one `RunResult` per (arm, training seed): its held-out episodes (`evaluation.heldout`),
its metrics.jsonl records (training curves) and its costs. Output, in `out_dir`:

* `results.json`: every input number (episodes, curves, costs) and every derived number
  (the `evaluation.stats` summaries), so any table can be recomputed without the runs.
* `report.md`: the training-time table in the style of the published Table 1 (mean +- std over
  the last K training steps, labelled as not a CI), the held-out results with bootstrap CIs
  over tasks and, separately, the spread over training seeds, arm differences with paired
  CIs, the non-inferiority verdict, the plain-vs-hinted diagnostic, side effects (actions per
  episode), costs per arm, then stress-test and ablation rows as their runs exist.
* `curve_<metric>.png`: per arm the mean over seeds and a +-1 std band over seeds, for the
  training rollouts and for the periodic held-out evaluation.

Metric names in metrics.jsonl (written by `tg_jax.train.rl`): stage "train" has
`rollout/<metric>` (training rollouts of that step), stage "eval" has `heldout/<metric>`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tg_jax.evaluation import stats
from tg_jax.sampling.episode import EpisodeRecord

GROUPS = ("main", "stress", "ablation")
CURVE_METRICS = ("compliance", "task_success")
CURVE_SOURCES = (("train", "rollout/{}", "training rollouts"), ("eval", "heldout/{}", "held-out"))
COST_KEYS = (
    "wall_time_s",
    "eval_wall_time_s",
    "sampled_tokens",
    "teacher_forward_flops",
    "peak_memory_bytes",
)
REPORT_FILE, RESULTS_FILE = "report.md", "results.json"


@dataclasses.dataclass
class RunResult:
    """One training run (one arm, one training seed) and its held-out evaluation.

    Attributes:
      arm: arm name, e.g. "grpo", "tg", "tg_wrong_hints".
      seed: training seed.
      heldout: held-out episodes of the final params (plain, and hinted for the diagnostic).
      train_records: the run's metrics.jsonl records (`tg_jax.metrics.read_metrics`).
      costs: COST_KEYS -> number (missing keys are reported as n/a).
      group: "main" (the GRPO vs TG comparison), "stress" (imperfect feedback) or "ablation".
      description: one line saying what the arm changes.
    """

    arm: str
    seed: int
    heldout: list[EpisodeRecord]
    train_records: list[dict[str, Any]]
    costs: dict[str, float]
    group: str = "main"
    description: str = ""

    def __post_init__(self):
        if self.group not in GROUPS:
            raise ValueError(f"group must be one of {GROUPS}, got {self.group!r}")


@dataclasses.dataclass(frozen=True)
class ReportSettings:
    """How the report compares arms; `from_config` reads them from `eval_config()`."""

    baseline: str = "grpo"  # arm every other arm is compared with
    candidate: str = "tg"  # arm whose non-inferiority is the headline verdict
    margin: float = -0.05  # allowed drop in held-out task success (fixed before the run)
    ni_interval: str = "paired_bootstrap"  # which interval decides (see evaluation.stats)
    level: float = 0.95  # two-sided coverage of every interval
    n_boot: int = 10_000  # bootstrap replicates
    bootstrap_seed: int = 0  # bootstrap numpy seed
    last_k: int = 32  # training steps in the Table 1 style mean +- std

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | Any) -> ReportSettings:
        get = cfg.get if hasattr(cfg, "get") else lambda k, d: getattr(cfg, k, d)
        return cls(**{f.name: get(f.name, f.default) for f in dataclasses.fields(cls)})


# -- results ---------------------------------------------------------------------------------


def _by_arm(runs: Sequence[RunResult]) -> dict[str, list[RunResult]]:
    arms: dict[str, list[RunResult]] = {}
    for r in runs:
        arms.setdefault(r.arm, []).append(r)
    for arm, rs in arms.items():
        seeds = [r.seed for r in rs]
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"arm {arm!r} has duplicate seeds {seeds}")
        if len({r.group for r in rs}) != 1:
            raise ValueError(f"arm {arm!r} mixes groups")
        rs.sort(key=lambda r: r.seed)
    return arms


def _curve(records: Sequence[Mapping[str, Any]], stage: str, key: str) -> list[list[float]]:
    latest = {
        int(r["step"]): float(r[key]) for r in records if r.get("stage") == stage and key in r
    }
    return [[s, latest[s]] for s in sorted(latest)]


def compute_time(runs: Sequence[RunResult], sft_wall_s: float | None = None) -> dict[str, Any]:
    """Summed wall times of the protocol's stages: SFT, every run's RL and held-out evaluation.

    Runs without a timed evaluation (e.g. evaluated before the time was recorded) count 0 for
    it, and `eval_runs` says how many were timed; `complete` is False when anything was not
    timed (the total is then a lower bound).
    """
    rl_s = sum(float(r.costs.get("wall_time_s", 0.0)) for r in runs)
    evals = [float(r.costs["eval_wall_time_s"]) for r in runs if "eval_wall_time_s" in r.costs]
    total = rl_s + sum(evals) + (sft_wall_s or 0.0)
    complete = len(evals) == len(runs) and sft_wall_s is not None
    return {"sft_s": sft_wall_s, "rl_s": rl_s, "eval_s": sum(evals), "runs": len(runs),
            "eval_runs": len(evals), "total_s": total, "complete": complete}  # fmt: skip


def compute_results(
    runs: Sequence[RunResult], settings: ReportSettings, sft_wall_s: float | None = None
) -> dict[str, Any]:
    """Every number of the report, JSON-ready (see the module docstring)."""
    arms = _by_arm(runs)
    if settings.baseline not in arms:
        raise ValueError(f"baseline arm {settings.baseline!r} not among the runs {sorted(arms)}")
    boot = dict(n_boot=settings.n_boot, seed=settings.bootstrap_seed, level=settings.level)
    out: dict[str, Any] = {"settings": dataclasses.asdict(settings), "runs": [], "arms": {}}
    for r in runs:
        out["runs"].append(
            {
                "arm": r.arm,
                "seed": r.seed,
                "group": r.group,
                "description": r.description,
                "costs": dict(r.costs),
                "heldout": [e.to_dict() for e in r.heldout],
                "curves": {
                    f"{stage}:{tmpl.format(m)}": _curve(r.train_records, stage, tmpl.format(m))
                    for stage, tmpl, _ in CURVE_SOURCES
                    for m in stats.RATE_METRICS
                },
            }
        )
    episodes = {arm: {r.seed: r.heldout for r in rs} for arm, rs in arms.items()}
    for arm, rs in arms.items():
        train = [r.train_records for r in rs]
        out["arms"][arm] = {
            "group": rs[0].group,
            "description": rs[0].description,
            "seeds": [r.seed for r in rs],
            "heldout": stats.summarize_arm(episodes[arm], **boot) if rs[0].heldout else {},
            "train_last_k": {
                m: stats.last_k_mean_std(train, f"rollout/{m}", settings.last_k)
                for m in stats.RATE_METRICS
            },
            "costs": {
                k: stats.seed_interval([r.costs[k] for r in rs], level=settings.level)
                for k in COST_KEYS
                if all(k in r.costs for r in rs)
            },
        }
    out["comparisons"] = {
        arm: stats.compare_arms(
            episodes[arm],
            episodes[settings.baseline],
            margin=settings.margin,
            ni_interval=settings.ni_interval,
            **boot,
        )
        for arm in arms
        if arm != settings.baseline and arms[arm][0].heldout and arms[settings.baseline][0].heldout
    }
    out["noninferiority"] = out["comparisons"].get(settings.candidate, {}).get("noninferiority")
    out["compute_time"] = compute_time(runs, sft_wall_s)
    return out


# -- markdown --------------------------------------------------------------------------------


def _num(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{digits}f}"


def _ci(d: Mapping[str, Any] | None, digits: int = 2) -> str:
    if not d:
        return "n/a"
    return f"{_num(d['mean'], digits)} [{_num(d['low'], digits)}, {_num(d['high'], digits)}]"


def _pm(d: Mapping[str, Any] | None, digits: int = 2) -> str:
    if not d or d.get("n", 0) == 0:
        return "n/a"
    return f"{_num(d['mean'], digits)} +- {_num(d['std'], digits)}"


def _minutes(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds / 60:.1f} min"


def _big(x: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _arm_rows(res: dict[str, Any], group: str) -> list[str]:
    return [a for a, v in res["arms"].items() if v["group"] == group]


def _heldout_rows(res: dict[str, Any], arms: Sequence[str], pct: int) -> list[list[str]]:
    rows = []
    for arm in arms:
        h = res["arms"][arm]["heldout"].get("plain")
        if not h:
            continue
        b, s = h["bootstrap"], h["seeds"]
        rows.append(
            [arm, str(len(res["arms"][arm]["seeds"])), str(h["num_tasks"])]
            + [_ci(b.get(m)) for m in stats.RATE_METRICS]
            + [f"{_pm(s.get(m))} (t {pct}%: [{_num(s[m]['low'])}, {_num(s[m]['high'])}])"
               for m in ("compliance", "task_success")]
        )  # fmt: skip
    return rows


def render_markdown(res: dict[str, Any]) -> str:
    """report.md from `compute_results` output."""
    st = res["settings"]
    pct = round(100 * st["level"])
    main = _arm_rows(res, "main")
    lines = ["# GRPO vs targeted guidance: report", ""]
    ni = res.get("noninferiority")
    if ni:
        lines += [
            f"**Non-inferiority of `{st['candidate']}` vs `{st['baseline']}` on held-out task "
            f"success: {ni['verdict'].upper()}.** Difference {_num(ni['mean'], 3)}, lower bound "
            f"of the two-sided {pct}% {ni['interval'].replace('_', ' ')} interval "
            f"{_num(ni['lower'], 3)} vs margin {_num(ni['margin'], 3)} (fixed in the config "
            "before the run; pass iff lower bound >= margin).",
            "",
        ]
    lines += [
        f"## Training-time results (Table 1 style, last {st['last_k']} steps)",
        "",
        f"Mean +- std over the last {st['last_k']} training steps of the training rollouts "
        "(seeds pooled). **The +- is step-to-step spread, not a confidence interval.**",
        "",
    ]
    rows = []
    for arm in main:
        t = res["arms"][arm]["train_last_k"]
        rows.append([arm] + [_pm(t[m]) for m in stats.RATE_METRICS])
    lines += _table(["arm", "compliance", "task success", "joint"], rows) + [""]

    lines += [
        "## Held-out results",
        "",
        f"Held-out tasks never used in training, plain prompts. Rates with {pct}% percentile "
        f"bootstrap CIs over tasks ({st['n_boot']} replicates, seed {st['bootstrap_seed']}; "
        "each task's episodes averaged over samples and training seeds first). Separately: "
        f"mean +- std over training seeds with the Student-t {pct}% interval.",
        "",
    ]
    header = ["arm", "seeds", "tasks", "compliance", "task success", "joint (both)",
              "compliance over seeds", "task success over seeds"]  # fmt: skip
    lines += _table(header, _heldout_rows(res, main, pct)) + [""]

    if res["comparisons"]:
        lines += [
            f"## Differences vs `{st['baseline']}`",
            "",
            f"Paired bootstrap over the same held-out tasks ({pct}%), and the t-interval over "
            "training seeds of per-seed differences (seeds paired by index).",
            "",
        ]
        rows = []
        for arm, c in res["comparisons"].items():
            pb, stt = c["paired_bootstrap"], c["seed_t"]
            rows.append(
                [arm, res["arms"][arm]["group"]]
                + [_ci(pb.get(m), 3) for m in stats.RATE_METRICS]
                + [_ci(stt.get("task_success"), 3), c["noninferiority"]["verdict"]]
            )
        header = ["arm", "group", "d compliance", "d task success", "d joint",
                  "d task success (seeds, t)", f"non-inferior (margin {st['margin']})"]  # fmt: skip
        lines += _table(header, rows) + [""]

    diag_rows = []
    for arm, a in res["arms"].items():
        h = a["heldout"]
        if "diagnostic" not in h:
            continue
        diag_rows.append(
            [arm]
            + [_ci(h[c]["bootstrap"]["compliance"]) for c in ("plain", "hinted")]
            + [_ci(h["diagnostic"]["compliance"])]
            + [_ci(h[c]["bootstrap"]["task_success"]) for c in ("plain", "hinted")]
        )
    if diag_rows:
        lines += [
            "## Diagnostic: plain vs hinted prompts",
            "",
            "Hinted = the hint shown before every assistant turn. High hinted but low plain "
            "compliance means 'can do when reminded', not 'does by default'.",
            "",
        ]
        header = ["arm", "compliance plain", "compliance hinted", "hinted - plain",
                  "task success plain", "task success hinted"]  # fmt: skip
        lines += _table(header, diag_rows) + [""]

    se_rows = []
    for arm, a in res["arms"].items():
        b = a["heldout"].get("plain", {}).get("bootstrap", {})
        if b:
            keys = [f"actions/{k}" for k in stats.ACTION_METRICS] + ["turns"]
            se_rows.append([arm] + [_ci(b.get(k)) for k in keys])
    if se_rows:
        lines += [
            "## Side effects: actions per held-out episode",
            "",
            f"Counted actions, not phrases ({pct}% bootstrap CIs over tasks).",
            "",
        ]
        lines += _table(["arm", "run_tests", "submissions", "malformed turns", "turns"], se_rows)
        lines += [""]

    cost_rows = []
    for arm, a in res["arms"].items():
        c = a["costs"]
        cells = []
        for k in COST_KEYS:
            if k not in c:
                cells.append("n/a")
            elif k.endswith("wall_time_s"):
                cells.append(f"{c[k]['mean']:.1f}")
            else:
                cells.append(_big(c[k]["mean"]))
        cost_rows.append([arm] + cells)
    lines += ["## Costs per arm (mean over seeds)", ""]
    header = ["arm", "RL wall time (s)", "held-out eval (s)", "sampled tokens",
              "teacher forward FLOPs", "peak memory (B)"]  # fmt: skip
    lines += _table(header, cost_rows) + [""]
    ct = res.get("compute_time") or {}
    if ct:
        eval_s = ct["eval_s"] if ct["eval_runs"] else None
        parts = [f"SFT {_minutes(ct.get('sft_s'))}", f"RL {_minutes(ct['rl_s'])}",
                 f"held-out evaluation {_minutes(eval_s)}"]  # fmt: skip
        timed = f"{ct['eval_runs']} of {ct['runs']} runs timed"
        lines += [
            "Compute time of the protocol (sum of the stages' wall times; a resumed stage sums "
            f"its sessions; start-up and data not counted): {' + '.join(parts)} = "
            f"**{'' if ct['complete'] else 'at least '}{_minutes(ct['total_s'])}** (held-out "
            f"evaluation: {timed}).",
            "",
        ]

    sections = (("stress", "Stress tests (imperfect feedback)"), ("ablation", "Ablations"))
    for group, title in sections:
        arms = _arm_rows(res, group)
        if not arms:
            continue
        lines += [f"## {title}", ""]
        rows = []
        for arm in arms:
            a = res["arms"][arm]
            b = a["heldout"].get("plain", {}).get("bootstrap", {})
            c = res["comparisons"].get(arm)
            rows.append(
                [arm, a["description"] or "-", _pm(a["train_last_k"]["compliance"])]
                + [_ci(b.get(m)) for m in ("compliance", "task_success")]
                + [_ci(c["paired_bootstrap"]["task_success"], 3) if c else "n/a"]
                + [c["noninferiority"]["verdict"] if c else "n/a"]
            )
        header = ["arm", "what changes", "train compliance (last K, not a CI)",
                  "held-out compliance", "held-out task success",
                  f"d task success vs {st['baseline']}", "non-inferior"]  # fmt: skip
        lines += _table(header, rows) + [""]

    if res.get("comparisons"):
        lines += [
            f"## Differences vs `{st['baseline']}` (plot)",
            "",
            f"![{FOREST_FILE}]({FOREST_FILE})",
            "",
        ]
    lines += ["## Training curves", ""]
    for group in curve_groups(res):
        plots = [curve_file(m, group) for m in CURVE_METRICS]
        if group != "main":
            lines += [f"{group.capitalize()} arms, with the reference arms dashed:", ""]
        lines += [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(lines)


# -- plots -----------------------------------------------------------------------------------


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
    curves = [dict(map(tuple, r["curves"][key])) for r in runs]
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
    (steps all seeds have); reference arms of a non-main group are drawn dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    refs = {res["settings"]["baseline"], res["settings"]["candidate"]}
    for group, group_arms in curve_groups(res).items():
        for metric in CURVE_METRICS:
            fig, axes = plt.subplots(1, len(CURVE_SOURCES), figsize=(11, 4), squeeze=False)
            for ax, (stage, tmpl, title) in zip(axes[0], CURVE_SOURCES, strict=True):
                key = f"{stage}:{tmpl.format(metric)}"
                for arm in group_arms:
                    style = "--" if group != "main" and arm in refs else "-"
                    _plot_seed_band(ax, res, arm, key, style)
                ax.set_title(f"{metric.replace('_', ' ')}: {title}")
                ax.set_xlabel("training step")
                ax.set_ylim(-0.02, 1.02)
                ax.grid(alpha=0.3)
                if ax.has_data():
                    ax.legend(fontsize=8)
            suffix = "" if group == "main" else f" ({group})"
            fig.suptitle(f"mean over training seeds, band = +-1 std over seeds{suffix}")
            fig.tight_layout()
            path = os.path.join(out_dir, curve_file(metric, group))
            fig.savefig(path, dpi=100)
            plt.close(fig)
            paths.append(path)
    return paths


FOREST_FILE = "heldout_differences.png"


def plot_differences(res: dict[str, Any], out_dir: str) -> str | None:
    """heldout_differences.png: every arm minus the baseline on held-out tasks, compliance and
    task success, paired bootstrap CIs, the non-inferiority margin drawn on the task panel.
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
            d = comps[arm]["paired_bootstrap"].get(metric)
            if not d:
                continue
            group = res["arms"][arm].get("group") or "main"
            color = {"main": "C0", "ablation": "C1", "stress": "C3"}.get(group, "C2")
            err = [[d["mean"] - d["low"]], [d["high"] - d["mean"]]]
            ax.errorbar(d["mean"], yi, xerr=err, fmt="o", color=color, capsize=3)
        ax.axvline(0.0, color="k", lw=0.8)
        if metric == "task_success":
            ax.axvline(st["margin"], color="r", ls="--", lw=1, label=f"margin {st['margin']:+g}")
            ax.legend(fontsize=8, loc="lower right")
        ax.set_yticks(y, arms if metric == "compliance" else [""] * len(arms))
        ax.set_title(f"held-out {metric.replace('_', ' ')}: arm - {st['baseline']}")
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle(
        f"paired bootstrap {int(round(100 * st['level']))}% CIs over held-out tasks "
        "(blue: main, orange: ablation, red: stress)"
    )
    fig.tight_layout()
    path = os.path.join(out_dir, FOREST_FILE)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _json_safe(x: Any) -> Any:
    """NaN -> None (strict JSON), numpy scalars -> Python."""
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_report(
    out_dir: str | os.PathLike,
    runs: Sequence[RunResult],
    settings: ReportSettings | Mapping[str, Any] | Any = ReportSettings(),
    sft_wall_s: float | None = None,
) -> dict[str, Any]:
    """Writes report.md, results.json and curve PNGs to `out_dir`; returns the results dict.

    Args:
      out_dir: directory (created if missing).
      runs: one RunResult per (arm, training seed); the baseline arm must be among them.
      settings: a ReportSettings, or `eval_config()` (any mapping with its field names).
      sft_wall_s: the SFT stage's wall time, for the protocol's compute time (None = unknown).

    Returns:
      The results dict written to results.json (NaN written as null).
    """
    if not isinstance(settings, ReportSettings):
        settings = ReportSettings.from_config(settings)
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    res = _json_safe(compute_results(runs, settings, sft_wall_s))
    tmp = os.path.join(out_dir, RESULTS_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1, allow_nan=False)
    os.replace(tmp, os.path.join(out_dir, RESULTS_FILE))
    plot_curves(res, out_dir)
    plot_differences(res, out_dir)
    with open(os.path.join(out_dir, REPORT_FILE), "w", encoding="utf-8") as f:
        f.write(render_markdown(res))
    return res


def load_run_result(
    workdir: str,
    heldout: Sequence[EpisodeRecord],
    *,
    group: str = "main",
    description: str = "",
) -> RunResult:
    """A RunResult from a finished `tg_jax.train.rl.run_rl` workdir (arm, seed and costs from
    rl_summary.json, the held-out evaluation's wall time from heldout_summary.json when it
    exists, curves from metrics.jsonl) and its held-out episodes."""
    from tg_jax.evaluation.heldout import HELDOUT_FILE, HELDOUT_SUMMARY_FILE
    from tg_jax.metrics import read_metrics, read_rl_summary

    summary = read_rl_summary(workdir)
    costs = {k: float(summary["costs"][k]) for k in COST_KEYS if k in summary["costs"]}
    eval_summary = os.path.join(workdir, HELDOUT_SUMMARY_FILE)
    if os.path.exists(eval_summary):
        try:
            with open(eval_summary) as f:
                costs["eval_wall_time_s"] = float(json.load(f)["wall_s"])
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(
                f"{eval_summary} is not a valid evaluation summary ({e!r}); delete it and "
                f"{os.path.join(workdir, HELDOUT_FILE)} to evaluate the run again"
            ) from e
    return RunResult(
        arm=summary["arm"],
        seed=int(summary["seed"]),
        heldout=list(heldout),
        train_records=read_metrics(workdir),
        costs=costs,
        group=group,
        description=description,
    )
