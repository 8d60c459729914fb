"""Held-out statistics against numpy / scipy computed by hand."""

import dataclasses
import math

import numpy as np
import pytest
import scipy.stats

from tg_jax.evaluation import stability, stats
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
    diff = {"mean": -0.01, "low": -0.04, "high": 0.02, "level": 0.95}
    assert stats.noninferiority(diff, -0.05)["verdict"] == "pass"
    assert stats.noninferiority(diff, -0.04)["verdict"] == "pass"  # lower == margin passes
    assert stats.noninferiority(diff, -0.03)["verdict"] == "fail"
    nan = {"mean": 0.0, "low": float("nan"), "level": 0.95}
    assert stats.noninferiority(nan, -0.05)["verdict"] == "undetermined"
    with pytest.raises(ValueError, match="<= 0"):
        stats.noninferiority(diff, 0.05)


def _arm(success_by_seed, tasks=20):
    """seed -> episodes where task i succeeds iff i < k (k per seed)."""
    return {
        s: [_rec(f"t{i:02d}", i < k, fence=True) for i in range(tasks)]
        for s, k in success_by_seed.items()
    }


def test_compare_arms_by_hand():
    base = _arm({0: 10, 1: 12})  # success 0.50, 0.60
    cand = _arm({0: 9, 1: 12})  # success 0.45, 0.60
    out = stats.compare_arms(cand, base, margin=-0.05)
    ts = out["difference"]["task_success"]
    # D[s, t]: seed 0 loses task t09 (-1), everything else 0; d.. = -1/40.
    # Row means -0.05, 0: MS_seed = 20 * 2 * 0.025^2 = 0.025 (1 df).
    # Column means: t09 -0.5, the others 0: MS_cluster = 2 * (0.475^2 + 19 * 0.025^2) / 19.
    ms_s, ms_c = 0.025, 2 * (0.475**2 + 19 * 0.025**2) / 19
    t_half = scipy.stats.t.ppf(0.975, 1) * np.sqrt(ms_s / 40)
    var = (ms_s + ms_c) / 40
    df = (40 * var) ** 2 / (ms_s**2 + ms_c**2 / 19)
    both_half = scipy.stats.t.ppf(0.975, df) * np.sqrt(var)
    half = max(t_half, both_half)
    assert half == pytest.approx(t_half)  # 2 seeds: the t-interval over seeds is the wider
    assert ts["mean"] == pytest.approx(-0.025)
    assert (ts["low"], ts["high"]) == pytest.approx((-0.025 - half, -0.025 + half))
    assert (ts["seeds"], ts["clusters"]) == (2, 20)
    assert out["per_seed"]["task_success"] == pytest.approx({0: -0.05, 1: 0.0})
    ni = out["noninferiority"]
    assert ni["lower"] == pytest.approx(ts["low"]) and ni["verdict"] == "exploratory"
    assert ni["seeds"] == {"candidate": [0, 1], "baseline": [0, 1]}
    assert stats.noninferiority_interval(
        np.array([[0.45], [0.6]]), np.array([[0.5], [0.6]]), level=0.95
    ) == pytest.approx((-0.025, -0.025 - scipy.stats.t.ppf(0.975, 1) * 0.025,
                        -0.025 + scipy.stats.t.ppf(0.975, 1) * 0.025))  # fmt: skip
    with pytest.raises(ValueError, match="same held-out tasks"):
        stats.compare_arms(_arm({0: 9}, tasks=19), _arm({0: 9}), margin=-0.05)


def test_the_interval_of_three_seeds_widens_with_the_level():
    # Per-seed differences +0.05 / 0 / -0.05 with no task noise: the t-interval over seeds,
    # +-t_2 * 0.05 / sqrt(3): +-0.124 at 95%, +-0.179 at 97.5%, +-0.343 at 99.3%, reaching far
    # past the worst and best seed (a bootstrap over 3 seed means never can).
    d = np.repeat(np.array([[0.05], [0.0], [-0.05]]), 16, axis=1)
    widths = []
    for level, half in ((0.95, 0.1242), (0.975, 0.1791), (0.993, 0.3432)):
        diff, low, high = stats.noninferiority_interval(d, np.zeros_like(d), level=level)
        by_hand = scipy.stats.t.ppf(0.5 + level / 2, 2) * 0.05 / np.sqrt(3)
        assert (diff, high - diff) == pytest.approx((0.0, by_hand))
        assert by_hand == pytest.approx(half, abs=1e-3) and low < -0.05
        widths.append(high - low)
    assert widths[0] < widths[1] < widths[2]


def _simulated_tables(rng, reps, seeds, seed_sd, arm_by_task_sd, tasks=128, clusters=16):
    """[reps, seeds, tasks] candidate and baseline tables whose true difference is 0: tasks
    in clusters with their own success level, a per-(arm, seed) shift of sd `seed_sd`, an
    arm-by-cluster effect split +-1/2 between the arms (symmetric, mean 0), two binomial
    samples per task and run."""
    of_task = np.repeat(np.arange(clusters), tasks // clusters)
    level = rng.uniform(0.2, 0.8, (reps, 1, clusters))[..., of_task]
    p = np.clip(level + rng.normal(0, 0.1, (reps, 1, tasks)), 0.02, 0.98)
    v = rng.normal(0, arm_by_task_sd, (reps, 1, clusters))[..., of_task] / 2
    out = []
    for sign in (1, -1):
        shift = rng.normal(0, seed_sd, (reps, seeds, 1))
        out.append(rng.binomial(2, np.clip(p + sign * v + shift, 0, 1)) / 2)
    return out[0], out[1], [f"c{k}" for k in of_task]


@pytest.mark.slow
def test_the_lower_bound_misses_the_truth_at_most_alpha_over_two():
    """Coverage of the verdict's interval, simulated with a known truth (difference 0).

    Monte-Carlo error of a miss rate near 0.025 over 1500 replications: sd 0.004; a rate
    above 0.025 + 3 sd fails. The z-interval over seeds (what `power` assumed) is run on the
    same tables: it misses far more often at 3 seeds, so the simulation can tell."""
    rng, reps, alpha_half = np.random.default_rng(0), 1500, 0.025
    bound = alpha_half + 3 * np.sqrt(alpha_half * (1 - alpha_half) / reps)
    z = scipy.stats.norm.ppf(0.975)
    rates = {}
    for seeds, seed_sd, arm_by_task in [(3, 0.0, 0.0), (3, 0.06, 0.0), (3, 0.10, 0.0),
                                        (5, 0.0, 0.0), (5, 0.06, 0.0), (5, 0.10, 0.0),
                                        (10, 0.0, 0.0), (10, 0.06, 0.0), (10, 0.10, 0.0),
                                        (10, 0.0, 0.1)]:  # fmt: skip
        cand, base, clusters = _simulated_tables(rng, reps, seeds, seed_sd, arm_by_task)
        lows = np.array([stats.noninferiority_interval(c, b, clusters)[1]
                         for c, b in zip(cand, base, strict=True)])  # fmt: skip
        d_RxS = (cand - base).mean(axis=2)
        z_lows = d_RxS.mean(1) - z * d_RxS.std(1, ddof=1) / np.sqrt(seeds)
        rates[seeds, seed_sd, arm_by_task] = (float((lows > 0).mean()), float((z_lows > 0).mean()))
    for key, (miss, z_miss) in rates.items():
        print(f"S={key[0]:2d} seed sd {key[1]:.2f} arm-by-task sd {key[2]:.1f}: lower bound "
              f"above the truth in {miss:.3f} (z over seeds: {z_miss:.3f})")  # fmt: skip
    assert all(miss <= bound for miss, _ in rates.values()), rates
    assert all(rates[3, sd, 0.0][1] > 0.05 for sd in (0.0, 0.06, 0.10)), rates


def test_summarize_arm_diagnostic():
    runs = {
        0: [_rec(f"t{i}", i < 3, fence=False) for i in range(6)]
        + [_rec(f"t{i}", i < 3, fence=True, cond="hinted") for i in range(6)]
    }
    out = stats.summarize_arm(runs)
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
    out = stability.last_k_mean_std(recs, "rollout/compliance", 3)
    vals = [0.8, 0.9, 0.0]
    assert out["mean"] == pytest.approx(np.mean(vals)) and out["std"] == pytest.approx(np.std(vals))
    assert (out["n"], out["first_step"], out["last_step"]) == (3, 8, 10)
    assert "not a CI" in out["label"]


def test_last_k_pools_seeds():
    a = [{"step": s, "stage": "train", "c": float(s)} for s in range(1, 6)]
    b = [{"step": s, "stage": "train", "c": 10.0 * s} for s in range(1, 6)]
    out = stability.last_k_mean_std([a, b], "c", 2)
    vals = [4.0, 5.0, 40.0, 50.0]
    assert out["mean"] == pytest.approx(np.mean(vals)) and out["std"] == pytest.approx(np.std(vals))
    assert out["n"] == 4
    assert math.isnan(stability.last_k_mean_std(a, "missing", 3)["mean"])


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


def test_compare_arms_and_the_summary_use_clusters():
    def arm(k, seeds=(0, 1, 2)):
        return {s: [dataclasses.replace(_rec(f"t{i:02d}", i < k + s), cluster_id=f"f{i // 5}")
                    for i in range(20)] for s in seeds}  # fmt: skip

    base, cand = arm(10), arm(5)
    out = stats.compare_arms(cand, base, margin=-0.05)
    ts = out["difference"]["task_success"]
    d = np.array([[-1.0 if 5 + s <= i < 10 + s else 0.0 for i in range(20)] for s in range(3)])
    clusters = [f"f{i // 5}" for i in range(20)]
    assert (ts["mean"], ts["low"], ts["high"]) == pytest.approx(
        stats.noninferiority_interval(d, np.zeros_like(d), clusters)
    )
    assert ts["clusters"] == 4 and out["noninferiority"]["verdict"] == "fail"
    # A cluster's column is (C / T) * the sum of its tasks: row means are the task means.
    table = stats.cluster_table(np.array([[1.0, 0.0, 0.0, 1.0]]), ["a", "a", "b", "c"])
    assert table == pytest.approx(np.array([[0.75, 0.0, 0.75]]))
    summary = stats.summarize_arm(base, n_boot=100)
    assert summary["plain"]["num_tasks"] == 20 and summary["plain"]["num_clusters"] == 4
    bad = {0: base[0][:-1] + [dataclasses.replace(base[0][-1], cluster_id="other")],
           1: base[0]}  # fmt: skip
    with pytest.raises(ValueError, match="two cluster ids"):
        stats.summarize_arm(bad, n_boot=10)


def test_noninferiority_under_the_floor_is_not_meaningful():
    diff = {"mean": 0.0, "low": -0.01, "high": 0.01, "level": 0.95}
    ok = stats.noninferiority(diff, -0.05, baseline_success=0.3, floor=0.1)
    assert ok["verdict"] == "pass" and ok["floor"] == 0.1
    low = stats.noninferiority(diff, -0.05, baseline_success=0.05, floor=0.1)
    assert low["verdict"] == "not meaningful" and low["baseline_success"] == 0.05
    base = _arm({0: 1, 1: 1, 2: 1})  # baseline success 0.05
    out = stats.compare_arms(_arm({0: 1, 1: 1, 2: 1}), base, margin=-0.05, floor=0.1)
    assert out["noninferiority"]["verdict"] == "not meaningful"
    out = stats.compare_arms(_arm({0: 1, 1: 1, 2: 1}), base, margin=-0.05, floor=0.0)
    assert out["noninferiority"]["verdict"] == "pass"


def test_a_baseline_seed_far_under_the_base_model_collapsed():
    # Baseline seeds at 0.50, 0.55 and 0.15: seed 2 is above the floor (0.1) but 0.35 under
    # the base model's 0.5, more than collapse_drop 0.1 -> "not meaningful", naming seed 2.
    base = _arm({0: 10, 1: 11, 2: 3})
    cand = _arm({0: 10, 1: 11, 2: 10})
    kw = dict(margin=-0.05, floor=0.1, collapse_drop=0.1)
    out = stats.compare_arms(cand, base, base_success=0.5, **kw)["noninferiority"]
    assert out["verdict"] == "not meaningful" and out["collapsed_baseline_seeds"] == [2]
    assert "seed(s) [2]" in out["why"] and "under the base model's 0.500" in out["why"]
    # Without the base's figure only the floor applies: the verdict is decided.
    free = stats.compare_arms(cand, base, base_success=None, **kw)["noninferiority"]
    assert free["verdict"] in ("pass", "fail") and free["collapsed_baseline_seeds"] == []
    # Within the drop: decided too.
    near = stats.compare_arms(cand, base, base_success=0.2, **kw)["noninferiority"]
    assert near["verdict"] in ("pass", "fail")


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


def test_a_verdict_from_fewer_than_three_seeds_is_exploratory_and_three_decide():
    base = _arm({0: 10})
    one = stats.compare_arms(_arm({0: 10}), base, margin=-0.05)
    assert one["noninferiority"]["verdict"] == "exploratory"
    assert "1 training seed(s) per arm, under 3" in one["noninferiority"]["why"]
    base3 = _arm({0: 10, 1: 11, 2: 12})
    same = stats.compare_arms(_arm({0: 10, 1: 11, 2: 12}), base3, margin=-0.05)
    assert same["noninferiority"]["verdict"] == "pass" and same["noninferiority"]["lower"] == 0.0
    worse = stats.compare_arms(_arm({0: 4, 1: 5, 2: 6}), base3, margin=-0.05)
    assert worse["noninferiority"]["verdict"] == "fail"


def test_a_collapsed_baseline_seed_makes_the_verdict_not_meaningful():
    base = _arm({0: 10, 1: 0, 2: 12})  # seed 1 collapsed (0.00); pooled 0.37 is over the floor
    cand = _arm({0: 10, 1: 11, 2: 12})
    out = stats.compare_arms(cand, base, margin=-0.05, floor=0.1)
    ni = out["noninferiority"]
    assert ni["baseline_success"] == pytest.approx(22 / 60)
    assert ni["verdict"] == "not meaningful" and ni["collapsed_baseline_seeds"] == [1]
    assert "baseline seed(s) [1] collapsed" in ni["why"]
    healthy = stats.compare_arms(cand, _arm({0: 10, 1: 11, 2: 12}), margin=-0.05, floor=0.1)
    assert healthy["noninferiority"]["verdict"] == "pass"
    assert healthy["noninferiority"]["collapsed_baseline_seeds"] == []
