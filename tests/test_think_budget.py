"""Reasoning-length budgets (`rl_loop.think_budget`): on the rollout engine a turn samples at
most that many tokens of its <think> block; a block still open is closed by a </think> the
policy did not sample, and the turn goes on to its answer."""

import jax
import ml_collections
import numpy as np
import pytest

from tests.test_hidden_thinking import _play, _shipped
from tg_jax import config_lib
from tg_jax.sampling import agent_loop
from tg_jax.sampling.rollout import RolloutConfig, play_episodes
from tg_jax.sampling.sampler import sequence_logprobs
from tg_jax.sampling.trajectory import Role
from tg_jax.train.loop_settings import LoopConfig


def _think_lengths(t):
    return [int(((t.roles == Role.THINK) & (t.turn_ids == k)).sum()) for k in range(t.num_turns)]


@pytest.mark.slow
def test_a_budget_the_blocks_fit_changes_no_greedy_token():
    """The base's blocks are 5-6 tokens: with a budget of 8 every turn is still sampled in two
    requests (8 tokens, then the rest), and greedy episodes are token for token the same."""
    plain = _play("engine", 0.0, hide=False, think_budget=0)
    split = _play("engine", 0.0, hide=False, think_budget=8)
    assert max(max(_think_lengths(t)) for t in plain) <= 6
    for a, b in zip(plain, split, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.roles, b.roles)
        np.testing.assert_allclose(a.behaviour_logprobs, b.behaviour_logprobs, atol=1e-5)
        assert b.closed_by_rollout() == 0 and a.rewards == b.rewards


def test_a_short_budget_closes_each_block_and_the_turn_goes_on():
    model, params, renderer, *_ = _shipped()
    trajs = _play("engine", 1.0, hide=False, think_budget=2, tasks=6, seed=5)
    end = renderer.think_end_id
    closed = 0
    for t in trajs:
        assert max(_think_lengths(t)) <= 2
        for k in range(t.num_turns):
            idx = np.flatnonzero(t.turn_ids == k)
            inside = [j for j in range(idx[0], idx[-1]) if t.turn_ids[j] < 0]
            if not inside:
                continue
            (j,) = inside  # the forced </think>: third token of the turn, never trained on
            assert j == idx[0] + 2 and t.tokens[j] == end
            assert (t.roles[j], t.behaviour_logprobs[j]) == (Role.PROMPT, 0.0)
            assert t.roles[j + 1] == Role.ANSWER  # the answer follows
            closed += 1
        assert t.closed_by_rollout() == sum(
            any(t.turn_ids[j] < 0 for j in range(i[0], i[-1]))
            for i in (np.flatnonzero(t.turn_ids == k) for k in range(t.num_turns))
        )  # fmt: skip
    assert closed >= len(trajs)  # every first turn opens a block longer than 2 tokens
    # The behaviour log-probs are the model's with the forced token in context.
    rows = np.zeros((len(trajs), 512), np.int32)
    for i, t in enumerate(trajs):
        rows[i, : len(t.tokens)] = t.tokens
    got = np.asarray(jax.jit(sequence_logprobs, static_argnums=0)(model, params, rows))
    for i, t in enumerate(trajs):
        mine = t.turn_ids >= 0
        np.testing.assert_allclose(
            t.behaviour_logprobs[mine], got[i, : len(t.tokens)][mine], atol=2e-4
        )


def test_where_a_budget_cannot_run():
    _, params, renderer, sampler, _, envs = _shipped()
    with pytest.raises(ValueError, match="needs rl_loop.rollout_engine 'builtin' or 'vllm'"):
        play_episodes(sampler, params, renderer, envs, [], config=RolloutConfig(think_budget=2),
                      rng=jax.random.key(0))  # fmt: skip
    with pytest.raises(ValueError, match="not 'lockstep'"):
        LoopConfig(think_budget=2, rollout_engine="lockstep")
    with pytest.raises(ValueError, match="choose one"):
        LoopConfig(think_budget=2, hide_thinking=True)
    with pytest.raises(ValueError, match="think_budget must be >= 0"):
        LoopConfig(think_budget=-1)
    cfg = ml_collections.ConfigDict({
        "model": {"router_replay": True}, "rl_loop": config_lib.loop_config(think_budget=2),
    })  # fmt: skip
    with pytest.raises(ValueError, match="router_replay with rl_loop.think_budget"):
        agent_loop.router_replay(cfg)
