"""Held-out statistics: per-episode records -> rates, intervals and the non-inferiority verdict.

docs/design.md section 4. Three kinds of uncertainty are kept apart, and each number says which
one it carries:

* Test items (held-out tasks): percentile *cluster* bootstrap, with a fixed seed. The
  episodes of one task (several samples, several training seeds) are averaged first, so a
  task sampled 8 times does not count as 8 independent items; and tasks that share a hidden
  function (`EpisodeRecord.cluster_id`) form one cluster, resampled whole, so 128 tasks drawn
  from 16 functions do not count as 128 independent items. A replicate's mean is the mean
  over the tasks of the drawn clusters. With one task per cluster (records without cluster
  ids) this is the plain bootstrap over tasks, with the same draws.
  The plain-vs-hinted diagnostic uses the *paired* bootstrap: both conditions are evaluated
  on the same tasks and every bootstrap replicate draws the same clusters for both, so the
  per-task difference is resampled and the between-task variance both share cancels. It
  decides no verdict: arm comparisons use `noninferiority_interval` (below).
* Training seeds: one point estimate per seed; mean, sample std (ddof=1) and a Student-t
  interval with n_seeds - 1 degrees of freedom. Never mixed into the bootstrap.
* Training-time "Table 1 style" numbers (mean +- std over the last K training steps, NOT a
  confidence interval) live in `stability.last_k_mean_std`.

Non-inferiority: one interval decides every verdict (`noninferiority_interval`; the report,
the registry's verdict and `power` use it). The unit is the training seed:
  D[s, t] = candidate - baseline success on held-out task t for training seed s (the seeds
  both arms ran, paired by seed; each run's per-task mean over its samples). Clusters of
  tasks c (tasks sharing a hidden function) give the table y[s, c] = (C / T) * sum_{t in c}
  D[s, t], whose mean is the mean of D. Its mean squares, as in a two-way random-effects
  table without replication,
      MS_seed = C * sum_s (y_s. - y..)^2 / (S - 1),
      MS_cluster = S * sum_c (y_.c - y..)^2 / (C - 1),
  give two intervals of the mean difference:
  * Student-t over seeds: se^2 = MS_seed / (S C), S - 1 degrees of freedom (the per-seed
    differences' own spread; task noise of each seed's evaluation enters through it);
  * seeds plus clusters: se^2 = (MS_seed + MS_cluster) / (S C), Satterthwaite's degrees of
    freedom. Every seed is evaluated on the same held-out tasks, so an arm-by-task effect
    (the candidate better on some functions, worse on others) is shared by all seeds and
    invisible to the first; the cluster term carries it (it counts the residual twice,
    which errs wide).
  The verdict's interval is the wider of the two at `level`; verdict = "pass" iff its lower
  bound >= margin (margin <= 0, e.g. -0.05). A two-sided 95% interval's lower bound is a
  one-sided 97.5% bound, the usual convention of non-inferiority trials. Under MIN_SEEDS
  training seeds per arm the verdict is "exploratory": the interval is reported, no pass or
  fail. tests/test_eval_stats.py simulates paired tables with a known truth (S = 3, 5, 10;
  seed sd 0, 0.06, 0.10; clustered tasks, binomial outcomes, with and without an arm-by-task
  effect) and checks the lower bound misses the truth no more often than (1 - level) / 2
  within Monte-Carlo error; the t-interval over seeds alone missed 17% at S = 10 with an
  arm-by-task effect, a z quantile 8-14% at S = 3.

A baseline run that collapsed makes the verdict "not meaningful", whichever seed it is: its
own held-out task success under `floor`, or more than `collapse_drop` under the base
model's own (when the base was evaluated). A drop measured against a run that lost its skill
says nothing about skill kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tg_jax.evaluation.report_settings import ReportSettings
from tg_jax.sampling.episode import CONDITIONS, EpisodeRecord

RATE_METRICS = ("compliance", "task_success", "joint")
ACTION_METRICS = ("run_tests", "submit", "malformed")
MIN_SEEDS = 3  # training seeds per arm under which a verdict is "exploratory"
INTERVAL_METHOD = "training seeds: the wider of the t-interval and seeds + clusters of tasks"


# -- per-task table -------------------------------------------------------------------------


def task_means(
    records: Sequence[EpisodeRecord], condition: str = "plain"
) -> tuple[list[str], dict[str, np.ndarray]]:
    """Averages every per-episode value over the episodes of each task.

    Args:
      records: episodes (any number per task: samples, training seeds).
      condition: which condition to keep.

    Returns:
      (task_ids sorted, {metric: float64 [num_tasks]}). A metric missing from some episode
      (e.g. an action one environment does not have) counts as 0 there.
    """
    by_task: dict[str, list[dict[str, float]]] = {}
    for r in records:
        if r.condition == condition:
            by_task.setdefault(r.task_id, []).append(r.values())
    task_ids = sorted(by_task)
    names = sorted({k for vs in by_task.values() for v in vs for k in v})
    table = {
        name: np.array([np.mean([v.get(name, 0.0) for v in by_task[t]]) for t in task_ids])
        for name in names
    }
    return task_ids, table


def pooled_task_means(
    runs: Sequence[Sequence[EpisodeRecord]], condition: str = "plain"
) -> tuple[list[str], dict[str, np.ndarray]]:
    """Task means of several runs (training seeds of one arm), each run weighted equally.

    Every run must cover the same tasks; the per-task value is the mean over runs of the
    run's per-task mean (so a seed with more samples does not weigh more).
    """
    tables = [task_means(r, condition) for r in runs]
    if not tables:
        raise ValueError("no runs")
    ids = tables[0][0]
    for other, _ in tables[1:]:
        if other != ids:
            raise ValueError("runs of one arm must be evaluated on the same held-out tasks")
    names = sorted(set.intersection(*(set(t) for _, t in tables)))
    return ids, {n: np.mean([t[n] for _, t in tables], axis=0) for n in names}


def task_clusters(runs: Sequence[Sequence[EpisodeRecord]], task_ids: Sequence[str]) -> list[str]:
    """The cluster id of every task in `task_ids`, from the records of `runs`.

    Raises:
      ValueError: a task with two cluster ids (records of different task sets).
    """
    of: dict[str, str] = {}
    for records in runs:
        for r in records:
            if of.setdefault(r.task_id, r.cluster_id) != r.cluster_id:
                raise ValueError(
                    f"task {r.task_id!r} has two cluster ids: {of[r.task_id]!r}, "
                    f"{r.cluster_id!r} (runs evaluated on different task sets, or before "
                    "records had cluster ids: delete their heldout.jsonl to re-evaluate)"
                )
    return [of[t] for t in task_ids]


# -- bootstrap over test items --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Interval:
    """A point estimate with a two-sided interval and what the interval is."""

    mean: float
    low: float
    high: float
    level: float
    method: str
    n: int  # test items (tasks)
    clusters: int | None = None  # resampled units (None: the items themselves)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _percentile_interval(
    values_N: np.ndarray,
    n_boot: int,
    seed: int,
    level: float,
    method: str,
    clusters_N: Sequence[str] | None = None,
) -> Interval:
    values_N = np.asarray(values_N, np.float64)
    n = values_N.shape[0]
    if n == 0:
        raise ValueError("cannot bootstrap zero items")
    labels = list(range(n)) if clusters_N is None else list(clusters_N)
    if len(labels) != n:
        raise ValueError(f"{len(labels)} cluster ids for {n} items")
    order = list(dict.fromkeys(labels))  # clusters in order of first appearance
    index = {c: i for i, c in enumerate(order)}
    of_item_N = np.array([index[c] for c in labels])
    sums_C = np.bincount(of_item_N, weights=values_N, minlength=len(order))
    sizes_C = np.bincount(of_item_N, minlength=len(order)).astype(np.float64)
    rng = np.random.default_rng(seed)
    idx_RxC = rng.integers(0, len(order), size=(n_boot, len(order)))
    means_R = sums_C[idx_RxC].sum(axis=1) / sizes_C[idx_RxC].sum(axis=1)
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(means_R, [alpha, 1.0 - alpha])
    if clusters_N is not None:
        method = f"{method}, clusters of tasks sharing a function resampled whole"
    mean = float(values_N.mean())
    return Interval(mean, float(low), float(high), level, method, n, len(order))


def bootstrap_ci(
    values_N: np.ndarray,
    *,
    clusters_N: Sequence[str] | None = None,
    n_boot: int = 10_000,
    seed: int = 0,
    level: float = 0.95,
) -> Interval:
    """Percentile bootstrap interval of the mean over N test items (resampled with replacement).

    Args:
      values_N: one value per test item (e.g. a task's success rate).
      clusters_N: cluster id per item; the clusters are resampled whole (None: every item is
        its own cluster).
      n_boot: bootstrap replicates.
      seed: numpy seed; the same seed and inputs give the same interval.
      level: two-sided coverage, e.g. 0.95 -> the 2.5% and 97.5% quantiles.
    """
    return _percentile_interval(
        values_N, n_boot, seed, level, "bootstrap over test items", clusters_N
    )


def paired_bootstrap_ci(
    a_N: np.ndarray,
    b_N: np.ndarray,
    *,
    clusters_N: Sequence[str] | None = None,
    n_boot: int = 10_000,
    seed: int = 0,
    level: float = 0.95,
) -> Interval:
    """Paired percentile bootstrap interval of mean(a - b) over the same N test items.

    Both arms are resampled with the same item (or cluster) indices, which is the same as
    bootstrapping the per-item difference; `clusters_N` as in `bootstrap_ci`.
    """
    a_N, b_N = np.asarray(a_N, np.float64), np.asarray(b_N, np.float64)
    if a_N.shape != b_N.shape:
        raise ValueError(f"paired arms need the same items: shapes {a_N.shape} vs {b_N.shape}")
    return _percentile_interval(
        a_N - b_N, n_boot, seed, level, "paired bootstrap over test items", clusters_N
    )


# -- training seeds -------------------------------------------------------------------------


def seed_interval(values_S: Sequence[float], *, level: float = 0.95) -> dict[str, Any]:
    """Mean, std (ddof=1) and Student-t interval over training seeds.

    Returns:
      {"mean", "std", "n", "low", "high", "level", "method"}; with one seed std/low/high are
      NaN (no spread can be estimated from one run).
    """
    v = np.asarray(values_S, np.float64)
    n = int(v.size)
    if n == 0:
        raise ValueError("no seeds")
    mean = float(v.mean())
    if n < 2:
        std = low = high = float("nan")
    else:
        import scipy.stats  # here, not at the top: it takes seconds to import

        std = float(v.std(ddof=1))
        half = float(scipy.stats.t.ppf(0.5 + level / 2.0, df=n - 1)) * std / np.sqrt(n)
        low, high = mean - half, mean + half
    return {
        "mean": mean,
        "std": std,
        "n": n,
        "low": low,
        "high": high,
        "level": level,
        "method": "t-interval over training seeds",
    }


# -- the non-inferiority interval: training seeds are the unit -------------------------------


@dataclasses.dataclass(frozen=True)
class MeanSquares:
    """The two-way (training seed x cluster of tasks) table of paired differences, by the
    method of moments of a random-effects table without replication (module docstring)."""

    mean: float  # d.., the mean difference
    seed: float  # MS_seed, S - 1 degrees of freedom
    cluster: float  # MS_cluster, C - 1
    resid: float  # MS_res, (S - 1)(C - 1)
    seeds: int  # S
    clusters: int  # C

    def half_width(self, level: float) -> tuple[float, float]:
        """(half width, degrees of freedom) of the two-sided `level` interval of the mean:
        the wider of the Student-t interval over seeds, se^2 = MS_seed / (S C) on S - 1
        degrees of freedom, and the seed-plus-cluster interval, se^2 = (MS_seed +
        MS_cluster) / (S C) on Satterthwaite's degrees of freedom (module docstring)."""
        import scipy.stats  # here, not at the top: it takes seconds to import

        s, c, q = self.seeds, self.clusters, 0.5 + level / 2.0
        if s < 2:
            return float("nan"), 0.0
        se_seed = np.sqrt(max(self.seed, 0.0) / (s * c))
        best = (float(scipy.stats.t.ppf(q, s - 1) * se_seed), float(s - 1))
        if c < 2:
            return best
        var = (self.seed + self.cluster) / (s * c)
        terms = self.seed**2 / (s - 1) + self.cluster**2 / (c - 1)
        if terms <= 0.0:
            return best
        df = float((s * c * var) ** 2 / terms)  # Satterthwaite
        both = float(scipy.stats.t.ppf(q, df) * np.sqrt(var))
        return (both, df) if both > best[0] else best


def cluster_table(d_SxT: np.ndarray, clusters_T: Sequence[str] | None = None) -> np.ndarray:
    """[seeds, clusters] table whose row means are the per-seed mean differences over tasks:
    cluster c's column holds (C / T) * the sum of its tasks' differences (a cluster weighs
    by its tasks, as in the task mean)."""
    d = np.asarray(d_SxT, np.float64)
    if d.ndim != 2 or 0 in d.shape:
        raise ValueError(f"need a non-empty [seeds, tasks] table, got shape {d.shape}")
    n = d.shape[1]
    labels = list(range(n)) if clusters_T is None else list(clusters_T)
    if len(labels) != n:
        raise ValueError(f"{len(labels)} cluster ids for {n} tasks")
    index = {k: i for i, k in enumerate(dict.fromkeys(labels))}
    onehot_TxC = np.zeros((n, len(index)))
    onehot_TxC[np.arange(n), [index[k] for k in labels]] = 1.0
    return (d @ onehot_TxC) * (len(index) / n)


def mean_squares(y_SxC: np.ndarray) -> MeanSquares:
    """Mean squares of a [seeds, clusters] table (`cluster_table`)."""
    y = np.asarray(y_SxC, np.float64)
    s, c = y.shape
    grand, rows, cols = y.mean(), y.mean(axis=1), y.mean(axis=0)
    ms_s = c * np.sum((rows - grand) ** 2) / (s - 1) if s > 1 else float("nan")
    ms_c = s * np.sum((cols - grand) ** 2) / (c - 1) if c > 1 else 0.0
    resid = y - rows[:, None] - cols[None, :] + grand
    ms_r = np.sum(resid**2) / ((s - 1) * (c - 1)) if s > 1 and c > 1 else 0.0
    return MeanSquares(float(grand), float(ms_s), float(ms_c), float(ms_r), s, c)


def noninferiority_interval(
    candidate_SxT: np.ndarray,
    baseline_SxT: np.ndarray,
    clusters_T: Sequence[str] | None = None,
    *,
    level: float = 0.95,
) -> tuple[float, float, float]:
    """The interval every verdict is decided by: (difference, low, high) of candidate -
    baseline, two-sided at `level`, with the training seed as the unit.

    Args:
      candidate_SxT, baseline_SxT: per training seed (rows, paired by seed index) and held-out
        task (columns, paired), that run's success mean on that task.
      clusters_T: cluster id per task (tasks sharing a hidden function; None: every task its
        own cluster).
      level: two-sided coverage; the verdict reads the lower bound (one-sided (1-level)/2).

    Returns:
      (difference, low, high): the mean over seeds and tasks of the paired difference and the
      wider of the Student-t interval over seeds (S - 1 degrees of freedom) and the
      seed-plus-cluster interval (module docstring). Under two seeds low and high are NaN.
    """
    c = np.asarray(candidate_SxT, np.float64)
    b = np.asarray(baseline_SxT, np.float64)
    if c.shape != b.shape or c.ndim != 2:
        raise ValueError(f"paired [seeds, tasks] tables needed: {c.shape} vs {b.shape}")
    ms = mean_squares(cluster_table(c - b, clusters_T))
    half, _ = ms.half_width(level)
    return ms.mean, ms.mean - half, ms.mean + half


# -- non-inferiority ------------------------------------------------------------------------


def noninferiority(
    diff: Mapping[str, Any],
    margin: float,
    *,
    baseline_success: float | None = None,
    floor: float = 0.0,
) -> dict[str, Any]:
    """Verdict on candidate - baseline task success against a margin fixed before the run.

    Args:
      diff: the difference's interval, {"mean", "low", "level"} (`compare_arms`).
      margin: the allowed drop, <= 0 (e.g. -0.05 = at most 5 points worse).
      baseline_success: the baseline arm's held-out task success (None: not checked).
      floor: below this baseline task success no drop can be measured (a baseline that solves
        nothing cannot get worse), and the verdict is "not meaningful".

    Returns:
      {"verdict": "pass" | "fail" | "undetermined" | "not meaningful", "lower", "mean",
      "margin", "level", "floor", "baseline_success", "rule"}: pass iff lower >= margin;
      "undetermined" when the lower bound is NaN (under two seeds).
    """
    if margin > 0:
        raise ValueError(f"a non-inferiority margin is an allowed drop, <= 0; got {margin}")
    lower = float(diff["low"])
    if np.isnan(lower):
        verdict = "undetermined"
    else:
        verdict = "pass" if lower >= margin else "fail"
    if baseline_success is not None and baseline_success < floor:
        verdict = "not meaningful"
    return {
        "verdict": verdict,
        "floor": float(floor),
        "baseline_success": baseline_success,
        "lower": lower,
        "mean": float(diff["mean"]),
        "margin": float(margin),
        "level": float(diff["level"]),
        "interval": INTERVAL_METHOD,
        "rule": "pass iff lower bound of the two-sided interval of (candidate - baseline) "
        "task success >= margin",
    }


# -- everything for the report --------------------------------------------------------------


def _seed_means(records: Sequence[EpisodeRecord], condition: str) -> dict[str, float]:
    """One run's point estimates: the mean over tasks of the per-task means."""
    _, table = task_means(records, condition)
    return {k: float(v.mean()) for k, v in table.items()}


def summarize_arm(
    runs: Mapping[int, Sequence[EpisodeRecord]],
    *,
    n_boot: int = 10_000,
    seed: int = 0,
    level: float = 0.95,
) -> dict[str, Any]:
    """Held-out summary of one arm over its training seeds.

    Args:
      runs: training seed -> that run's held-out episodes.

    Returns:
      {condition: {"bootstrap": {metric: Interval dict} (clusters of tasks, seeds pooled),
                   "seeds": {metric: seed_interval dict}, "per_seed": {seed: {metric: v}},
                   "num_tasks": n, "num_clusters": distinct cluster ids}}
      and "diagnostic": {metric: paired bootstrap Interval dict of hinted - plain} when both
      conditions were evaluated.
    """
    out: dict[str, Any] = {}
    seeds = sorted(runs)
    pooled = {}
    for cond in CONDITIONS:
        if not any(r.condition == cond for s in seeds for r in runs[s]):
            continue
        ids, table = pooled_task_means([runs[s] for s in seeds], cond)
        clusters = task_clusters([runs[s] for s in seeds], ids)
        pooled[cond] = (ids, table)
        per_seed = {s: _seed_means(runs[s], cond) for s in seeds}
        out[cond] = {
            "num_tasks": len(ids),
            "num_clusters": len(set(clusters)),
            "bootstrap": {
                k: bootstrap_ci(
                    v, clusters_N=clusters, n_boot=n_boot, seed=seed, level=level
                ).to_dict()
                for k, v in table.items()
            },
            "seeds": {
                k: seed_interval([per_seed[s][k] for s in seeds], level=level) for k in table
            },
            "per_seed": {str(s): per_seed[s] for s in seeds},
        }
    if len(pooled) == 2:
        (ids_p, plain), (ids_h, hinted) = pooled["plain"], pooled["hinted"]
        if ids_p == ids_h:
            clusters = task_clusters([runs[s] for s in seeds], ids_p)
            out["diagnostic"] = {
                k: paired_bootstrap_ci(
                    hinted[k],
                    plain[k],
                    clusters_N=clusters,
                    n_boot=n_boot,
                    seed=seed,
                    level=level,
                ).to_dict()
                for k in RATE_METRICS
            }
    return out


def compare_arms(
    candidate: Mapping[int, Sequence[EpisodeRecord]],
    baseline: Mapping[int, Sequence[EpisodeRecord]],
    *,
    margin: float,
    floor: float = 0.0,
    base_success: float | None = None,
    collapse_drop: float = ReportSettings.collapse_drop,
    level: float = 0.95,
    condition: str = "plain",
) -> dict[str, Any]:
    """Candidate - baseline on held-out tasks, with the non-inferiority verdict.

    Args:
      candidate, baseline: training seed -> held-out episodes, same tasks in every run; the
        seeds both ran are paired by seed.
      margin: allowed drop in task success (<= 0), fixed in the config before the run.
      floor: baseline task success under which the verdict is "not meaningful".
      base_success: the base model's own held-out task success (None: not evaluated); a
        baseline seed more than `collapse_drop` under it collapsed.
      level: two-sided level of every interval (the registry's share for this attempt).

    Returns:
      {"difference": {metric: {"mean", "low", "high", "level", "seeds", "clusters",
       "method"}} (`noninferiority_interval`), "per_seed": {metric: {seed: difference}},
       "paired_seeds": [seeds present in both], "noninferiority": verdict dict (with "seeds":
       training seeds per arm, "collapsed_baseline_seeds" and, when not decided, "why")}.
    """
    common = sorted(set(candidate) & set(baseline))
    tables = {
        arm: [task_means(runs[s], condition) for s in common]
        for arm, runs in (("c", candidate), ("b", baseline))
    }
    ids = tables["c"][0][0] if common else []
    if any(t_ids != ids for t_ids, _ in tables["c"] + tables["b"]):
        raise ValueError("arms must be evaluated on the same held-out tasks to be paired")
    runs = [*(candidate[s] for s in common), *(baseline[s] for s in common)]
    clusters = task_clusters(runs, ids)
    all_tables = [t for _, t in tables["c"] + tables["b"]]
    metrics = sorted(set.intersection(*(set(t) for t in all_tables))) if common else []
    diff, per_seed = {}, {}
    for k in metrics:
        c_SxT = np.stack([t[k] for _, t in tables["c"]])
        b_SxT = np.stack([t[k] for _, t in tables["b"]])
        d, low, high = noninferiority_interval(c_SxT, b_SxT, clusters, level=level)
        diff[k] = {
            "mean": d,
            "low": low,
            "high": high,
            "level": level,
            "seeds": len(common),
            "clusters": len(set(clusters)),
            "method": INTERVAL_METHOD,
        }
        per_seed[k] = dict(zip(common, map(float, (c_SxT - b_SxT).mean(axis=1)), strict=True))
    b_means = {s: _seed_means(baseline[s], condition).get("task_success", 0.0) for s in baseline}
    nan = {"mean": float("nan"), "low": float("nan"), "level": level}
    ni = noninferiority(
        diff.get("task_success", nan),
        margin,
        floor=floor,
        baseline_success=float(np.mean(list(b_means.values()))) if b_means else None,
    )
    ni["seeds"] = {"candidate": sorted(candidate), "baseline": sorted(baseline)}
    _decide(ni, b_means, len(common), floor, base_success, collapse_drop)
    return {"difference": diff, "per_seed": per_seed, "paired_seeds": common, "noninferiority": ni}


def _decide(
    ni: dict,
    b_means: Mapping[int, float],
    seeds: int,
    floor: float,
    base_success: float | None,
    collapse_drop: float,
) -> None:
    """Sets ni's "not meaningful" (a baseline seed under the floor, or more than
    `collapse_drop` under the base model's own task success) or "exploratory" (under MIN_SEEDS
    seeds), with "why" and "collapsed_baseline_seeds"."""
    ni["base_success"], ni["collapse_drop"] = base_success, float(collapse_drop)
    low_bar = floor if base_success is None else max(floor, base_success - collapse_drop)
    ni["collapsed_baseline_seeds"] = sorted(s for s, m in b_means.items() if m < low_bar)
    meaningful = ni["verdict"] != "not meaningful"
    if ni["collapsed_baseline_seeds"]:
        ni["verdict"] = "not meaningful"  # a collapsed run cannot show a kept skill
        why = f"under the floor {floor}"
        if base_success is not None and low_bar > floor:
            why = f"more than {collapse_drop} under the base model's {base_success:.3f}"
        ni["why"] = (
            f"baseline seed(s) {ni['collapsed_baseline_seeds']} collapsed: held-out "
            f"task success {why}"
        )
    elif seeds < MIN_SEEDS and meaningful:
        ni["verdict"] = "exploratory"
        ni["why"] = f"{seeds} training seed(s) per arm, under {MIN_SEEDS}"
