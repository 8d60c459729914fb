"""report.md / results.json / plots from synthetic run results."""

import json
import os

import numpy as np
import pytest

from tg_jax.evaluation import report
from tg_jax.sampling.episode import EpisodeRecord


def _episodes(success_k, comply, tasks=20, hinted=True):
    """Task i succeeds iff i < success_k; plain compliance `comply`, hinted always compliant."""
    out = []
    for i in range(tasks):
        for cond in ("plain", "hinted") if hinted else ("plain",):
            out.append(
                EpisodeRecord(
                    task_id=f"t{i:02d}",
                    condition=cond,
                    sample=0,
                    task_success=i < success_k,
                    compliance={"fence": comply or cond == "hinted"},
                    actions={"run_tests": i % 3, "submit": 1, "malformed": int(i == 0)},
                    turns=1 + i % 3,
                )
            )
    return out


def _curves(seed, compliance_end, steps=40):
    recs = []
    for s in range(1, steps + 1):
        c = compliance_end * s / steps
        recs.append({"step": s, "stage": "train", "rollout/compliance": c + 0.01 * seed,
                     "rollout/task_success": 0.33, "rollout/joint": 0.3 * c,
                     "rollout/actions/run_tests": 0.5 + s / steps})  # fmt: skip
        if s % 10 == 0:
            recs.append({"step": s, "stage": "eval", "heldout/compliance": c,
                         "heldout/task_success": 0.3})  # fmt: skip
    return recs


def _runs(seeds=(0, 1)):
    costs = {"wall_time_s": 10.0, "sampled_tokens": 1e6, "teacher_forward_flops": 0.0,
             "peak_memory_bytes": 2e9}  # fmt: skip
    runs = []
    for seed in seeds:
        runs.append(report.RunResult("grpo", seed, _episodes(10, False), _curves(seed, 0.0),
                                     dict(costs, wall_time_s=10.0 + seed)))  # fmt: skip
        runs.append(report.RunResult("tg", seed, _episodes(10 - seed, True), _curves(seed, 0.9),
                                     dict(costs, teacher_forward_flops=5e12)))  # fmt: skip
    runs.append(report.RunResult("tg_wrong", 0, _episodes(4, True, hinted=False),
                                 _curves(0, 0.5), costs, group="stress",
                                 description="50% wrong hints"))  # fmt: skip
    return runs


def test_write_report(tmp_path):
    runs = _runs()
    settings = report.ReportSettings(margin=-0.05, n_boot=500, last_k=8)
    res = report.write_report(tmp_path, runs, settings)
    files = ("report.md", "results.json", "curve_compliance.png", "curve_task_success.png",
             "curve_compliance_stress.png", "curve_task_success_stress.png",
             "curve_actions.png", "curve_actions_stress.png",
             "heldout_differences.png")  # fmt: skip
    for name in files:
        assert os.path.getsize(tmp_path / name) > 0, name
    # One curve figure per group: main = baseline + main arms; stress = references + stress.
    assert report.curve_groups(res) == {
        "main": ["grpo", "tg"],
        "stress": ["grpo", "tg", "tg_wrong"],
    }
    with open(tmp_path / "results.json") as f:
        loaded = json.load(f)
    assert loaded == json.loads(json.dumps(res))
    # Inputs round-trip exactly.
    for run, stored in zip(runs, loaded["runs"], strict=True):
        assert (stored["arm"], stored["seed"], stored["costs"]) == (run.arm, run.seed, run.costs)
        assert [EpisodeRecord.from_dict(e) for e in stored["heldout"]] == run.heldout
        curve = stored["curves"]["train:rollout/compliance"]
        assert curve == [[r["step"], r["rollout/compliance"]] for r in run.train_records
                         if r["stage"] == "train"]  # fmt: skip
        # Every logged action has its curve too (per-episode counts over training).
        actions = stored["curves"]["train:rollout/actions/run_tests"]
        assert actions == [[s, 0.5 + s / 40] for s in range(1, 41)]
    assert report.action_names(loaded) == ["run_tests"]
    # Derived numbers equal the inputs.
    tg = loaded["arms"]["tg"]
    assert tg["heldout"]["plain"]["per_seed"]["1"]["task_success"] == pytest.approx(9 / 20)
    assert tg["heldout"]["plain"]["bootstrap"]["task_success"]["mean"] == pytest.approx(9.5 / 20)
    assert tg["heldout"]["plain"]["bootstrap"]["compliance"]["mean"] == 1.0
    assert loaded["arms"]["grpo"]["heldout"]["diagnostic"]["compliance"]["mean"] == 1.0
    last = [0.9 * s / 40 + 0.01 * seed for seed in (0, 1) for s in range(33, 41)]
    assert tg["train_last_k"]["compliance"]["mean"] == pytest.approx(np.mean(last))
    assert tg["train_last_k"]["compliance"]["std"] == pytest.approx(np.std(last))
    assert loaded["arms"]["grpo"]["costs"]["wall_time_s"]["mean"] == pytest.approx(10.5)
    # Verdict: TG - GRPO = -0.025 on task success over 2 seeds: exploratory, interval shown.
    ni = loaded["noninferiority"]
    assert ni == loaded["comparisons"]["tg"]["noninferiority"]
    d = loaded["comparisons"]["tg"]["difference"]["task_success"]
    assert ni["mean"] == pytest.approx(-0.025) and ni["lower"] == d["low"]
    assert ni["verdict"] == "exploratory"
    assert loaded["comparisons"]["tg"]["per_seed"]["task_success"] == {"0": 0.0, "1": -0.05}
    assert loaded["comparisons"]["tg_wrong"]["noninferiority"]["verdict"] == "exploratory"
    md = (tmp_path / "report.md").read_text()
    assert "success: EXPLORATORY" in md and "0: 0.000, 1: -0.050" in md
    assert "not a confidence interval" in md and "Stress tests" in md and "50% wrong hints" in md
    assert "Diagnostic: plain vs hinted" in md and "Side effects" in md
    for name in files[2:]:
        assert f"]({name})" in md, name  # every plot is linked from the report
    # No SFT time and no evaluation times given: the compute time is a lower bound.
    ct = loaded["compute_time"]
    assert ct["complete"] is False and ct["eval_runs"] == 0 and ct["runs"] == len(runs)
    assert ct["total_s"] == pytest.approx(sum(r.costs["wall_time_s"] for r in runs))
    assert f"**at least {ct['total_s'] / 60:.1f} min**" in md


@pytest.mark.slow
def test_verdict_follows_margin(tmp_path):
    runs = _runs(seeds=(0, 1, 2))  # TG - GRPO per seed: 0, -0.05, -0.10
    strict = report.write_report(tmp_path / "a", runs, {"margin": -0.0, "n_boot": 200})
    loose = report.write_report(tmp_path / "b", runs, {"margin": -0.5, "n_boot": 200})
    assert strict["noninferiority"]["verdict"] == "fail"  # TG lost a task in one seed
    assert loose["noninferiority"]["verdict"] == "pass"


def test_two_seeds_give_an_exploratory_verdict_with_the_seed_interval(tmp_path):
    res = report.write_report(tmp_path, _runs(), {"margin": -0.5, "n_boot": 200})
    ni = res["noninferiority"]
    d = res["comparisons"]["tg"]["difference"]["task_success"]
    assert ni["verdict"] == "exploratory" and ni["interval"] == d["method"]
    assert ni["lower"] == d["low"] and ni["seeds"] == {"candidate": [0, 1], "baseline": [0, 1]}
    md = (tmp_path / "report.md").read_text()
    assert "success: EXPLORATORY (2 training seed(s) per arm, under 3).**" in md
    assert "d task success per seed" in md and "PASS" not in md


def test_errors():
    runs = _runs()
    with pytest.raises(ValueError, match="baseline arm"):
        report.compute_results(runs, report.ReportSettings(baseline="nope"))
    with pytest.raises(ValueError, match="duplicate seeds"):
        report.compute_results(runs + [runs[0]], report.ReportSettings())
    with pytest.raises(ValueError, match="group"):
        report.RunResult("x", 0, [], [], {}, group="other")


def test_baseline_under_the_floor_is_not_meaningful_and_the_setting_is_shown(tmp_path):
    runs = [report.RunResult("grpo", 0, _episodes(1, False), _curves(0, 0.0), {}),
            report.RunResult("tg", 0, _episodes(1, True), _curves(0, 0.9), {})]  # fmt: skip
    context = {
        "machine": {"cpu_model": "Test CPU @ 1GHz", "cpu_family": "25", "cpu_model_number": "1",
                    "cpu_count": 2, "jax": "0.1", "jaxlib": "0.2", "xla_flags": ""},
        "preregistration": {"path": "w/preregistration.json", "sha256": "ab" * 32},
        "base_model": {"pass_rate": 0.25, "hinted_compliance/fence": 0.97},
        "sft_attempts": [{"attempt": 0, "seed": 0, "data_seed": 1, "workdir": "w",
                          "verdict": "rejected (pass_rate 0.100 outside [0.2, 0.6])"},
                         {"attempt": 1, "seed": 1, "data_seed": 2, "workdir": "w/sft_retry1",
                          "verdict": "accepted"}],
    }  # fmt: skip
    res = report.write_report(tmp_path, runs, {"n_boot": 100, "floor": 0.1}, context=context)
    ni = res["noninferiority"]
    assert ni["verdict"] == "not meaningful" and ni["baseline_success"] == pytest.approx(0.05)
    md = (tmp_path / "report.md").read_text()
    assert "NOT MEANINGFUL" in md and "PASS" not in md and "FAIL" not in md
    assert "Test CPU @ 1GHz (family 25 model 1), 2 cores" in md and "jaxlib 0.2" in md
    assert "ab" * 32 in md and "pass_rate 0.25" in md
    assert "SFT attempt 1 (seed 1, data_seed 2" in md and "accepted" in md
    assert "20 tasks (one cluster each)" in md  # what the bootstrap resamples
    assert res["context"] == json.loads(json.dumps(context))
    # The same runs with a floor of 0: a pass/fail verdict again.
    other = report.write_report(tmp_path / "b", runs, {"n_boot": 100, "floor": 0.0})
    assert other["noninferiority"]["verdict"] == "exploratory"  # one seed per arm
    assert "behaviour's own cost" not in (tmp_path / "b" / "report.md").read_text()
    # With the base model's hinted pass rate: the behaviour's own cost beside the verdict.
    context["base_model"]["hinted_pass_rate"] = 0.17
    report.write_report(tmp_path / "c", runs, {"n_boot": 100, "floor": 0.0}, context=context)
    md = (tmp_path / "c" / "report.md").read_text()
    assert "solve 0.17 of the held-out tasks vs 0.25 plain" in md
    assert "the behaviour's own cost there is -0.080" in md


@pytest.mark.slow
def test_markdown_names_clusters_when_tasks_share_functions(tmp_path):
    import dataclasses

    runs = [
        report.RunResult(arm, 0, [dataclasses.replace(e, cluster_id=f"fn{int(e.task_id[1:]) // 4}")
                                  for e in _episodes(10, arm == "tg")], _curves(0, 0.5), {})
        for arm in ("grpo", "tg")
    ]  # fmt: skip
    res = report.write_report(tmp_path, runs, {"n_boot": 100})
    assert res["arms"]["tg"]["heldout"]["plain"]["num_clusters"] == 5
    md = (tmp_path / "report.md").read_text()
    assert ("5 clusters (tasks sharing a hidden function) of 20 tasks (**warning: 5 resampled "
            "units, under 20: the intervals are unreliable**)") in md  # fmt: skip
    # The unit follows the environment: SWE tasks cluster by code template.
    res = report.write_report(tmp_path, runs, {"n_boot": 100}, context={"env_kind": "swe"})
    assert "5 clusters (tasks sharing a code template) of 20 tasks" in (
        tmp_path / "report.md").read_text()  # fmt: skip
    # 20 units or more: no warning.
    wide = [report.RunResult(r.arm, 0, [dataclasses.replace(e, cluster_id=e.task_id)
                                        for e in r.heldout], r.train_records, {})
            for r in runs]  # fmt: skip
    report.write_report(tmp_path, wide, {"n_boot": 100})
    md = (tmp_path / "report.md").read_text()
    assert "the resampled unit: 20 tasks (one cluster each) (100 replicates" in md
    assert "resampled units, under" not in md


def test_a_collapsed_baseline_seed_is_named_in_the_report(tmp_path):
    runs = [report.RunResult("grpo", 0, _episodes(10, False), _curves(0, 0.0), {}),
            report.RunResult("grpo", 1, _episodes(0, False), _curves(1, 0.0), {}),
            report.RunResult("grpo", 2, _episodes(12, False), _curves(2, 0.0), {}),
            *[report.RunResult("tg", s, _episodes(10, True), _curves(s, 0.9), {})
              for s in (0, 1, 2)]]  # fmt: skip
    res = report.write_report(tmp_path, runs, {"n_boot": 100, "floor": 0.1})
    assert res["noninferiority"]["verdict"] == "not meaningful"
    md = (tmp_path / "report.md").read_text()
    assert "NOT MEANINGFUL.** The baseline seed(s) [1] collapsed: held-out task success" in md


def test_the_budget_section_checks_the_sampled_tokens_each_arm_used():
    from tg_jax.evaluation import md_budget

    budget = {
        "steps": 2, "groups_per_step": 2, "rollouts_per_group": 2, "episodes": 8,
        "max_new_tokens_per_turn": 16, "max_turns": 1, "sampled_token_budget": 128,
        "lr": 1e-3, "lr_schedule": "constant", "train_seeds": [0], "heldout_tasks": 4,
    }  # fmt: skip

    def res_of(grpo, tg, declared=True):
        arms = {a: {"costs": {"sampled_tokens": {"mean": v}}} for a, v in (("grpo", grpo),
                                                                          ("tg", tg))}  # fmt: skip
        return {"arms": arms, "context": {"budget": budget, "budget_equal": declared}}

    def text(*args):
        return "\n".join(md_budget.budget_section(res_of(*args)))

    assert "max / min 1.05, within the 10% tolerance" in text(100.0, 105.0)
    assert "max / min 1.50, **beyond the 10% tolerance" in text(100.0, 150.0)
    assert "`grpo` 100, `tg` 150" in text(100.0, 150.0)
    assert "declared budgets differ" in text(100.0, 100.0, False)
    # What read which split is stated as the code does it: the held-out tasks by no check.
    assert "the base model's gates and the periodic evaluation during RL the dev split" in (
        text(100.0, 100.0)
    )
    # Equal only when declared equal and used within the tolerance (max / min <= 1.1).
    check = md_budget.budget_check(res_of(100.0, 110.0))
    assert check["equal"] and check["sampled_tokens_ratio"] == pytest.approx(1.1)
    assert not md_budget.budget_check(res_of(100.0, 111.0))["equal"]
    assert not md_budget.budget_check(res_of(100.0, 100.0, False))["equal"]
    assert md_budget.budget_check(res_of(None, None))["sampled_tokens_ratio"] is None
    # Compute beside the budget, per arm (reported, not equalised); unequal trials: unequal.
    res = res_of(100.0, 100.0)
    costs = {"grpo": (60.0, 0.0, 2e9), "tg": (90.0, 3e12, 3e9)}
    for arm, (wall, flops, mem) in costs.items():
        c = res["arms"][arm]["costs"]
        c["wall_time_s"], c["teacher_forward_flops"] = {"mean": wall}, {"mean": flops}
        c["peak_memory_above_start_bytes"] = {"mean": mem}
    check = md_budget.budget_check(res)
    assert check["equal"] and check["compute"]["wall_time_s"] == {"grpo": 60.0, "tg": 90.0}
    assert check["compute"]["peak_memory_above_start_bytes"]["tg"] == 3e9
    line = "\n".join(md_budget.budget_section(res))
    assert "RL wall time `grpo` 60 s, `tg` 90 s" in line and "teacher forward FLOPs" in line
    res["context"]["tuning"] = {"arms": {"grpo": {"trials": [1, 2]}, "tg": {"trials": [1]}}}
    check = md_budget.budget_check(res)
    assert check["tuning_trials"] == {"grpo": 2, "tg": 1} and not check["equal"]


def test_the_candidate_is_tested_against_each_registered_reference(tmp_path):
    """eval.references: the verdict against the baseline (the headline), another arm and the
    base model (one set of episodes standing for every seed); a reference not run says so."""
    runs = [
        report.RunResult(arm, s, _episodes(k, arm == "tg"), _curves(s, 0.5), {})
        for arm, k in (("grpo", 10), ("tg", 10), ("grpo_task_only", 14))
        for s in (0, 1, 2)
    ]
    base = _episodes(6, False)  # the base model solves 6 of 20 tasks
    settings = {"n_boot": 200, "references": ("grpo_task_only", "base", "tg_all_turns")}
    res = report.write_report(tmp_path, runs, settings, reference_runs={"base": base})
    refs = res["references"]
    assert list(refs) == ["grpo", "grpo_task_only", "base", "tg_all_turns"]
    assert refs["grpo"] == res["noninferiority"]  # the headline is the baseline's
    # Every task identical across seeds: the difference is the hand-computed one.
    assert refs["grpo"]["mean"] == pytest.approx(0.0)
    assert refs["grpo_task_only"]["mean"] == pytest.approx((10 - 14) / 20)
    assert refs["base"]["mean"] == pytest.approx((10 - 6) / 20)
    assert refs["base"]["seeds"] == {"candidate": [0, 1, 2], "baseline": [0, 1, 2]}
    assert refs["grpo_task_only"]["verdict"] == "fail" and refs["base"]["verdict"] == "pass"
    assert refs["tg_all_turns"] == {"verdict": "not run"}
    md = (tmp_path / "report.md").read_text()
    assert "## Non-inferiority of `tg` against each reference" in md
    assert "| grpo_task_only | -0.200 |" in md and "| tg_all_turns | n/a | n/a | not run |" in md


def test_step_phases_are_the_timed_shares_of_every_step_in_the_report(tmp_path):
    from tg_jax.evaluation import plots, step_phases

    def timed(wait, build, train, step, rollout):
        return {"stage": "train", "time/sample_wait_s": wait, "time/build_batch_s": build,
                "time/train_s": train, "time/step_s": step, "time/rollout_s": rollout,
                "time/rollout_engine_s": rollout / 2, "time/rollout_tool_wait_s": rollout / 4,
                "time/weight_sync_s": 0.1}  # fmt: skip

    # Two seeds, three steps in all: step time 4 + 4 + 2 = 10 s; waits 2 + 3 + 1 = 6 s, batches
    # 1 s, train steps 2 s, so "other" is 1 s; rollouts 6 s (engine 3, idle on tools 1.5),
    # syncs 0.3 s.
    seed0 = [timed(2.0, 0.5, 1.0, 4.0, 2.0), timed(3.0, 0.25, 0.5, 4.0, 3.0), {"stage": "eval"}]
    seed1 = [timed(1.0, 0.25, 0.5, 2.0, 1.0)]
    p = step_phases.phase_shares([seed0, seed1])
    assert (p["steps"], p["step_s"]) == (3, pytest.approx(10.0 / 3))
    assert p["shares"] == pytest.approx({"waiting for rollouts": 0.6, "building the batch": 0.1,
                                         "train step": 0.2, "other": 0.1})  # fmt: skip
    assert p["aside"] == pytest.approx({"rollout wall time": 0.6, "engine prefill + decode": 0.3,
                                        "engine idle on tools": 0.15,
                                        "engine weight sync": 0.03})  # fmt: skip
    assert step_phases.phase_shares([[{"stage": "train", "step": 1}]]) == {}  # not timed
    runs = _runs()
    for r in runs:
        r.train_records.extend(seed0 if r.seed == 0 else seed1)
    res = report.write_report(str(tmp_path), runs, {"n_boot": 200})
    assert res["arms"]["tg"]["step_phases"]["shares"]["waiting for rollouts"] == pytest.approx(0.6)
    md = (tmp_path / report.REPORT_FILE).read_text()
    (row,) = [ln for ln in md.splitlines() if ln.startswith("| tg |") and "3.33" in ln]
    assert "| 60% | 10% | 20% | 10% | 60% | 30% | 15% | 3% |" in row
    assert (tmp_path / plots.PHASES_FILE).stat().st_size > 1000
