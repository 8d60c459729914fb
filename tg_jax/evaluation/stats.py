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
  Arm differences use the *paired* bootstrap: both arms are evaluated on the same tasks and
  every bootstrap replicate draws the same clusters for both, so the per-task difference
  is resampled and the between-task variance that both arms share cancels.
* Training seeds: one point estimate per seed; mean, sample std (ddof=1) and a Student-t
  interval with n_seeds - 1 degrees of freedom. Never mixed into the bootstrap.
* Training-time "Table 1 style" numbers: mean +- std over the last K training steps of one
  run. That std measures step-to-step fluctuation of the training rollouts, it is NOT a
  confidence interval, and results carry the label `TRAIN_STD_LABEL` to say so.

Non-inferiority (the interval is fixed here and in `eval_config`, before any run):
  d = task_success(candidate) - task_success(baseline), per held-out task, each arm's value
  pooled over its training seeds and samples;
  interval = two-sided `level` (default 95%) percentile paired cluster bootstrap of mean(d);
  verdict = "pass" iff the interval's LOWER bound >= margin (margin <= 0, e.g. -0.05), and
  "not meaningful" whatever the interval when the baseline's task success is under `floor`.
  A two-sided 95% interval's lower bound is a one-sided 97.5% bound, the usual convention of
  non-inferiority trials. With `ni_interval="seed_t"` the verdict instead uses the t-interval
  over training seeds of the per-seed differences (seeds paired by index); both intervals are
  always reported, only the configured one decides.

Two-level (`ni_interval="two_level"`, `two_level_bootstrap_ci`): both sources in one interval.
  D[s, i] = candidate - baseline on task i for training seed s (the seeds both arms ran,
  paired by seed; each run's per-task mean over its samples). A replicate draws S seeds with
  replacement (counts a_s) and then C clusters with replacement (counts b_c, a task i in
  cluster c(i)), the same draws for both arms, and takes
      d_r = sum_s a_s sum_i b_c(i) D[s, i] / (S * sum_i b_c(i)),
  the mean difference over the drawn seeds and the drawn tasks. Its percentile interval
  carries the seed-to-seed spread (a seed whose baseline collapsed moves d_r only in the
  replicates that draw it) and the item spread. With fewer than MIN_SEEDS seeds per arm the
  verdict is "exploratory": the interval is reported, no pass or fail.

A baseline run that collapsed (its own held-out task success under `floor`, whatever the
others') makes the verdict "not meaningful", whichever interval decides: a drop measured
against a run that lost its skill says nothing about skill kept.
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
NI_INTERVALS = ("two_level", "paired_bootstrap", "seed_t")
MIN_SEEDS = 3  # training seeds per arm under which a two-level verdict is "exploratory"
TRAIN_STD_LABEL = "mean +- std over the last K training steps (step-to-step spread, not a CI)"


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


def two_level_bootstrap_ci(
    cand_SxN: np.ndarray, base_SxN: np.ndarray, *, clusters_N: Sequence[str] | None = None,
    n_boot: int = 10_000, seed: int = 0, level: float = 0.95,
) -> Interval:  # fmt: skip
    """Paired two-level percentile bootstrap of mean(candidate - baseline): training seeds,
    then clusters of tasks within them (the module docstring has the formula).

    Args:
      cand_SxN, base_SxN: per seed (rows, paired) and task (columns, paired) values.
      clusters_N: cluster id per task (None: every task its own cluster).
    """
    d_SxN = np.asarray(cand_SxN, np.float64) - np.asarray(base_SxN, np.float64)
    if np.asarray(cand_SxN).shape != np.asarray(base_SxN).shape or d_SxN.ndim != 2:
        raise ValueError(f"paired [seeds, tasks] tables needed: {np.shape(cand_SxN)} vs "
                         f"{np.shape(base_SxN)}")  # fmt: skip
    num_s, n = d_SxN.shape
    if num_s == 0 or n == 0:
        raise ValueError("cannot bootstrap zero seeds or zero tasks")
    labels = list(range(n)) if clusters_N is None else list(clusters_N)
    if len(labels) != n:
        raise ValueError(f"{len(labels)} cluster ids for {n} items")
    index = {c: k for k, c in enumerate(dict.fromkeys(labels))}  # in order of appearance
    order, of_item_N = list(index), np.array([index[c] for c in labels])
    onehot_NxC = np.zeros((n, len(order)))
    onehot_NxC[np.arange(n), of_item_N] = 1.0
    sums_SxC, sizes_C = d_SxN @ onehot_NxC, onehot_NxC.sum(axis=0)
    rng = np.random.default_rng(seed)
    a_RxS = rng.multinomial(num_s, np.full(num_s, 1.0 / num_s), size=n_boot).astype(np.float64)
    b_RxC = rng.multinomial(len(order), np.full(len(order), 1.0 / len(order)), size=n_boot)
    b_RxC = b_RxC.astype(np.float64)
    num_R = np.einsum("rs,sc,rc->r", a_RxS, sums_SxC, b_RxC)
    means_R = num_R / (num_s * (b_RxC @ sizes_C))
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(means_R, [alpha, 1.0 - alpha])
    method = f"two-level paired bootstrap: {num_s} training seeds, then clusters of tasks"
    return Interval(float(d_SxN.mean()), float(low), float(high), level, method, n, len(order))


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


# -- non-inferiority ------------------------------------------------------------------------


def noninferiority(
    diff: Interval | Mapping[str, Any],
    margin: float,
    *,
    interval: str = "paired_bootstrap",
    baseline_success: float | None = None,
    floor: float = 0.0,
) -> dict[str, Any]:
    """Verdict on candidate - baseline task success against a margin fixed before the run.

    Args:
      diff: the interval of the difference (an `Interval` or a `seed_interval` dict).
      margin: the allowed drop, <= 0 (e.g. -0.05 = at most 5 points worse).
      interval: the name of the interval `diff` is (recorded in the result).
      baseline_success: the baseline arm's held-out task success (None: not checked).
      floor: below this baseline task success no drop can be measured (a baseline that solves
        nothing cannot get worse), and the verdict is "not meaningful".

    Returns:
      {"verdict": "pass" | "fail" | "undetermined" | "not meaningful", "lower", "margin",
      "interval", "level", "floor", "baseline_success"}: pass iff lower >= margin;
      "undetermined" when the lower bound is NaN (one seed under interval="seed_t").
    """
    if margin > 0:
        raise ValueError(f"a non-inferiority margin is an allowed drop, <= 0; got {margin}")
    d = diff.to_dict() if isinstance(diff, Interval) else dict(diff)
    lower = float(d["low"])
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
        "mean": float(d["mean"]),
        "margin": float(margin),
        "interval": interval,
        "level": float(d["level"]),
        "rule": "pass iff lower bound of the two-sided interval of (candidate - baseline) "
        "task success >= margin",
    }


# -- training-time numbers ------------------------------------------------------------------


def last_k_values(
    records: Sequence[Mapping[str, Any]], key: str, k: int, *, stage: str = "train"
) -> tuple[list[int], np.ndarray]:
    """The last k logged steps of `key` and their values (after a resume the last record of
    each step wins)."""
    latest: dict[int, float] = {}
    for r in records:
        if r.get("stage", stage) == stage and key in r:
            latest[int(r["step"])] = float(r[key])
    steps = sorted(latest)[-k:] if k > 0 else []
    return steps, np.array([latest[s] for s in steps], np.float64)


def last_k_mean_std(
    runs: Sequence[Sequence[Mapping[str, Any]]] | Sequence[Mapping[str, Any]],
    key: str,
    k: int,
    *,
    stage: str = "train",
) -> dict[str, Any]:
    """Mean +- std (ddof=0) of `key` over the last k logged steps (Table 1 style; NOT a CI).

    Args:
      runs: metrics.jsonl records of one run (`tg_jax.metrics.read_metrics`), or a list of
        such lists (several training seeds: their last-k values are pooled).
      key: metric name.
      k: how many of the last steps of each run.
      stage: which stage's records.

    Returns:
      {"mean", "std", "n", "first_step", "last_step", "label"}; NaN mean/std if no step has key.
    """
    if runs and isinstance(runs[0], Mapping):
        runs = [runs]
    parts = [last_k_values(r, key, k, stage=stage) for r in runs]
    vals = np.concatenate([v for _, v in parts]) if parts else np.zeros(0)
    steps = [s for st, _ in parts for s in st]
    return {
        "mean": float(vals.mean()) if vals.size else float("nan"),
        "std": float(vals.std()) if vals.size else float("nan"),
        "n": int(vals.size),
        "first_step": min(steps) if steps else None,
        "last_step": max(steps) if steps else None,
        "label": TRAIN_STD_LABEL,
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
    ni_interval: str = ReportSettings.ni_interval,
    floor: float = 0.0,
    n_boot: int = 10_000,
    seed: int = 0,
    level: float = 0.95,
    condition: str = "plain",
) -> dict[str, Any]:
    """Candidate - baseline on held-out tasks, with the non-inferiority verdict.

    Args:
      candidate, baseline: training seed -> held-out episodes, same tasks in every run.
      margin: allowed drop in task success (<= 0), fixed in the config before the run.
      ni_interval: which interval decides (see the module docstring): "two_level" (seeds,
        then tasks; "exploratory" under MIN_SEEDS seeds), "paired_bootstrap" (tasks, seeds
        pooled) or "seed_t" (t-interval over seeds of per-seed differences).
      floor: baseline task success under which the verdict is "not meaningful".

    Returns:
      {"paired_bootstrap": {metric: Interval dict}, "seed_t": {metric: seed_interval dict},
       "two_level": {metric: Interval dict}, "paired_seeds": [seeds present in both],
       "noninferiority": verdict dict (with "seeds": training seeds per arm)}.
    """
    if ni_interval not in NI_INTERVALS:
        raise ValueError(f"ni_interval must be one of {NI_INTERVALS}, got {ni_interval!r}")
    ids_c, cand = pooled_task_means([candidate[s] for s in sorted(candidate)], condition)
    ids_b, base = pooled_task_means([baseline[s] for s in sorted(baseline)], condition)
    if ids_c != ids_b:
        raise ValueError("arms must be evaluated on the same held-out tasks to be paired")
    metrics = sorted(set(cand) & set(base))
    clusters = task_clusters([*candidate.values(), *baseline.values()], ids_c)
    boot = {
        k: paired_bootstrap_ci(
            cand[k], base[k], clusters_N=clusters, n_boot=n_boot, seed=seed, level=level
        ).to_dict()
        for k in metrics
    }
    common = sorted(set(candidate) & set(baseline))
    b_means = {s: _seed_means(baseline[s], condition) for s in baseline}
    seed_t = {}
    if common:
        c_means = {s: _seed_means(candidate[s], condition) for s in common}
        seed_t = {
            k: seed_interval([c_means[s][k] - b_means[s][k] for s in common], level=level)
            for k in metrics
        }
    two = _two_level(candidate, baseline, common, metrics, clusters, condition,
                     n_boot=n_boot, seed=seed, level=level)  # fmt: skip
    nan = {"mean": float("nan"), "low": float("nan"), "level": level}
    diff = {"paired_bootstrap": boot, "seed_t": seed_t, "two_level": two}[ni_interval]
    ni = noninferiority(
        diff.get("task_success", nan), margin, interval=ni_interval,
        baseline_success=float(base["task_success"].mean()), floor=floor,
    )  # fmt: skip
    ni["seeds"] = {"candidate": sorted(candidate), "baseline": sorted(baseline)}
    ni["collapsed_baseline_seeds"] = sorted(
        s for s, m in b_means.items() if m.get("task_success", 0.0) < floor
    )
    meaningful = ni["verdict"] != "not meaningful"
    if ni["collapsed_baseline_seeds"] and meaningful:
        ni["verdict"] = "not meaningful"  # a collapsed run cannot show a kept skill
        ni["why"] = (f"baseline seed(s) {ni['collapsed_baseline_seeds']} collapsed: held-out "
                     f"task success under the floor {floor}")  # fmt: skip
    elif ni_interval == "two_level" and len(common) < MIN_SEEDS and meaningful:
        ni["verdict"] = "exploratory"
        ni["why"] = f"{len(common)} training seed(s) per arm, under {MIN_SEEDS}"
    return {"paired_bootstrap": boot, "seed_t": seed_t, "two_level": two,
            "paired_seeds": common, "noninferiority": ni}  # fmt: skip


def _two_level(candidate, baseline, common, metrics, clusters, condition, **kw) -> dict:
    """{metric: two-level Interval dict} over the seeds both arms ran ({} if none)."""
    if not common:
        return {}
    tables = {}
    for arm, runs in (("c", candidate), ("b", baseline)):
        tables[arm] = [task_means(runs[s], condition)[1] for s in common]
    return {
        k: two_level_bootstrap_ci(
            np.stack([t[k] for t in tables["c"]]), np.stack([t[k] for t in tables["b"]]),
            clusters_N=clusters, **kw,
        ).to_dict()
        for k in metrics
        if all(k in t for t in tables["c"] + tables["b"])
    }  # fmt: skip
