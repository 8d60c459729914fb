"""Hidden planning text (`rl_loop.hide_thinking`, tg_jax.rl.hidden_thinking): each turn is
played in its visible context (no earlier <think> block) on both rollout paths, its behaviour
log-probs are the trainer's recomputation of its segment row, an episode counts once in the
group statistics, and the main job runs the arm from the shipped base."""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.test_train_step import (
    _config,
    _forward,
    _loss_and_grad,
    _model_and_params,
    _tree_close,
)
from tg_jax import config_files
from tg_jax import engine as engine_api
from tg_jax.envs import env_factory
from tg_jax.envs.tasks import generate_tasks
from tg_jax.metrics import read_metrics
from tg_jax.models import ModelConfig, Transformer, hf_dir
from tg_jax.rl import hidden_thinking
from tg_jax.rl.advantages import group_advantages
from tg_jax.rl.batch import build_batch
from tg_jax.sampling import agent_loop
from tg_jax.sampling.rollout import RolloutConfig, rollout_groups
from tg_jax.sampling.sampler import Sampler, sequence_logprobs
from tg_jax.sampling.trajectory import Role, Trajectory
from tg_jax.testing import synthetic_trajectories
from tg_jax.train import shipped_base

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
P, T, A, E = Role.PROMPT, Role.THINK, Role.ANSWER, Role.ENV


def _two_turns(**kw) -> Trajectory:
    """prompt(2) header(1) think(2) answer(2) env(2) header(1) think(1) answer(2) env(1)."""
    roles = [P, P, P, T, T, A, A, E, E, P, T, A, A, E]
    turns = [-1, -1, -1, 0, 0, 0, 0, -1, -1, -1, 1, 1, 1, -1]
    lp = [0.0] * 3 + [-0.1, -0.2, -0.3, -0.4] + [0.0] * 3 + [-0.5, -0.6, -0.7, 0.0]
    fields = dict(
        tokens=np.arange(100, 114), roles=np.asarray(roles, np.int8),
        turn_ids=np.asarray(turns, np.int32), turn_starts=np.asarray([2, 9]),
        behaviour_logprobs=np.asarray(lp, np.float32),
        turn_verdicts=[{"fence": False}, {"fence": True}], rewards={"task": 1.0, "fence": 0.5},
        hint_tokens={"fence": [7, 7]}, group_id=3, policy_version=2, task_id="t",
        info={"rejected_turns": [1], "termination": "done"},
        turn_breaks=[{"fence": 5}, {}], turn_hint_tokens=[{"fence": [8]}, {"fence": [9]}],
    )  # fmt: skip
    return Trajectory(**{**fields, **kw})


def test_segments_by_hand():
    traj = _two_turns()
    (s0, s1), heads = hidden_thinking.segments([traj])
    assert heads == [True, False]
    # Turn 0: everything up to its last token (what follows belongs to turn 1's context).
    np.testing.assert_array_equal(s0.tokens, np.arange(100, 107))
    np.testing.assert_array_equal(s0.roles, [P, P, P, T, T, A, A])
    np.testing.assert_array_equal(s0.turn_ids, [-1, -1, -1, 0, 0, 0, 0])
    np.testing.assert_allclose(s0.behaviour_logprobs, [0, 0, 0, -0.1, -0.2, -0.3, -0.4])
    assert list(s0.turn_starts) == [2] and s0.turn_verdicts == [{"fence": False}]
    assert s0.turn_breaks == [{"fence": 5}] and s0.turn_hint_tokens == [{"fence": [8]}]
    assert s0.info["rejected_turns"] == [] and s0.info["termination"] == "done"
    # Turn 1: turn 0's thinking (tokens 103, 104) gone, its answer context; to the end.
    np.testing.assert_array_equal(s1.tokens, [100, 101, 102, 105, 106, 107, 108, 109, 110,
                                              111, 112, 113])  # fmt: skip
    np.testing.assert_array_equal(s1.roles, [P, P, P, P, P, E, E, P, T, A, A, E])
    np.testing.assert_array_equal(s1.turn_ids, [-1] * 8 + [0, 0, 0, -1])
    np.testing.assert_allclose(s1.behaviour_logprobs, [0] * 8 + [-0.5, -0.6, -0.7, 0])
    assert list(s1.turn_starts) == [7] and s1.turn_verdicts == [{"fence": True}]
    assert s1.turn_hint_tokens == [{"fence": [9]}] and s1.info["rejected_turns"] == [0]
    assert (s1.rewards, s1.group_id, s1.policy_version) == (traj.rewards, 3, 2)
    # Every produced token is in exactly one segment.
    produced = sum(int(np.isin(s.roles, [T, A]).sum()) for s in (s0, s1))
    assert produced == int(np.isin(traj.roles, [T, A]).sum())
    one = dataclasses.replace(traj, turn_starts=traj.turn_starts[:1], turn_verdicts=[{}],
                              turn_breaks=None, turn_hint_tokens=None)  # fmt: skip
    assert hidden_thinking.segments([one]) == ([one], [True])  # one turn: unchanged
    with pytest.raises(ValueError, match="routing record"):
        hidden_thinking.segment(
            dataclasses.replace(traj, routed_experts=np.zeros((14, 1, 1), np.int16)), 1
        )


def test_group_statistics_count_each_episode_once():
    """Episode rows (rewards 1, 0, 0 in group 0; 1, 1 in group 1) with extra turn rows of the
    first and last episode: the advantages are each episode's, the metrics the episodes'."""
    rewards = np.asarray([1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0], np.float32)
    groups = np.asarray([0, 0, 0, 0, 0, 1, 1, 1])
    heads = np.asarray([True, False, False, True, True, True, True, False])
    adv, m = group_advantages(rewards, groups, stats_B=heads)
    mean, std = 1 / 3, np.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 3)
    want = [(1 - mean) / (std + 1e-6)] * 3 + [-mean / (std + 1e-6)] * 2 + [0.0] * 3
    np.testing.assert_allclose(adv, want, rtol=1e-5)
    assert float(m.reward_mean) == pytest.approx(3 / 5) and int(m.num_groups) == 2
    assert float(m.frac_zero_std_groups) == pytest.approx(0.5)


def _no_thinking(trajs):
    return [dataclasses.replace(t, roles=np.where(t.roles == T, A, t.roles).astype(np.int8))
            for t in trajs]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["grpo", "dr_grpo"])
def test_turn_rows_without_thinking_give_the_loss_and_gradient_of_whole_episodes(mode):
    """With nothing to hide, a turn's row is a prefix of its episode's row: the policy loss
    (token mean), the TG term (token sum over episodes x tg.norm_length; the per-turn teacher
    of whole rows is the segments' teacher), their gradients and the reward metrics equal."""
    rng = np.random.default_rng(0)
    trajs = _no_thinking(synthetic_trajectories(rng, 8, 40, hint_len=5, fail_prob=0.5))
    for i, t in enumerate(trajs):
        t.rewards["task"] = float(i % 3 == 0)
    model, params = _model_and_params()
    kw = dict(max_len=64, teacher_max_len=64, requirement_names=("fence",), pad_to_multiple=16)
    whole = build_batch(trajs, mode="per_turn", max_teacher_rows=16, **kw)
    segs, heads = hidden_thinking.segments(trajs)
    parts = build_batch(segs, mode="per_trajectory", heads=heads, min_rows=24, **kw)
    assert parts.tokens_BxT.shape[0] == 24 and int(parts.head_B.sum()) == 8
    batches = []
    for b in (whole, parts):  # on-policy behaviour log-probs (each row's own forward)
        logits = _forward()(params, b.tokens_BxT, b.positions_BxT, b.segment_ids_BxT)
        logp = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits, -1)),
                                  b.targets_BxT[..., None], -1)[..., 0]  # fmt: skip
        batches.append(dataclasses.replace(
            b, behaviour_logprobs_BxT=np.where(b.loss_mask_BxT, logp, 0.0).astype(np.float32)
        ))  # fmt: skip
    cfg = _config(**{"rl.advantage_mode": mode})
    loss_w, sums_w, grads_w = _loss_and_grad(
        _config(**{"rl.advantage_mode": mode, "tg.teacher_mode": "per_turn"}), batches[0]
    )
    loss_p, sums_p, grads_p = _loss_and_grad(cfg, batches[1])
    assert sums_w["tg_loss"] > 1e-6
    for key in ("tg_loss", "pg_loss"):
        np.testing.assert_allclose(sums_p[key], sums_w[key], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(loss_p, loss_w, rtol=1e-5, atol=1e-7)
    _tree_close(grads_p, grads_w, atol=1e-6, rtol=1e-4)


@functools.cache
def _shipped():
    """The shipped default base (it writes <think> blocks and multi-turn episodes), its
    sampler, an engine runner and the default environment."""
    config = config_files.load_config_file(os.path.join(REPO, "configs", "default.py"))
    md = hf_dir.open_model_dir(os.path.join(shipped_base.BASES_DIR, "default"))
    model = Transformer(ModelConfig.from_config(config.model))
    params = md.load_params(ModelConfig.from_config(config.model))
    pad = md.renderer.tokenizer.pad_id
    runner = agent_loop.EngineRunner(engine_api, model, slots=8, max_total_tokens=512,
                                     pad_id=pad)  # fmt: skip
    envs = env_factory(config.env, md.renderer.tool_format)
    return model, params, md.renderer, Sampler(model, pad_id=pad), runner, envs


def _play(path, temperature, hide=True, tasks=4, g=2, seed=3, think_budget=0):
    model, params, renderer, sampler, runner, envs = _shipped()
    cfg = RolloutConfig(max_new_tokens=96, max_total_tokens=512, temperature=temperature,
                        hide_thinking=hide, think_budget=think_budget)  # fmt: skip
    play = {"play": agent_loop.play_episodes} if path == "engine" else {}
    return rollout_groups(
        runner if path == "engine" else sampler, params, renderer, envs,
        generate_tasks("heldout", tasks, seed=seed), rollouts_per_task=g, config=cfg,
        rng=jax.random.key(seed), policy_version=0, **play,
    )  # fmt: skip


def _hidden_turns(trajs):
    """(segment, trajectory) of every turn that had an earlier <think> block hidden."""
    out = []
    for t in trajs:
        for k in range(1, t.num_turns):
            earlier = (t.roles == T) & (t.turn_ids >= 0) & (t.turn_ids < k)
            if earlier.any():
                out.append((hidden_thinking.segment(t, k), t, k))
    return out


@pytest.mark.slow
def test_greedy_hidden_episodes_are_the_same_on_both_rollout_paths():
    lock, eng = _play("lockstep", 0.0), _play("engine", 0.0)
    for a, b in zip(lock, eng, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.roles, b.roles)
        np.testing.assert_allclose(a.behaviour_logprobs, b.behaviour_logprobs, atol=1e-4)
    assert _hidden_turns(eng), "the base played no multi-turn episode with thinking"


@pytest.mark.slow
@pytest.mark.parametrize("path", ["engine", "lockstep"])
def test_sampled_turns_carry_the_log_probs_of_their_visible_context(path):
    """Temperature 1: each later turn's behaviour log-probs are the model's on its segment
    (its earlier thinking removed), not on the whole episode, where they differ."""
    model, params, *_ = _shipped()
    # 4 tasks x 2: the batch shapes of the greedy test's episodes (compiled programs shared).
    trajs = _play(path, 1.0, tasks=4, g=2, seed=5)
    hidden = _hidden_turns(trajs)
    assert len(hidden) >= 2, "too few multi-turn episodes with thinking to check"
    logp = _logprobs
    worst_full = 0.0
    for seg, traj, k in hidden:
        mine = seg.turn_ids == 0
        row = np.zeros((1, 512), np.int32)
        row[0, : len(seg.tokens)] = seg.tokens
        got = np.asarray(logp(model, params, row))[0, : len(seg.tokens)]
        np.testing.assert_allclose(seg.behaviour_logprobs[mine], got[mine], atol=2e-4)
        full = np.zeros((1, 512), np.int32)
        full[0, : len(traj.tokens)] = traj.tokens
        got_full = np.asarray(logp(model, params, full))[0, : len(traj.tokens)]
        own = traj.turn_ids == k
        worst_full = max(worst_full, float(np.abs(got_full[own] - traj.behaviour_logprobs[own])
                                           .max()))  # fmt: skip
    assert worst_full > 1e-2  # the whole episode is not the context the turns were drawn in
    shown = _play(path, 1.0, hide=False, tasks=4, g=2, seed=5)  # the default: all visible
    assert not any((t.roles == T).any() and t.num_turns > 1
                   and _differs_from_whole(model, params, t) for t in shown)  # fmt: skip


_logprobs = jax.jit(sequence_logprobs, static_argnums=0)  # one program for every 512-token row


def _differs_from_whole(model, params, traj) -> bool:
    row = np.zeros((1, 512), np.int32)
    row[0, : len(traj.tokens)] = traj.tokens
    got = np.asarray(_logprobs(model, params, row))[0]
    mine = traj.turn_ids >= 0
    return bool(np.abs(got[: len(traj.tokens)][mine] - traj.behaviour_logprobs[mine]).max() > 2e-4)


def test_a_config_that_cannot_hide_thinking_is_refused():
    c = config_files.load_config_file(os.path.join(REPO, "configs", "tiny.py"))
    on = config_files.apply_overrides(c, {"rl_loop.hide_thinking": True})
    assert hidden_thinking.rows_per_episode(on) == 1 and hidden_thinking.rows_per_episode(c) == 1
    assert hidden_thinking.rows_per_episode(
        config_files.apply_overrides(on, {"env.max_turns": 3})
    ) == 3  # fmt: skip
    with pytest.raises(ValueError, match="bounded episode"):
        hidden_thinking.check_config(config_files.apply_overrides(on, {"env.max_turns": 0}))
    with pytest.raises(ValueError, match="router_replay"):
        hidden_thinking.check_config(config_files.apply_overrides(
            on, {"model.router_replay": True}
        ))  # fmt: skip


@pytest.mark.e2e
def test_the_thinking_protocol_runs_the_hidden_arm_from_the_shipped_base(tmp_path):
    """The user's command on configs/thinking.py, tiny settings: the hidden arm trains from the
    shipped base (rows = episodes x 3 turns), is evaluated with hidden thinking, and the report
    compares its distilled tokens with tg's."""
    work = tmp_path / "w"
    cmd = [sys.executable, "-m", "tg_jax.main", "--config=configs/thinking.py",
           f"--workdir={work}", "--config.pipeline.arms=('tg','tg_think_hidden','tg_think_short')",
           "--config.eval.train_seeds=(0,)", "--config.eval.baseline=tg",
           "--config.rl_loop.steps=2", "--config.optim.total_steps=2",
           "--config.rl_loop.groups_per_step=2", "--config.rl_loop.rollouts_per_group=2",
           "--config.rl_loop.eval_every=0", "--config.eval.num_tasks=4",
           "--config.eval.samples_per_task=1", "--config.sft.eval.num_tasks=8"]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    prereg = json.loads((work / "preregistration.json").read_text())
    assert prereg["arms"]["tg_think_hidden"]["rl_loop"]["hide_thinking"] is True
    for arm in ("tg", "tg_think_hidden", "tg_think_short"):
        summary = json.loads((work / "runs" / f"{arm}_seed0" / "rl_summary.json").read_text())
        assert summary["finished"] and summary["step"] == 2, summary
    report = (work / "report" / "report.md").read_text()
    for arm in ("tg_think_hidden", "tg_think_short"):
        assert f"| {arm} |" in report and f"Thinking-token control: `{arm}`" in report
    metrics = read_metrics(work / "runs" / "tg_think_short_seed0")
    closed = [m["rollout/think_closed"] for m in metrics if "rollout/think_closed" in m]
    assert closed and min(closed) >= 1.0  # every episode's first block is closed at 2 tokens
