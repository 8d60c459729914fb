"""Stability per arm (oscillation, malformed turns), hint leakage and the tuning budget in the
report, with numbers computed by hand."""

import json

import numpy as np
import pytest

from configs import tiny
from tg_jax import config_files
from tg_jax.evaluation import report, stability
from tg_jax.sampling.episode import EpisodeRecord
from tg_jax.train import pipeline


def _train(compliance, malformed=0.0, leakage=None):
    recs = []
    for s, c in enumerate(compliance, start=1):
        r = {"step": s, "stage": "train", "rollout/compliance": c,
             "rollout/actions/malformed": malformed}  # fmt: skip
        if leakage is not None:
            r["rollout/hint_leakage"] = leakage
        recs.append(r)
    return recs


def test_oscillation_is_the_std_of_the_last_16_steps():
    # 10 early steps at 0, then 16 steps alternating 0 / 1: std 0.5 exactly.
    flipping = [0.0] * 10 + [0.0, 1.0] * 8
    assert stability.oscillation(_train(flipping)) == pytest.approx(0.5)
    # Learned and kept: a ramp that ends 16 steps at 0.9 has no oscillation.
    steady = list(np.linspace(0, 0.9, 20)) + [0.9] * 16
    assert stability.oscillation(_train(steady)) == pytest.approx(0.0)
    # Hand-computed on 4 steps (fewer than 16 logged: all of them).
    vals = [0.2, 0.4, 0.4, 0.8]
    assert stability.oscillation(_train(vals)) == pytest.approx(np.std(vals))
    assert np.isnan(stability.oscillation(_train([0.5])))


def test_arm_stability_over_seeds():
    runs = [_train([0.0, 1.0] * 8, malformed=0.5, leakage=0.1), _train([0.5] * 16, 1.5)]
    st = stability.arm_stability(runs)
    assert st["per_seed_oscillation"] == pytest.approx([0.5, 0.0])
    assert st["oscillation"]["mean"] == pytest.approx(0.25)
    assert st["oscillation"]["std"] == pytest.approx(np.std([0.5, 0.0], ddof=1))
    assert st["malformed_train"]["mean"] == pytest.approx(1.0)
    assert st["hint_leakage_train"]["mean"] == pytest.approx(0.1)  # one seed logged it
    assert st["hint_leakage_train"]["n"] == 1
    assert stability.arm_stability([_train([])])["oscillation"] is None


def test_tuning_budget_from_the_config():
    b = stability.tuning_budget(tiny.get_config())
    assert b == {
        "steps": 4, "groups_per_step": 2, "rollouts_per_group": 2, "episodes": 16,
        "max_new_tokens_per_turn": 16, "max_turns": 1, "sampled_token_budget": 256,
        "lr": 1e-3, "lr_schedule": "constant", "train_seeds": [0], "heldout_tasks": 4,
        "lr_trials": 1,
    }  # fmt: skip
    config = config_files.apply_overrides(tiny.get_config(), {"pipeline.tune.lrs": (1e-3, 3e-3)})
    assert stability.tuning_budget(config)["lr_trials"] == 2
    # Every arm of the protocol has the same budget (arms change no budget setting).
    budgets = {
        json.dumps(stability.tuning_budget(pipeline.arm_config(tiny.get_config(), a)))
        for a in pipeline.ARMS
    }
    assert len(budgets) == 1


def _episodes(leaking, malformed):
    return [
        EpisodeRecord(
            task_id=f"t{i}", condition=cond, sample=0, task_success=i % 2 == 0,
            compliance={"fence": True}, actions={"run_tests": 1, "submit": 1,
                                                 "malformed": malformed},
            turns=2, hint_leaking_turns=leaking if cond == "plain" else 2,
        )
        for i in range(6)
        for cond in ("plain", "hinted")
    ]  # fmt: skip


def test_report_shows_stability_leakage_budget_and_per_run_costs(tmp_path):
    costs = {"wall_time_s": 5.0, "sampled_tokens": 1e4, "teacher_forward_flops": 1e9,
             "peak_memory_bytes": 3e8}  # fmt: skip
    runs = [
        report.RunResult("grpo", 0, _episodes(0, 1), _train([0.0, 1.0] * 8, 0.25), costs),
        report.RunResult(
            "tg",
            0,
            _episodes(1, 0),
            _train([0.9] * 16, 0.0, 0.05),
            dict(costs, distilled_tokens=1000.0),
        ),  # fmt: skip
        report.RunResult(
            "tg_think", 0, _episodes(1, 0), _train([0.9] * 16), dict(costs, distilled_tokens=2500.0)
        ),  # fmt: skip
    ]
    budget = stability.tuning_budget(tiny.get_config())
    res = report.write_report(
        tmp_path, runs, {"n_boot": 100, "last_k": 4},
        context={"budget": budget, "budget_equal": True},
    )  # fmt: skip
    grpo, tg = res["arms"]["grpo"], res["arms"]["tg"]
    assert grpo["stability"]["oscillation"]["mean"] == pytest.approx(0.5)
    assert tg["stability"]["oscillation"]["mean"] == pytest.approx(0.0)
    assert grpo["stability"]["malformed_train"]["mean"] == pytest.approx(0.25)
    assert grpo["heldout"]["plain"]["bootstrap"]["actions/malformed"]["mean"] == 1.0
    assert tg["heldout"]["plain"]["bootstrap"]["hint_leakage"]["mean"] == pytest.approx(0.5)
    assert tg["heldout"]["hinted"]["bootstrap"]["hint_leakage"]["mean"] == pytest.approx(1.0)
    assert tg["costs"]["distilled_tokens"]["mean"] == 1000.0
    assert "distilled_tokens" not in grpo["costs"]
    md = (tmp_path / "report.md").read_text()
    assert (
        "## Stability" in md and "| grpo | 0.500 +- n/a | 0.25 +- n/a | 1.00 [1.00, 1.00] |" in md
    )
    assert "## Privilege-drift guard: hint leakage" in md
    assert "| tg | 0.050 +- n/a | 0.50 [0.50, 0.50] | 1.00 [1.00, 1.00] |" in md
    assert "## Equal tuning budget" in md and "4 RL steps of 2 groups x 2 rollouts" in md
    assert "sampled-token cap 256" in md and "Learning-rate trials" not in md
    assert "learning rate 0.001 for every arm, not tuned (one trial each) (schedule constant)" in md
    assert "learning-rate trials a validation split of the train tasks" in md
    assert res["budget_check"]["declared_equal"] and "equal" in res["budget_check"]
    assert "| tg | 5.0 | n/a | 10k | 1G | 1k | 300M | n/a |" in md
    assert "ratio 2.50" in md and "NOT an equal distilled-token budget" in md
    assert "peak memory (B, this run)" in md
