"""The RL loop's rollout side: metrics, feedback picks, hint budget; an async loop smoke run."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from tests import rl_loop_driver as driver
from tg_jax import metrics
from tg_jax.envs.hints import CORRECT_HINTS, FeedbackRates
from tg_jax.envs.protocol import make_requirement
from tg_jax.envs.tasks import Task
from tg_jax.evaluation import heldout, report
from tg_jax.metrics import read_metrics
from tg_jax.sampling.trajectory import Trajectory
from tg_jax.text import ByteTokenizer, ChatRenderer, hint_message
from tg_jax.train import rl, rl_rollouts


def _traj(verdicts, task, actions, term="done"):
    n = 6
    return Trajectory(
        tokens=np.arange(n, dtype=np.int32),
        roles=np.zeros(n, np.int8),
        turn_ids=np.array([-1, 0, 0, -1, 1, -1], np.int32)[:n],
        turn_starts=np.arange(len(verdicts), dtype=np.int32),
        behaviour_logprobs=np.zeros(n, np.float32),
        turn_verdicts=verdicts,
        rewards={"task": task},
        hint_tokens={},
        group_id=0,
        policy_version=0,
        task_id="t",
        info={"actions": actions, "termination": term, "truncated_turns": 0},
    )


def test_rollout_metrics():
    trajs = [
        _traj([{"fence": True}, {"fence": None}], 1.0, {"run_tests": 1, "submit": 1}),
        _traj([{"fence": False}, {"fence": True}], 1.0, {"run_tests": 0, "submit": 1}),
        _traj([{"fence": None}], 0.0, {"run_tests": 3, "submit": 0}, term="max_turns"),
    ]
    m = rl_rollouts.rollout_metrics(trajs)
    assert m["rollout/compliance"] == pytest.approx(1 / 3)  # only the first: all judged pass
    assert m["rollout/task_success"] == pytest.approx(2 / 3)
    assert m["rollout/joint"] == pytest.approx(1 / 3)
    assert m["rollout/actions/run_tests"] == pytest.approx(4 / 3)
    assert m["rollout/end/max_turns"] == pytest.approx(1 / 3)
    assert m["rollout/end/max_tokens"] == 0.0
    assert m["rollout/turns"] == pytest.approx(5 / 3)
    # First turns judged: True, False (the third's is None); later turns judged: True.
    assert m["rollout/turn_pass/first"] == pytest.approx(1 / 2)
    assert m["rollout/turn_pass/later"] == pytest.approx(1.0)
    assert rl_rollouts.sampled_tokens(trajs) == 9
    assert m["rollout/tool_crashed"] == 0.0 and m["rollout/end/env_error"] == 0.0


def test_rollout_metrics_count_crashed_tool_calls_and_env_errors():
    trajs = [
        _traj([{"fence": True}], 0.0, {}, term="env_error"),
        _traj([{"fence": True}, {"fence": True}], 0.0, {}),
    ]
    trajs[1].info["steps"] = [{"tool_error": "crashed"}, {"tool_error": None}]
    trajs[0].info["steps"] = [{"tool_error": "crashed"}, {"error": "boom"}]
    m = rl_rollouts.rollout_metrics(trajs)
    assert m["rollout/tool_crashed"] == pytest.approx(1.0)  # (1 + 1) / 2 episodes
    assert m["rollout/end/env_error"] == pytest.approx(0.5)


def test_hint_reserve_bounds_every_hint_kind():
    r = ChatRenderer(ByteTokenizer())
    one = len(r.render_message(hint_message(CORRECT_HINTS["fence"])))
    fence, tool_json = make_requirement("fence"), make_requirement("tool_json")
    reserve = rl_rollouts.hint_reserve(r, (fence,), max_turns=3)
    assert reserve >= 3 * one and reserve % 3 == 0
    both = rl_rollouts.hint_reserve(r, (fence, tool_json), max_turns=1)
    assert both > reserve // 3
    # A plug-in's own hint bounds its correct kind: a longer hint, a larger reserve.
    long_hint = dataclasses.replace(fence, name="mine", hint="x" * 400)
    own = rl_rollouts.hint_reserve(r, (long_hint,), max_turns=1)
    assert own == len(r.render_message(hint_message("x" * 400)))


class _FakeRollout:
    """Stands in for rollout.rollout_groups: records the hints the picker returns."""

    def __init__(self):
        self.calls = []
        self.keys = []

    def __call__(self, sampler, params, renderer, env_factory, tasks, **kw):
        texts = [kw["hint_picker"]("fence") for _ in range(50)] if kw["hint_picker"] else []
        self.calls.append((kw["first_group_id"], texts))
        self.keys.append(np.asarray(jax.random.key_data(kw["rng"])))
        return [_traj([{"fence": False}], 0.0, {}) for _ in tasks]


def test_feedback_picks_depend_only_on_batch_index(monkeypatch):
    fake = _FakeRollout()
    monkeypatch.setattr(rl_rollouts.rollout, "rollout_groups", fake)
    rates = FeedbackRates(correct=0.5, irrelevant=0.25, wrong=0.25)
    kw = dict(rollouts_per_group=1, config=None, sampling_key=jax.random.key(0), seed=3)
    fn = rl_rollouts.BatchRollout(None, None, None, rates=rates, **kw)
    out_a = fn(None, 7, ["t1", "t2"], 0)
    fn(None, 8, ["t1", "t2"], 0)
    fn(None, 7, ["t1", "t2"], 0)
    (g7, a), (g8, b), (_, c) = fake.calls
    assert (g7, g8) == (14, 16)  # group ids unique across batches
    assert a == c and a != b  # same batch index -> same picks, after a "resume"
    # The sampling key too: fold_in(sampling_key, batch index), whichever loop calls.
    want = [jax.random.key_data(jax.random.fold_in(jax.random.key(0), i)) for i in (7, 8, 7)]
    for got, w in zip(fake.keys, want, strict=True):
        np.testing.assert_array_equal(got, w)
    kinds = out_a[0].info["feedback_kinds"]
    assert set(kinds) == {"correct", "irrelevant", "wrong"}
    assert all(t.info["batch_index"] == 7 for t in out_a)
    m = rl_rollouts.rollout_metrics(out_a)
    assert m["feedback/correct"] + m["feedback/irrelevant"] + m["feedback/wrong"] == 1.0
    # Perfect feedback: no picker at all (the environment's own hints).
    fn.rates = FeedbackRates()
    fn(None, 9, ["t1"], 0)
    assert fake.calls[-1][1] == []


@pytest.mark.slow
def test_async_loop_smoke(tmp_path):
    config = driver.make_config("grpo", async_sampling=True, steps=3)
    result = rl.run_rl(
        config, str(tmp_path), driver.initial_params(config), arm_name="grpo", seed=0,
        sources=driver.make_sources(),
    )  # fmt: skip
    assert result.finished and result.costs["teacher_forward_flops"] == 0.0
    records = [r for r in read_metrics(str(tmp_path)) if r["stage"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["staleness"] <= config.rl.max_staleness for r in records)
    assert metrics.read_rl_summary(str(tmp_path))["costs"]["sampled_tokens"] > 0
    # The pipeline's next steps on this run: held-out evaluation (cached) and a report.
    tasks = [Task.from_record(r) for r in driver.make_sources(2)["heldout"]]
    records = heldout.evaluate_run(config, str(tmp_path), result.state.params, tasks)
    assert [(r.condition, r.task_id) for r in records] == [
        (c, t.task_id) for c in ("plain", "hinted") for t in tasks
    ]
    assert heldout.evaluate_run(config, str(tmp_path), None, tasks) == records  # cached
    run = report.load_run_result(str(tmp_path), records)
    assert (run.arm, run.seed) == ("grpo", 0)
    assert run.costs["sampled_tokens"] == result.costs["sampled_tokens"]
    with open(os.path.join(tmp_path, heldout.HELDOUT_SUMMARY_FILE)) as f:
        eval_summary = json.load(f)
    assert eval_summary["episodes"] == len(records) and eval_summary["wall_s"] > 0
    assert run.costs["eval_wall_time_s"] == eval_summary["wall_s"]
    with open(os.path.join(tmp_path, heldout.HELDOUT_SUMMARY_FILE), "w") as f:
        f.write('{"wall_s": ')  # torn
    with pytest.raises(ValueError, match="not a valid evaluation summary.*delete it"):
        report.load_run_result(str(tmp_path), records)
    with open(os.path.join(tmp_path, heldout.HELDOUT_SUMMARY_FILE), "w") as f:
        json.dump(eval_summary, f)  # restored for the report below
    res = report.write_report(tmp_path / "report", [run], {"n_boot": 100, "last_k": 2})
    assert res["noninferiority"] is None
    assert res["arms"]["grpo"]["heldout"]["plain"]["num_tasks"] == 2
    assert (tmp_path / "report" / "report.md").exists()


@pytest.mark.slow
def test_async_resume_continues_the_batch_indices(tmp_path):
    # The sampling thread samples ahead; after a resume it restarts at the first batch the
    # trainer had not consumed, and the batch indices stay absolute.
    config = driver.make_config("grpo", async_sampling=True, steps=3)
    config.rl_loop.eval_every = 0
    kw = dict(arm_name="grpo", seed=0, sources=driver.make_sources())
    first = rl.run_rl(config, str(tmp_path), driver.initial_params(config), stop_after=1, **kw)
    assert not first.finished and first.step == 1
    resumed = rl.run_rl(config, str(tmp_path), driver.initial_params(config), **kw)
    assert resumed.finished and resumed.step == 3
    records = [r for r in read_metrics(str(tmp_path)) if r["stage"] == "train"]
    assert [(r["step"], r["batch_index"]) for r in records] == [(1, 0.0), (2, 1.0), (3, 2.0)]
    assert metrics.read_rl_summary(str(tmp_path))["sessions"][-1]["start_step"] == 1


def test_feedback_kind_is_drawn_per_turn_at_the_rates():
    import random

    from tg_jax.envs.hints import hint_kind, pick_hint, pick_turn_hints

    rates = FeedbackRates(correct=0.5, irrelevant=0.25, wrong=0.25)
    gen = random.Random(0)
    verdicts = [{"fence": False, "tool_json": None}] * 4  # 4 failed turns, one unjudged
    kinds, mixed = [], 0
    for _ in range(3000):
        turns = pick_turn_hints(verdicts, lambda n: pick_hint(n, gen, rates)[1])
        assert [set(t) for t in turns] == [{"fence"}] * 4  # no pick for an unjudged requirement
        ks = [hint_kind("fence", t["fence"]) for t in turns]
        kinds += ks
        mixed += len(set(ks)) > 1
    for kind, rate in (("correct", 0.5), ("irrelevant", 0.25), ("wrong", 0.25)):
        assert kinds.count(kind) / len(kinds) == pytest.approx(rate, abs=0.015), kind
    # Per turn, not per episode: 4 turns share one kind with p = .5^4 + 2 * .25^4 = 0.0703.
    assert mixed / 3000 == pytest.approx(1 - 0.0703, abs=0.02)
    with pytest.raises(ValueError, match="no hint of requirement"):
        hint_kind("fence", "Reminder: something else.")


def test_per_turn_feedback_reaches_the_teacher_rows():
    from tg_jax.envs.coding import CodingEnv, CodingEnvConfig
    from tg_jax.envs.hints import hint_kind
    from tg_jax.envs.tasks import generate_tasks
    from tg_jax.rl.batch import build_batch
    from tg_jax.sampling.rollout import RolloutConfig
    from tg_jax.sampling.scripted import ScriptedSampler

    renderer = ChatRenderer(ByteTokenizer())
    turn = 'def f(x): return x\n<tool_call>{"name": "run_tests"}</tool_call>'  # fence fails
    fn = rl_rollouts.BatchRollout(
        ScriptedSampler(renderer, [turn] * 4), renderer,
        lambda: CodingEnv(CodingEnvConfig(max_turns=4, requirements=("fence", "tool_json"))),
        rollouts_per_group=4, config=RolloutConfig(max_new_tokens=96, max_total_tokens=1536),
        sampling_key=jax.random.key(0), seed=1,
        rates=FeedbackRates(correct=0.5, irrelevant=0.25, wrong=0.25),
    )  # fmt: skip
    trajs = fn(None, 0, generate_tasks("heldout", 2, seed=0), 0)
    per_turn = [[hint_kind("fence", h["fence"]) for h in t.info["turn_hint_texts"]] for t in trajs]
    assert all(len(k) == 4 for k in per_turn)
    assert any(len(set(k)) > 1 for k in per_turn)  # kinds differ between turns of an episode
    batch = build_batch(trajs, max_len=1536, teacher_max_len=2048, pad_to_multiple=0)
    for b, t in enumerate(trajs):
        row = renderer.tokenizer.decode(
            batch.teacher_tokens_BtxTt[b][batch.teacher_segment_ids_BtxTt[b] > 0].tolist()
        )
        at = 0
        for k, texts in enumerate(t.info["turn_hint_texts"]):
            ids = t.hint_ids(k, ["fence"])
            assert renderer.tokenizer.decode(ids.tolist()).count(texts["fence"]) == 1
            found = row.find(texts["fence"], at)  # turn k's own pick, in turn order
            assert found >= 0, (b, k)
            at = found + 1
