"""Held-out statistics against numpy / scipy computed by hand."""

import dataclasses
import math

import numpy as np
import pytest
import scipy.stats

from tg_jax.evaluation import stats
from tg_jax.sampling.episode import EpisodeRecord, episode_compliance


def _rec(task, success, fence=True, cond="plain", sample=0, actions=None):
    return EpisodeRecord(
        task_id=task,
        condition=cond,
        sample=sample,
        task_success=success,
        compliance={"fence": fence},
        actions=actions or {"run_tests": 1, "submit": 1, "malformed": 0},
        turns=2,
    )


def test_episode_compliance_and_joint():
    comp = episode_compliance({"fence": [True, None, True], "tool_json": [None, None]})
    assert comp == {"fence": True, "tool_json": False}  # no judged turn never counts as met
    assert episode_compliance({"fence": [True, False]}) == {"fence": False}
    r = _rec("a", True, fence=True)
    assert r.compliant and r.joint
    r = _rec("a", True, fence=False)
    assert not r.compliant and not r.joint
    assert EpisodeRecord.from_dict(r.to_dict()) == r
    with pytest.raises(ValueError, match="condition"):
        _rec("a", True, cond="other")


def test_task_means_average_samples_first():
    # Task a: 3 samples (2 successes); task b: 1 sample (0 successes).
    recs = [_rec("a", True, sample=0), _rec("a", True, sample=1), _rec("a", False, sample=2)]
    recs += [_rec("b", False), _rec("b", True, cond="hinted")]
    ids, table = stats.task_means(recs)
    assert ids == ["a", "b"]
    np.testing.assert_allclose(table["task_success"], [2 / 3, 0.0])
    np.testing.assert_allclose(table["actions/run_tests"], [1.0, 1.0])
    # Pooling seeds weighs each run equally, whatever its sample count.
    other = [_rec("a", False), _rec("b", True)]
    _, pooled = stats.pooled_task_means([recs, other])
    np.testing.assert_allclose(pooled["task_success"], [(2 / 3 + 0) / 2, (0 + 1) / 2])
    with pytest.raises(ValueError, match="same held-out tasks"):
        stats.pooled_task_means([recs, [_rec("c", True)]])


def test_bootstrap_matches_numpy_loop():
    values = np.array([0.0, 1.0, 1.0, 0.5, 0.25, 1.0, 0.0])
    ci = stats.bootstrap_ci(values, n_boot=2000, seed=3, level=0.9)
    rng = np.random.default_rng(3)
    idx = rng.integers(0, len(values), size=(2000, len(values)))
    means = np.array([values[row].mean() for row in idx])
    assert ci.mean == pytest.approx(values.mean())
    assert ci.low == pytest.approx(np.quantile(means, 0.05))
    assert ci.high == pytest.approx(np.quantile(means, 0.95))
    assert ci.n == 7 and ci.level == 0.9
    # Fixed seed: the same interval every time.
    assert stats.bootstrap_ci(values, n_boot=2000, seed=3, level=0.9) == ci


def test_paired_bootstrap_cancels_shared_item_variance():
    rng = np.random.default_rng(0)
    difficulty = rng.uniform(0, 1, size=200)  # shared between arms
    a = difficulty + 0.02
    b = difficulty
    paired = stats.paired_bootstrap_ci(a, b, n_boot=500, seed=0)
    assert paired.mean == pytest.approx(0.02)
    assert paired.low == pytest.approx(0.02) and paired.high == pytest.approx(0.02)
    # Unpaired resampling of each arm would give a wide interval around 0.02.
    ia = stats.bootstrap_ci(a, n_boot=500, seed=0)
    assert ia.high - ia.low > 0.05
    with pytest.raises(ValueError, match="same items"):
        stats.paired_bootstrap_ci(a, b[:-1])


def test_seed_interval_is_student_t():
    v = [0.31, 0.35, 0.28, 0.40]
    out = stats.seed_interval(v, level=0.95)
    m, s = np.mean(v), np.std(v, ddof=1)
    half = scipy.stats.t.ppf(0.975, 3) * s / math.sqrt(4)
    assert out["mean"] == pytest.approx(m) and out["std"] == pytest.approx(s)
    assert out["low"] == pytest.approx(m - half) and out["high"] == pytest.approx(m + half)
    one = stats.seed_interval([0.3])
    assert one["mean"] == 0.3 and math.isnan(one["std"]) and math.isnan(one["low"])


def test_noninferiority_verdicts():
    diff = stats.Interval(mean=-0.01, low=-0.04, high=0.02, level=0.95, method="x", n=50)
    assert stats.noninferiority(diff, -0.05)["verdict"] == "pass"
    assert stats.noninferiority(diff, -0.04)["verdict"] == "pass"  # lower == margin passes
    assert stats.noninferiority(diff, -0.03)["verdict"] == "fail"
    nan = {"mean": 0.0, "low": float("nan"), "level": 0.95}
    assert stats.noninferiority(nan, -0.05, interval="seed_t")["verdict"] == "undetermined"
    with pytest.raises(ValueError, match="<= 0"):
        stats.noninferiority(diff, 0.05)


def _arm(success_by_seed, tasks=20):
    """seed -> episodes where task i succeeds iff i < k (k per seed)."""
    return {
        s: [_rec(f"t{i:02d}", i < k, fence=True) for i in range(tasks)]
        for s, k in success_by_seed.items()
    }


def test_compare_arms_paired_and_seed_t():
    base = _arm({0: 10, 1: 12})  # success 0.50, 0.60
    cand = _arm({0: 9, 1: 12})  # success 0.45, 0.60
    out = stats.compare_arms(
        cand, base, margin=-0.05, ni_interval="paired_bootstrap", n_boot=1000, seed=0
    )
    ts = out["paired_bootstrap"]["task_success"]
    assert ts["mean"] == pytest.approx(-0.025)
    # Per-task differences: task t09 is -0.5 (one seed lost it), every other task 0.
    d = np.zeros(20)
    d[9] = -0.5
    ref = stats.bootstrap_ci(d, n_boot=1000, seed=0)
    assert ts["low"] == pytest.approx(ref.low) and ts["high"] == pytest.approx(ref.high)
    ni = out["noninferiority"]
    assert ni["interval"] == "paired_bootstrap" and ni["lower"] == pytest.approx(ref.low)
    assert ni["verdict"] == ("pass" if ref.low >= -0.05 else "fail")
    seed_t = out["seed_t"]["task_success"]
    assert seed_t["mean"] == pytest.approx(-0.025)
    assert seed_t["std"] == pytest.approx(np.std([-0.05, 0.0], ddof=1))
    out_t = stats.compare_arms(cand, base, margin=-0.05, ni_interval="seed_t", n_boot=100)
    assert out_t["noninferiority"]["lower"] == pytest.approx(seed_t["low"])
    assert out_t["noninferiority"]["verdict"] == "fail"  # 2 seeds: a very wide t-interval
    # A clear drop fails the paired bootstrap verdict.
    worse = _arm({0: 5, 1: 6})
    out_w = stats.compare_arms(worse, base, margin=-0.05, ni_interval="paired_bootstrap")
    assert out_w["noninferiority"]["verdict"] == "fail"
    # The default (two-level) with 2 seeds per arm: exploratory, its interval reported.
    two = stats.compare_arms(worse, base, margin=-0.05)
    assert two["noninferiority"]["verdict"] == "exploratory"
    assert two["noninferiority"]["interval"] == "two_level"
    assert two["noninferiority"]["seeds"] == {"candidate": [0, 1], "baseline": [0, 1]}
    assert two["noninferiority"]["lower"] == two["two_level"]["task_success"]["low"]


def test_summarize_arm_diagnostic():
    runs = {
        0: [_rec(f"t{i}", i < 3, fence=False) for i in range(6)]
        + [_rec(f"t{i}", i < 3, fence=True, cond="hinted") for i in range(6)]
    }
    out = stats.summarize_arm(runs, n_boot=200)
    assert out["plain"]["bootstrap"]["compliance"]["mean"] == 0.0
    assert out["hinted"]["bootstrap"]["compliance"]["mean"] == 1.0
    assert out["plain"]["per_seed"]["0"]["task_success"] == pytest.approx(0.5)
    diag = out["diagnostic"]["compliance"]
    assert diag["mean"] == 1.0 and diag["low"] == 1.0
    assert math.isnan(out["plain"]["seeds"]["task_success"]["std"])


def test_last_k_mean_std_uses_last_record_per_step():
    recs = [{"step": s, "stage": "train", "rollout/compliance": s / 10} for s in range(1, 11)]
    recs.append({"step": 10, "stage": "train", "rollout/compliance": 0.0})  # re-logged after resume
    recs.append({"step": 11, "stage": "eval", "rollout/compliance": 5.0})  # other stage
    out = stats.last_k_mean_std(recs, "rollout/compliance", 3)
    vals = [0.8, 0.9, 0.0]
    assert out["mean"] == pytest.approx(np.mean(vals)) and out["std"] == pytest.approx(np.std(vals))
    assert (out["n"], out["first_step"], out["last_step"]) == (3, 8, 10)
    assert "not a CI" in out["label"]


def test_last_k_pools_seeds():
    a = [{"step": s, "stage": "train", "c": float(s)} for s in range(1, 6)]
    b = [{"step": s, "stage": "train", "c": 10.0 * s} for s in range(1, 6)]
    out = stats.last_k_mean_std([a, b], "c", 2)
    vals = [4.0, 5.0, 40.0, 50.0]
    assert out["mean"] == pytest.approx(np.mean(vals)) and out["std"] == pytest.approx(np.std(vals))
    assert out["n"] == 4
    assert math.isnan(stats.last_k_mean_std(a, "missing", 3)["mean"])


def test_cluster_id_defaults_to_the_task_and_old_records_load():
    r = _rec("a", True)
    assert r.cluster_id == "a"
    old = r.to_dict()
    old.pop("cluster_id")  # a heldout.jsonl written before clusters existed
    assert EpisodeRecord.from_dict(old) == r
    c = EpisodeRecord("b", "plain", 0, True, {"fence": True}, {}, 1, cluster_id="add:3")
    assert EpisodeRecord.from_dict(c.to_dict()).cluster_id == "add:3"


def test_cluster_bootstrap_resamples_whole_clusters():
    values = np.array([0.0, 1.0, 1.0, 0.5, 0.25, 1.0, 0.0])
    # One task per cluster: the plain bootstrap over tasks, with the same draws.
    single = stats.bootstrap_ci(values, clusters_N=list("abcdefg"), n_boot=2000, seed=3)
    plain = stats.bootstrap_ci(values, n_boot=2000, seed=3)
    assert (single.low, single.high, single.mean) == pytest.approx((plain.low, plain.high,
                                                                    plain.mean))  # fmt: skip
    assert single.clusters == 7 and plain.clusters == 7
    # Clusters of unequal size against a numpy loop: a replicate draws C clusters and averages
    # the tasks they hold.
    clusters = ["x", "x", "y", "y", "y", "z", "w"]
    ci = stats.bootstrap_ci(values, clusters_N=clusters, n_boot=2000, seed=3, level=0.9)
    members = {c: values[[i for i, k in enumerate(clusters) if k == c]] for c in "xyzw"}
    order = ["x", "y", "z", "w"]
    idx = np.random.default_rng(3).integers(0, 4, size=(2000, 4))
    means = np.array([np.concatenate([members[order[j]] for j in row]).mean() for row in idx])
    assert ci.mean == pytest.approx(values.mean()) and (ci.n, ci.clusters) == (7, 4)
    assert ci.low == pytest.approx(np.quantile(means, 0.05))
    assert ci.high == pytest.approx(np.quantile(means, 0.95))
    assert "clusters" in ci.method
    # 40 tasks that are 4 functions x 10 copies: the interval is that of 4 items, not 40.
    rng = np.random.default_rng(0)
    per_fn = rng.uniform(0, 1, size=4)
    copies = np.repeat(per_fn, 10)
    fns = [f"f{i}" for i in range(4) for _ in range(10)]
    naive = stats.bootstrap_ci(copies, n_boot=2000, seed=0)
    clustered = stats.bootstrap_ci(copies, clusters_N=fns, n_boot=2000, seed=0)
    of_four = stats.bootstrap_ci(per_fn, n_boot=2000, seed=0)
    assert clustered.high - clustered.low > 2 * (naive.high - naive.low)
    assert clustered.low == pytest.approx(of_four.low)
    assert clustered.high == pytest.approx(of_four.high)
    with pytest.raises(ValueError, match="cluster ids for"):
        stats.bootstrap_ci(values, clusters_N=["a"])


def test_paired_cluster_bootstrap_and_compare_arms_use_clusters():
    def arm(k):
        return {0: [dataclasses.replace(_rec(f"t{i:02d}", i < k), cluster_id=f"f{i // 5}")
                    for i in range(20)]}  # fmt: skip

    base, cand = arm(10), arm(5)
    out = stats.compare_arms(cand, base, margin=-0.05, n_boot=500, seed=1)
    d = np.array([-1.0 if 5 <= i < 10 else 0.0 for i in range(20)])
    ref = stats.paired_bootstrap_ci(
        d, np.zeros(20), clusters_N=[f"f{i // 5}" for i in range(20)], n_boot=500, seed=1
    )
    ts = out["paired_bootstrap"]["task_success"]
    assert (ts["low"], ts["high"], ts["clusters"]) == (ref.low, ref.high, 4)
    summary = stats.summarize_arm(base, n_boot=100)
    assert summary["plain"]["num_tasks"] == 20 and summary["plain"]["num_clusters"] == 4
    bad = {0: base[0][:-1] + [dataclasses.replace(base[0][-1], cluster_id="other")],
           1: base[0]}  # fmt: skip
    with pytest.raises(ValueError, match="two cluster ids"):
        stats.summarize_arm(bad, n_boot=10)


def test_noninferiority_under_the_floor_is_not_meaningful():
    diff = stats.Interval(mean=0.0, low=-0.01, high=0.01, level=0.95, method="x", n=50)
    ok = stats.noninferiority(diff, -0.05, baseline_success=0.3, floor=0.1)
    assert ok["verdict"] == "pass" and ok["floor"] == 0.1
    low = stats.noninferiority(diff, -0.05, baseline_success=0.05, floor=0.1)
    assert low["verdict"] == "not meaningful" and low["baseline_success"] == 0.05
    base = _arm({0: 1})  # baseline success 0.05
    out = stats.compare_arms(_arm({0: 1}), base, margin=-0.05, floor=0.1, n_boot=50)
    assert out["noninferiority"]["verdict"] == "not meaningful"
    assert stats.compare_arms(_arm({0: 1}), base, margin=-0.05, n_boot=50,
                              ni_interval="paired_bootstrap")[
        "noninferiority"]["verdict"] == "pass"  # fmt: skip


def test_conditional_requirement_met_where_it_never_applied():
    verdicts = {"ask_first": [None, None], "tool_protocol": [True, True], "files_named": [None]}
    assert episode_compliance(verdicts) == {
        "ask_first": False,
        "tool_protocol": True,
        "files_named": False,
    }
    got = episode_compliance(verdicts, {"ask_first", "files_named"})
    assert got == {"ask_first": True, "tool_protocol": True, "files_named": True}
    # Judged turns still decide: a failed one fails it, conditional or not.
    assert episode_compliance({"ask_first": [None, False]}, {"ask_first"}) == {"ask_first": False}


def _two_level_loop(d_SxN, clusters_N, n_boot, seed):
    """The two-level bootstrap written out: per replicate, the drawn seeds (with repeats) and
    the tasks of the drawn clusters (with repeats), and the plain mean over those pairs; the
    same draws as `two_level_bootstrap_ci` (seed counts first, then cluster counts)."""
    num_s, n = d_SxN.shape
    order = list(dict.fromkeys(clusters_N))
    rng = np.random.default_rng(seed)
    a = rng.multinomial(num_s, np.full(num_s, 1.0 / num_s), size=n_boot)
    b = rng.multinomial(len(order), np.full(len(order), 1.0 / len(order)), size=n_boot)
    out = []
    for r in range(n_boot):
        seeds = [s for s in range(num_s) for _ in range(a[r, s])]
        tasks = [i for c in range(len(order)) for _ in range(b[r, c])
                 for i in range(n) if clusters_N[i] == order[c]]  # fmt: skip
        out.append(np.mean([np.mean([d_SxN[s, i] for i in tasks]) for s in seeds]))
    return np.array(out)


def test_two_level_bootstrap_matches_the_explicit_resample():
    rng = np.random.default_rng(3)
    cand, base = rng.random((4, 12)), rng.random((4, 12))
    clusters = [f"f{i % 5}" for i in range(12)]  # 5 clusters of 2-3 tasks
    got = stats.two_level_bootstrap_ci(cand, base, clusters_N=clusters, n_boot=300, seed=7)
    ref = _two_level_loop(cand - base, clusters, 300, 7)
    assert (got.low, got.high) == pytest.approx(tuple(np.quantile(ref, [0.025, 0.975])))
    assert got.mean == pytest.approx(float((cand - base).mean()))
    assert (got.n, got.clusters) == (12, 5)


def test_two_level_carries_the_seed_spread_the_pooled_bootstrap_hides():
    # Per seed the arms differ by +0.2, -0.2 and 0 on every task: pooled over seeds every
    # task's difference is 0, so the item-only interval is [0, 0]; the two-level one is not.
    d = np.array([[0.2] * 10, [-0.2] * 10, [0.0] * 10])
    pooled = stats.paired_bootstrap_ci(d.mean(axis=0), np.zeros(10), n_boot=500, seed=0)
    assert (pooled.low, pooled.high) == (0.0, 0.0)
    two = stats.two_level_bootstrap_ci(d, np.zeros_like(d), n_boot=2000, seed=0)
    # A replicate's value is the mean of 3 seeds drawn from {+0.2, -0.2, 0}: from -0.2 to +0.2
    # in steps of 0.2/3; P(all three +0.2) = 1/27 > 2.5%, so the upper bound is +0.2 itself.
    assert two.high == pytest.approx(0.2) and two.low == pytest.approx(-0.2)
    # No spread at all: the interval is the point.
    flat = stats.two_level_bootstrap_ci(np.full((3, 4), 0.7), np.full((3, 4), 0.6), n_boot=50)
    assert (flat.low, flat.mean, flat.high) == pytest.approx((0.1, 0.1, 0.1))


def test_a_verdict_from_fewer_than_three_seeds_is_exploratory_and_three_decide():
    base = _arm({0: 10})
    one = stats.compare_arms(_arm({0: 10}), base, margin=-0.05, n_boot=200)
    assert one["noninferiority"]["verdict"] == "exploratory"
    assert "1 training seed(s) per arm, under 3" in one["noninferiority"]["why"]
    base3 = _arm({0: 10, 1: 11, 2: 12})
    same = stats.compare_arms(_arm({0: 10, 1: 11, 2: 12}), base3, margin=-0.05, n_boot=200)
    assert same["noninferiority"]["verdict"] == "pass" and same["noninferiority"]["lower"] == 0.0
    worse = stats.compare_arms(_arm({0: 4, 1: 5, 2: 6}), base3, margin=-0.05, n_boot=200)
    assert worse["noninferiority"]["verdict"] == "fail"


def test_a_collapsed_baseline_seed_makes_the_verdict_not_meaningful():
    base = _arm({0: 10, 1: 0, 2: 12})  # seed 1 collapsed (0.00); pooled 0.37 is over the floor
    cand = _arm({0: 10, 1: 11, 2: 12})
    out = stats.compare_arms(cand, base, margin=-0.05, floor=0.1, n_boot=200)
    ni = out["noninferiority"]
    assert ni["baseline_success"] == pytest.approx(22 / 60)
    assert ni["verdict"] == "not meaningful" and ni["collapsed_baseline_seeds"] == [1]
    assert "baseline seed(s) [1] collapsed" in ni["why"]
    healthy = stats.compare_arms(cand, _arm({0: 10, 1: 11, 2: 12}), margin=-0.05, floor=0.1,
                                 n_boot=200)  # fmt: skip
    assert healthy["noninferiority"]["verdict"] == "pass"
    assert healthy["noninferiority"]["collapsed_baseline_seeds"] == []
