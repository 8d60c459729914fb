"""Two requirements at once: a turn that breaks both gets the one hint message the base model
was taught (SFT transcripts) and is evaluated with (hinted evaluation), whatever the order of
env.requirements; and configs/joint.py runs."""

import json
import os

import jax
import numpy as np
import pytest

from tg_jax import config_files
from tg_jax.envs.base import HINT_ROLE
from tg_jax.envs.coding import CodingEnv, CodingEnvConfig
from tg_jax.envs.hints import CORRECT_HINTS, FeedbackRates
from tg_jax.envs.tasks import generate_tasks
from tg_jax.envs.transcripts import TranscriptConfig, make_transcripts
from tg_jax.rl.batch import build_batch
from tg_jax.sampling.rollout import RolloutConfig, rollout_groups
from tg_jax.sampling.scripted import ScriptedSampler
from tg_jax.sampling.trajectory import hint_key
from tg_jax.text import ByteTokenizer, ChatRenderer, hint_message
from tg_jax.train import rl_rollouts

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "configs")
RENDERER = ChatRenderer(ByteTokenizer())
ROLLOUT = RolloutConfig(max_new_tokens=96, max_total_tokens=1536)
BOTH = f"{CORRECT_HINTS['fence']}\n{CORRECT_HINTS['tool_json']}"  # fence < tool_json
PLAIN_TURN = 'def f(x): return x\n{"name": "run_tests"}'  # no fence, no <tool_call>: fails both


def _env(order):
    return CodingEnv(CodingEnvConfig(max_turns=2, requirements=order))


@pytest.mark.parametrize("order", [("fence", "tool_json"), ("tool_json", "fence")])
def test_hint_text_is_one_line_per_requirement_in_name_order(order):
    env = _env(order)
    assert env.hint(["tool_json", "fence"]) == env.hint(["fence", "tool_json"]) == BOTH
    assert env.hint(["tool_json"]) == CORRECT_HINTS["tool_json"]


def test_sft_transcripts_hint_both_requirements_in_name_order():
    cfg = CodingEnvConfig(executor="trusted", max_turns=3, requirements=("tool_json", "fence"))
    transcripts = make_transcripts(
        generate_tasks("train", 40, seed=0), seed=0,
        config=TranscriptConfig(p_hinted=1.0, p_hint_requirement=1.0), env_config=cfg,
    )  # fmt: skip
    hints = [m["content"] for t in transcripts for m in t.messages if m["role"] == HINT_ROLE]
    assert BOTH in hints  # turns where both apply: the one two-line message
    assert f"{CORRECT_HINTS['tool_json']}\n{CORRECT_HINTS['fence']}" not in hints


def _check_teacher_hint(batch, traj, b, turn, want):
    """Teacher row b (full rows) holds `want` right before assistant turn `turn`, then the
    turn's own tokens."""
    row = batch.teacher_tokens_BtxTt[b][batch.teacher_segment_ids_BtxTt[b] > 0]
    start = int(traj.turn_starts[turn])
    if turn == 0:
        np.testing.assert_array_equal(row[:start], traj.tokens[:start])
    else:  # after turn 0's own hint
        start += len(traj.hint_ids(0, traj.failed_requirements(0)))
    np.testing.assert_array_equal(row[start : start + len(want)], want)
    header = traj.tokens[traj.turn_starts[turn] : traj.turn_starts[turn] + 3]
    np.testing.assert_array_equal(row[start + len(want) : start + len(want) + 3], header)


@pytest.mark.parametrize("order", [("fence", "tool_json"), ("tool_json", "fence")])
def test_a_turn_failing_both_gets_their_one_message_before_it(order):
    env = _env(order)
    (traj,) = rollout_groups(
        ScriptedSampler(RENDERER, [PLAIN_TURN, PLAIN_TURN]), None, RENDERER,
        lambda: _env(order), generate_tasks("heldout", 1, seed=0), rollouts_per_task=1,
        config=ROLLOUT, rng=jax.random.key(0), policy_version=0,
    )  # fmt: skip
    assert traj.failed_requirements(0) == ["fence", "tool_json"]
    # What the hinted evaluation and the SFT transcripts show: one message, both lines.
    want = RENDERER.render_message(hint_message(env.hint(["fence", "tool_json"])))
    assert RENDERER.tokenizer.decode(want).count(BOTH) == 1
    np.testing.assert_array_equal(traj.hint_ids(0, ["fence", "tool_json"]), want)
    batch = build_batch([traj], max_len=1536, teacher_max_len=2048, pad_to_multiple=0)
    _check_teacher_hint(batch, traj, 0, 0, want)
    # One requirement: its own message, as before.
    np.testing.assert_array_equal(
        traj.hint_ids(0, ["fence"]),
        RENDERER.render_message(hint_message(CORRECT_HINTS["fence"])),
    )
    assert set(traj.hint_tokens) == {"fence", "tool_json", hint_key(order)}
    assert batch.tg_mask_BxT.any()  # the turn is distilled against that context


def test_imperfect_feedback_joins_the_picks_of_a_turn_into_one_message():
    fn = rl_rollouts.BatchRollout(
        ScriptedSampler(RENDERER, [PLAIN_TURN] * 2), RENDERER,
        lambda: _env(("tool_json", "fence")), rollouts_per_group=4, config=ROLLOUT,
        sampling_key=jax.random.key(0), seed=1,
        rates=FeedbackRates(correct=0.5, irrelevant=0.25, wrong=0.25),
    )  # fmt: skip
    trajs = fn(None, 0, generate_tasks("heldout", 1, seed=0), 0)
    batch = build_batch(trajs, max_len=1536, teacher_max_len=4096, pad_to_multiple=0)
    for b, t in enumerate(trajs):
        texts = t.info["turn_hint_texts"][0]
        assert set(texts) == {"fence", "tool_json"}
        want = RENDERER.render_message(hint_message(f"{texts['fence']}\n{texts['tool_json']}"))
        _check_teacher_hint(batch, t, b, 0, want)


def test_joint_config_judges_and_rewards_both():
    config = config_files.load_config_file(os.path.join(CONFIG_DIR, "joint.py"))
    assert tuple(config.env.requirements) == ("fence", "tool_json")
    assert dict(config.rl.reward_weights) == {"task": 1.0, "fence": 0.5, "tool_json": 0.5}
    assert set(config.sft.hint_requirements) == {"fence", "tool_json"}
    assert set(config.sft.transcripts.forced_requirements) == {"fence", "tool_json"}


@pytest.mark.e2e
def test_joint_config_runlocal_smoke(tmp_path):
    from tests.test_frozen_teacher_cli import _main

    work = tmp_path / "w"
    out = _main("configs/joint.py:runlocal", work).stdout
    for arm in ("grpo", "tg"):
        summary = json.loads((work / "runs" / f"{arm}_seed0" / "rl_summary.json").read_text())
        assert summary["finished"], summary
    train = [json.loads(line) for line in open(work / "runs" / "tg_seed0" / "metrics.jsonl")]
    train = [m for m in train if m.get("stage") == "train"]
    assert train and all({"tg_kl/fence", "tg_kl/tool_json"} <= set(m) for m in train)
    base = json.loads((work / "sft_eval.json").read_text())
    assert {"hinted_compliance/fence", "hinted_compliance/tool_json"} <= set(base)
    md = (work / "report" / "report.md").read_text()
    assert "held-out" in out and "joint" in md


def test_joint_config_rejects_an_unknown_argument():
    with pytest.raises(ValueError, match="configs/joint.py takes no argument or 'runlocal'"):
        config_files.load_config_file(os.path.join(CONFIG_DIR, "joint.py"), "big")
