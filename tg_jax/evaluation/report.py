"""The experiment report: report.md, results.json and training-curve PNGs from run results.

Input: one `RunResult` per (arm, training seed): its held-out episodes (`evaluation.heldout`),
its metrics.jsonl records (training curves) and its costs. Output, in `out_dir`:

* `results.json`: every input number (episodes, curves, costs) and every derived number
  (the `evaluation.stats` summaries), so any table can be recomputed without the runs.
* `report.md` (rendered by `evaluation.markdown`): the verdict, the setting (machine,
  pre-registration hash, base model, SFT attempts), the training-time table in the style of
  the published Table 1 (mean +- std over the last K training steps, labelled as not a CI),
  the held-out results with cluster bootstrap CIs (tasks sharing a hidden function are
  resampled together) and, separately, the spread over training seeds, arm differences with
  paired CIs, the non-inferiority verdict ("not meaningful" when the baseline's task success
  is under the floor), the plain-vs-hinted diagnostic, side effects (actions per episode),
  costs per arm (distilled tokens, and peak memory measured per run), stability (oscillation of
  the training compliance, malformed turns), the hint-leakage guard, the arms' shared tuning
  budget (`context["budget"]`), then stress-test and ablation rows as their runs exist.
* `curve_<metric>.png`: per arm the mean over seeds and a +-1 std band over seeds, for the
  training rollouts and for the periodic held-out evaluation.

Metric names in metrics.jsonl (written by `tg_jax.train.rl`): stage "train" has
`rollout/<metric>` (training rollouts of that step), stage "eval" has `heldout/<metric>`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tg_jax import paths
from tg_jax.evaluation import stability, stats, step_phases
from tg_jax.evaluation.markdown import render_markdown
from tg_jax.evaluation.md_budget import budget_check
from tg_jax.evaluation.md_costs import COST_KEYS
from tg_jax.evaluation.plots import (  # noqa: F401 (CURVE_METRICS, curve_groups, action_names: public here too)
    ACTIONS_PREFIX,
    CURVE_METRICS,
    CURVE_SOURCES,
    action_names,
    curve_groups,
    plot_curves,
    plot_differences,
    plot_phases,
    plot_tuning,
)
from tg_jax.evaluation.report_settings import ReportSettings
from tg_jax.sampling.episode import EpisodeRecord

GROUPS = ("main", "stress", "ablation")
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


def _action_curves(records: Sequence[Mapping[str, Any]]) -> dict[str, list[list[float]]]:
    """Per-episode counts of every logged action (rollout/actions/<a>, heldout/actions/<a>)
    over training, keyed like the rate curves ("train:rollout/actions/run_tests")."""
    out = {}
    for stage, tmpl, _ in CURVE_SOURCES:
        prefix = tmpl.format(ACTIONS_PREFIX)
        names = {k for r in records if r.get("stage") == stage for k in r if k.startswith(prefix)}
        for key in sorted(names):
            out[f"{stage}:{key}"] = _curve(records, stage, key)
    return out


def compute_time(
    runs: Sequence[RunResult], sft_wall_s: float | None = None, tune_wall_s: float | None = None
) -> dict[str, Any]:
    """Summed wall times of the protocol's stages: SFT, the learning-rate trials (`tune_s`,
    None without them), every run's RL and held-out evaluation.

    Runs without a timed evaluation (e.g. evaluated before the time was recorded) count 0 for
    it, and `eval_runs` says how many were timed; `complete` is False when anything was not
    timed (the total is then a lower bound).
    """
    rl_s = sum(float(r.costs.get("wall_time_s", 0.0)) for r in runs)
    evals = [float(r.costs["eval_wall_time_s"]) for r in runs if "eval_wall_time_s" in r.costs]
    total = rl_s + sum(evals) + (sft_wall_s or 0.0) + (tune_wall_s or 0.0)
    complete = len(evals) == len(runs) and sft_wall_s is not None
    return {
        "sft_s": sft_wall_s,
        "tune_s": tune_wall_s,
        "rl_s": rl_s,
        "eval_s": sum(evals),
        "runs": len(runs),
        "eval_runs": len(evals),
        "total_s": total,
        "complete": complete,
    }


def compute_results(
    runs: Sequence[RunResult],
    settings: ReportSettings,
    sft_wall_s: float | None = None,
    tune_wall_s: float | None = None,
    reference_runs: Mapping[str, Sequence[Any]] | None = None,
) -> dict[str, Any]:
    """Every number of the report, JSON-ready (see the module docstring); `reference_runs`:
    held-out episodes of references that are no arm (`eval.references`: "base")."""
    arms = _by_arm(runs)
    if settings.baseline not in arms and len(arms) > 1:
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
                    **{
                        f"{stage}:{tmpl.format(m)}": _curve(r.train_records, stage, tmpl.format(m))
                        for stage, tmpl, _ in CURVE_SOURCES
                        for m in stats.RATE_METRICS
                    },
                    **_action_curves(r.train_records),
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
                m: stability.last_k_mean_std(train, f"rollout/{m}", settings.last_k)
                for m in stats.RATE_METRICS
            },
            "stability": stability.arm_stability(train, level=settings.level),
            "costs": {
                k: stats.seed_interval([r.costs[k] for r in rs], level=settings.level)
                for k in COST_KEYS
                if all(k in r.costs for r in rs)
            },
            "step_phases": step_phases.phase_shares(train),
        }
    refs = reference_runs or {}
    compare = functools.partial(
        stats.compare_arms,
        margin=settings.margin,
        floor=settings.floor,
        base_success=_base_success(refs.get(BASE_REFERENCE))
        if settings.collapse_drop >= 0
        else None,
        collapse_drop=settings.collapse_drop,
        level=settings.verdict_level(),
    )
    base = settings.baseline
    out["comparisons"] = {
        arm: compare(episodes[arm], episodes[base])
        for arm in arms
        if base in arms and arm != base and arms[arm][0].heldout and arms[base][0].heldout
    }
    out["references"] = _references(settings, arms, episodes, refs, compare, out["comparisons"])
    # One arm alone (e.g. TG from a user's checkpoint): figures, no comparison.
    out["single_arm"] = settings.baseline not in arms
    out["noninferiority"] = out["comparisons"].get(settings.candidate, {}).get("noninferiority")
    out["compute_time"] = compute_time(runs, sft_wall_s, tune_wall_s)
    return out


BASE_REFERENCE = "base"  # eval.references: the base model, evaluated once


def _base_success(records: Sequence[Any] | None) -> float | None:
    """The base model's own held-out task success (None when it was not evaluated)."""
    if not records:
        return None
    _, table = stats.task_means(records)
    return float(table["task_success"].mean()) if "task_success" in table else None


def _references(settings, arms, episodes, reference_runs, compare, comparisons) -> dict:
    """The candidate's non-inferiority against the baseline (its verdict in `comparisons`)
    and each of `eval.references` (an arm, or a reference run such as the base model, whose
    one set of episodes stands for every training seed of the candidate): {reference: verdict
    dict, or {"verdict": "not run"}}."""
    cand = settings.candidate
    if cand not in arms or not arms[cand][0].heldout:
        return {}
    out: dict[str, Any] = {}
    for ref in dict.fromkeys((settings.baseline, *settings.references)):
        if ref == settings.baseline and cand in comparisons:
            out[ref] = comparisons[cand]["noninferiority"]
            continue
        if ref in arms and arms[ref][0].heldout and ref != cand:
            ref_eps = episodes[ref]
        elif ref in settings.references and ref in reference_runs:
            ref_eps = {s: reference_runs[ref] for s in episodes[cand]}
        else:
            out[ref] = {"verdict": "not run"}
            continue
        out[ref] = compare(episodes[cand], ref_eps)["noninferiority"]
    return out


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
    context: Mapping[str, Any] | None = None,
    tune_wall_s: float | None = None,
    reference_runs: Mapping[str, Sequence[Any]] | None = None,
) -> dict[str, Any]:
    """Writes report.md, results.json and curve PNGs to `out_dir`; returns the results dict.

    Args:
      out_dir: directory (created if missing).
      runs: one RunResult per (arm, training seed); the baseline arm must be among them.
      settings: a ReportSettings, or `eval_config()` (any mapping with its field names).
      sft_wall_s: the SFT stage's wall time, for the protocol's compute time (None = unknown).
      context: what the numbers stand on, stored as results["context"] and shown under
        "Setting": "machine" (`evaluation.protocol.machine_info`), "preregistration"
        ({"path", "sha256"}), "base_model" (headline figures of sft_eval.json),
        "sft_attempts" (one {"attempt", "seed", "data_seed", "workdir", "verdict"} each),
        "budget" (`evaluation.stability.tuning_budget`), "budget_equal" (every arm's
        declared budget is the same; results["budget_check"] adds the sampled tokens each
        arm used, `md_budget.budget_check`) and "tuning" (`tg_jax.train.tuning.tune_arms`'
        result, or None: no learning-rate trials).
      tune_wall_s: the learning-rate trials' wall time (RL + validation), None without them.
      reference_runs: {"base": the base model's held-out episodes} when `eval.references`
        names it (the candidate's verdict against each reference: results["references"]).

    Returns:
      The results dict written to results.json (NaN written as null).
    """
    if not isinstance(settings, ReportSettings):
        settings = ReportSettings.from_config(settings)
    out_dir = os.fspath(paths.as_path(out_dir))
    paths.as_path(out_dir).mkdir(parents=True, exist_ok=True)
    res = compute_results(runs, settings, sft_wall_s, tune_wall_s, reference_runs)
    res["context"] = dict(context or {})
    res["budget_check"] = budget_check(res)
    res = _json_safe(res)
    paths.write_json_atomic(paths.as_path(out_dir) / RESULTS_FILE, res, indent=1, allow_nan=False)
    plot_curves(res, out_dir)
    plot_differences(res, out_dir)
    plot_tuning(res, out_dir)
    plot_phases(res, out_dir)
    (paths.as_path(out_dir) / REPORT_FILE).write_text(render_markdown(res))
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
    eval_summary = paths.as_path(workdir) / HELDOUT_SUMMARY_FILE
    if eval_summary.exists():
        try:
            costs["eval_wall_time_s"] = float(paths.read_json(eval_summary)["wall_s"])
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(
                f"{eval_summary} is not a valid evaluation summary ({e!r}); delete it and "
                f"{paths.as_path(workdir) / HELDOUT_FILE} to evaluate the run again"
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
