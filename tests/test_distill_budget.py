"""The thinking-token control at an equal distilled-token budget (`tg.distill_budget`)."""

import numpy as np
import pytest

from tests import rl_loop_driver as driver
from tests.test_batch import HEADER, TH, A, E, P, _traj
from tg_jax import config_files, config_lib
from tg_jax.rl.batch import build_batch
from tg_jax.rl.loss import normalizers
from tg_jax.rl.step_config import TGConfig
from tg_jax.rl.tg import distill_budget
from tg_jax.train import pipeline, rl

HINTS = {"fence": [90, 91, 92]}


def _thinking_traj(think_len, answer_len, verdicts, task="t0"):
    segments = [(P, [1, 2, 3], -1)]
    for k in range(len(verdicts)):
        segments += [
            (P, HEADER, -1),
            (TH, list(range(200, 200 + think_len)), k),
            (A, list(range(100, 100 + answer_len)), k),
            (E, [40, 41], -1),
        ]
    return _traj(segments, verdicts, hints=HINTS, task=task)


def _batch():
    trajs = [
        _thinking_traj(6, 3, [{"fence": False}, {"fence": True}], "t0"),
        _thinking_traj(4, 2, [{"fence": False}, {"fence": False}], "t1"),
        _thinking_traj(5, 4, [{"fence": True}, {"fence": True}], "t2"),  # nothing targeted
    ]
    return build_batch(
        trajs, max_len=128, teacher_max_len=160, pad_to_multiple=0, include_thinking=True
    )


def _masks(batch):
    return distill_budget.budget_masks(batch)


def test_budget_is_the_answer_tokens_count_drawn_from_answer_and_thinking():
    batch = _batch()
    full, answers = _masks(batch)
    # Targeted turns: t0 turn 0 (6 thinking + 3 answer tokens) and both turns of t1 (4 + 2).
    assert answers.sum() == 3 + 2 + 2 and full.sum() == 9 + 6 + 6
    capped, dropped = distill_budget.apply_budget(batch, seed=0, step=3)
    kept, _ = _masks(capped)
    assert kept.sum() == answers.sum() and dropped == full.sum() - answers.sum()
    assert not (kept & ~full).any()  # only tokens of M are kept
    kept_thinking = kept & np.asarray(batch.thinking_mask_BxT, bool)
    assert 0 < kept_thinking.sum() < kept.sum()  # both kinds drawn
    # Only tg_mask_BxT changes; the teacher rows and every other mask stay.
    for name in ("targets_BxT", "teacher_tokens_BtxTt", "loss_mask_BxT", "failed_turn_mask_BxT"):
        np.testing.assert_array_equal(getattr(capped, name), getattr(batch, name))
    # The draw is a function of (seed, step): again the same, another step another subset.
    again, _ = distill_budget.apply_budget(batch, seed=0, step=3)
    np.testing.assert_array_equal(again.tg_mask_BxT, capped.tg_mask_BxT)
    draws = {
        np.asarray(distill_budget.apply_budget(batch, 0, s)[0].tg_mask_BxT).tobytes()
        for s in range(8)
    }  # fmt: skip
    assert len(draws) > 1
    # Uniform over M: over many steps every token of M is kept about budget / |M| of the time.
    share = np.mean(
        [np.asarray(distill_budget.apply_budget(batch, 0, s)[0].tg_mask_BxT)[full]
         for s in range(400)], axis=0,
    )  # fmt: skip
    np.testing.assert_allclose(share, answers.sum() / full.sum(), atol=0.1)


def test_no_thinking_tokens_nothing_to_cut():
    batch = build_batch(
        [_thinking_traj(0, 3, [{"fence": False}, {"fence": False}])],
        max_len=64, teacher_max_len=96, pad_to_multiple=0, include_thinking=True,
    )  # fmt: skip
    capped, dropped = distill_budget.apply_budget(batch, 0, 0)
    assert dropped == 0 and capped is batch


def test_config_errors():
    with pytest.raises(ValueError, match="needs tg.include_thinking=True"):
        TGConfig.from_config(config_lib.tg_config(distill_budget="answer_tokens"))
    with pytest.raises(ValueError, match="distill_budget"):
        TGConfig.from_config(config_lib.tg_config(distill_budget="half", include_thinking=True))
    cfg = config_lib.tg_config(distill_budget="answer_tokens", include_thinking=True)
    assert TGConfig.from_config(cfg).distill_budget == "answer_tokens"


def test_the_rl_loop_applies_it_and_the_tg_term_sees_the_budget():
    trajs = [
        _thinking_traj(6, 3, [{"fence": False}, {"fence": True}], "t0"),
        _thinking_traj(4, 2, [{"fence": False}, {"fence": False}], "t1"),
    ]
    counts = {}
    for name, over in {
        "tg": {},
        "think": {"tg.include_thinking": True},
        "budget": {"tg.include_thinking": True, "tg.distill_budget": "answer_tokens"},
    }.items():
        config = config_files.apply_overrides(
            driver.make_config("tg"), {**over, "rl_loop.length_multiple": 0}
        )
        parts = driver.batch_parts(config, 128, 160)
        batch = rl._build_batch(parts, trajs, 5)
        counts[name] = rl.distilled_tokens(config.tg, batch)  # what the TG term's M holds
        norms = normalizers(batch, TGConfig.from_config(config.tg))  # what the loss divides by
        assert int(norms.num_distilled) == counts[name]
    assert counts["tg"] == counts["budget"] == 7 < counts["think"] == 21


def test_the_budget_arm_is_a_thinking_arm_of_the_protocol():
    arm = pipeline.ARMS["tg_think_budget"]
    assert arm.overrides["tg.include_thinking"] and arm.group == "main"
    assert arm.overrides["tg.distill_budget"] == "answer_tokens"


def test_report_compares_each_thinking_arm_with_tg_at_its_distilled_tokens():
    from tg_jax.evaluation import md_costs

    def arm(tokens):
        return {"costs": {"distilled_tokens": {"mean": tokens, "std": 0.0, "n": 3}}}

    res = {"arms": {"tg": arm(1000.0), "tg_think": arm(2500.0), "tg_think_budget": arm(980.0)}}
    text = "\n".join(md_costs.thinking_control(res))
    assert "`tg_think` distilled 2.5k tokens" in text and "(ratio 2.50): NOT an equal" in text
    assert "`tg_think_budget` distilled 980 tokens" in text
    assert "(ratio 0.98): an equal distilled-token budget" in text
    del res["arms"]["tg_think"]
    assert "tg_think`" not in "\n".join(md_costs.thinking_control(res))


@pytest.mark.e2e
def test_the_budget_arm_from_the_command_line(tmp_path):
    # The user's command: the tiny pipeline with tg and the budget arm, tg the baseline.
    import json

    from tests.test_frozen_teacher_cli import _main
    from tests.test_pipeline import FAST_PIPELINE

    work = tmp_path / "w"
    overrides = [f"--config.{k}={v}" for k, v in {**FAST_PIPELINE, "rl_loop.steps": 2}.items()]
    _main("configs/tiny.py", work, "--config.stage=pipeline",
          "--config.pipeline.arms=('tg','tg_think_budget')",
          "--config.eval.baseline=tg", *overrides)  # fmt: skip
    for arm in ("tg", "tg_think_budget"):
        summary = json.loads((work / "runs" / f"{arm}_seed0" / "rl_summary.json").read_text())
        assert summary["finished"], summary
    prereg = json.loads((work / "preregistration.json").read_text())
    assert prereg["arms"]["tg_think_budget"]["tg"]["distill_budget"] == "answer_tokens"
    md = (work / "report" / "report.md").read_text()
    assert "| tg_think_budget |" in md  # compared with tg in the report's tables
