"""GRPO / Dr. GRPO advantages against a plain numpy loop over groups."""

import jax
import numpy as np
import pytest

from tg_jax.rl import advantages as adv_lib


def _numpy_advantages(rewards, group_ids, mode, eps, ddof, valid):
    adv = np.zeros_like(rewards, dtype=np.float64)
    zero_std = []
    for g in np.unique(group_ids[valid]):
        idx = np.where((group_ids == g) & valid)[0]
        r = rewards[idx].astype(np.float64)
        n = len(r)
        std = np.sqrt(((r - r.mean()) ** 2).sum() / max(n - ddof, 1))
        zero_std.append(np.all(r == r[0]))
        if np.all(r == r[0]):
            continue
        adv[idx] = (r - r.mean()) / (std + eps) if mode == "grpo" else r - r.mean()
    return adv, np.mean(zero_std)


def test_hand_computed_group():
    # One group of 4: rewards 1, 0, 0, 1 -> mean 0.5, population std 0.5 -> A = +-1.
    # A second group of 2 with equal rewards -> A = 0 and counts as a zero-variance group.
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 3.0, 3.0], np.float32)
    groups = np.array([7, 7, 7, 7, -2, -2])
    adv, metrics = adv_lib.group_advantages(rewards, groups, eps=0.0)
    np.testing.assert_allclose(adv, [1, -1, -1, 1, 0, 0], atol=1e-6)
    assert float(metrics.num_groups) == 2
    assert float(metrics.frac_zero_std_groups) == 0.5
    adv, _ = adv_lib.group_advantages(rewards, groups, mode="dr_grpo")
    np.testing.assert_allclose(adv, [0.5, -0.5, -0.5, 0.5, 0, 0], atol=1e-6)
    # Unbiased std (ddof=1): sqrt(1/3) for the first group.
    adv, _ = adv_lib.group_advantages(rewards, groups, eps=0.0, ddof=1)
    np.testing.assert_allclose(adv[:4], np.array([1, -1, -1, 1]) * 0.5 / np.sqrt(1 / 3), rtol=1e-6)


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo"])
@pytest.mark.parametrize("ddof", [0, 1])
def test_random_groups_vs_numpy(mode, ddof):
    rng = np.random.default_rng(0)
    batch = 23
    groups = rng.choice([-5, 3, 11, 1000, 42], size=batch)  # uneven sizes, arbitrary ids
    rewards = rng.integers(0, 3, size=batch).astype(np.float32) * 0.5
    rewards[groups == 42] = 1.0  # a zero-variance group
    valid = rng.random(batch) > 0.2
    fn = jax.jit(adv_lib.group_advantages, static_argnames=("mode", "eps", "ddof"))
    adv, metrics = fn(rewards, groups, mode=mode, eps=1e-4, ddof=ddof, valid_B=valid)
    want, want_frac = _numpy_advantages(rewards, groups, mode, 1e-4, ddof, valid)
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(adv)[~valid] == 0.0)
    assert float(metrics.num_groups) == len(np.unique(groups[valid]))
    np.testing.assert_allclose(float(metrics.frac_zero_std_groups), want_frac, rtol=1e-6)
    np.testing.assert_allclose(float(metrics.reward_mean), rewards[valid].mean(), rtol=1e-6)
    np.testing.assert_allclose(float(metrics.reward_std), rewards[valid].std(), rtol=1e-5)


def test_combined_rewards():
    rewards = {
        "task": np.array([1.0, 0.0, 1.0, 0.0], np.float32),
        "markdown": np.array([0.0, 1.0, 1.0, 0.0], np.float32),
        "logged_only": np.array([9.0, 9.0, 9.0, 9.0], np.float32),
    }
    weights = {"task": 1.0, "markdown": 0.5}
    adv, total, _ = adv_lib.compute_advantages(rewards, weights, np.array([0, 0, 0, 0]), eps=0.0)
    np.testing.assert_allclose(total, [1.0, 0.5, 1.5, 0.0])
    r = np.array([1.0, 0.5, 1.5, 0.0])
    np.testing.assert_allclose(adv, (r - r.mean()) / r.std(), rtol=1e-6)
    with pytest.raises(KeyError):
        adv_lib.combine_rewards(rewards, {"missing": 1.0})


def test_per_reward_normalisation_by_hand():
    # One group of 4: task [1, 0, 1, 0] (mean 0.5, std 0.5), fence [1, 1, 0, 0] (mean 0.5,
    # std 0.5); weights 1 and 0.5. Each component's advantage is +-1, so
    # A = 1 * [1, -1, 1, -1] + 0.5 * [1, 1, -1, -1] = [1.5, -0.5, 0.5, -1.5].
    rewards = {
        "task": np.array([1.0, 0.0, 1.0, 0.0], np.float32),
        "fence": np.array([1.0, 1.0, 0.0, 0.0], np.float32),
    }
    weights = {"task": 1.0, "fence": 0.5}
    groups = np.zeros(4, np.int32)
    adv, total, metrics = adv_lib.compute_advantages(
        rewards, weights, groups, eps=0.0, reward_norm="per_reward"
    )
    np.testing.assert_allclose(adv, [1.5, -0.5, 0.5, -1.5], rtol=1e-6)
    np.testing.assert_allclose(total, [1.5, 0.5, 1.0, 0.0])  # the combined reward, unchanged
    np.testing.assert_allclose(float(metrics.reward_mean), 0.75)


def test_per_reward_keeps_the_task_advantage_when_a_requirement_varies():
    # Task [1, 0, 0, 0], requirement [1, 1, 1, 0], both weighted 1: combined [2, 1, 1, 0]
    # (mean 1, std 0.707), so row 0's success is worth (2 - 1) / 0.707 = 1.414 over rows 1-2,
    # which row 3's requirement failure's share of the std holds down; per reward each
    # component has std 0.433 and row 0 gets the task's own sqrt(3) plus 1 / sqrt(3).
    rewards = {
        "task": np.array([1.0, 0.0, 0.0, 0.0], np.float32),
        "req": np.array([1.0, 1.0, 1.0, 0.0], np.float32),
    }
    weights = {"task": 1.0, "req": 1.0}
    groups = np.zeros(4, np.int32)
    combined, _, _ = adv_lib.compute_advantages(rewards, weights, groups, eps=0.0)
    per, _, _ = adv_lib.compute_advantages(
        rewards, weights, groups, eps=0.0, reward_norm="per_reward"
    )
    np.testing.assert_allclose(float(combined[0] - combined[1]), np.sqrt(2), rtol=1e-6)
    np.testing.assert_allclose(float(per[0]), np.sqrt(3) + 1 / np.sqrt(3), rtol=1e-6)
    # Rows 1 and 2 differ from row 0 by the task alone: their advantage gap is the task's.
    np.testing.assert_allclose(float(per[0] - per[1]), 4 / np.sqrt(3), rtol=1e-6)


def test_per_reward_normalisation_against_numpy():
    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(5), 4).astype(np.int32)
    valid = rng.random(20) > 0.15
    rewards = {k: rng.integers(0, 3, 20).astype(np.float32) / 2 for k in ("task", "a", "b")}
    weights = {"task": 1.0, "a": 0.5, "b": 0.25}
    adv, _, _ = adv_lib.compute_advantages(
        rewards, weights, groups, eps=1e-6, valid_B=valid, reward_norm="per_reward"
    )
    want = np.zeros(20)
    for g in range(5):
        rows = (groups == g) & valid
        for k, w in weights.items():
            r = rewards[k][rows]
            if r.max() > r.min():
                want[rows] += w * (r - r.mean()) / (r.std() + 1e-6)
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)
    # One component: per_reward is the combined normalisation.
    one = {"task": rewards["task"]}
    a1, _, _ = adv_lib.compute_advantages(one, {"task": 1.0}, groups, reward_norm="per_reward")
    a2, _, _ = adv_lib.compute_advantages(one, {"task": 1.0}, groups)
    np.testing.assert_allclose(a1, a2, rtol=1e-6)
    with pytest.raises(ValueError, match="reward_norm"):
        adv_lib.compute_advantages(one, {"task": 1.0}, groups, reward_norm="bogus")


def test_reward_norm_config_is_checked():
    from tg_jax import config_lib
    from tg_jax.rl.step_config import RLConfig

    c = config_lib.rl_config(reward_norm="per_reward")
    assert RLConfig.from_config(c).reward_norm == "per_reward"
    with pytest.raises(ValueError, match="reward_norm"):
        RLConfig.from_config(config_lib.rl_config(reward_norm="sum"))


def test_turn_advantages_by_hand():
    # One group of 2 rows x 4 tokens; row 0: 3 produced tokens, its turn passed;
    # row 1: 2 produced tokens of a turn that passed, 1 of a turn that failed.
    # Tokens: 5 pass / 6 -> mean 5/6, std sqrt(5/6 * 1/6) = sqrt(5)/6.
    p = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)
    m = np.array([[1, 1, 1, 0], [1, 1, 1, 0]], bool)
    adv = adv_lib.turn_advantages(p, m, np.zeros(2, np.int32), eps=0.0)
    up, down = (1 - 5 / 6) / (np.sqrt(5) / 6), (0 - 5 / 6) / (np.sqrt(5) / 6)
    np.testing.assert_allclose(adv, [[up, up, up, 0], [up, up, down, 0]], rtol=1e-5)
    # dr_grpo: centred only; a group whose tokens all pass gets 0; padding rows get 0.
    dr = adv_lib.turn_advantages(p, m, np.zeros(2, np.int32), mode="dr_grpo")
    np.testing.assert_allclose(dr[1, 2], -5 / 6, rtol=1e-6)
    same = adv_lib.turn_advantages(np.ones((2, 4)), m, np.array([3, 3]))
    np.testing.assert_array_equal(same, 0.0)
    pad = adv_lib.turn_advantages(p, m, np.zeros(2, np.int32), valid_B=np.array([True, False]))
    np.testing.assert_array_equal(pad, 0.0)  # the one valid row's tokens all pass


def test_turn_credit_in_batch_advantages():
    import types

    from tg_jax.rl.loss import batch_advantages
    from tg_jax.rl.step_config import RLConfig

    # Two groups of two rows. Episode rewards: task and the fraction of tool_json-passing
    # turns; row 1 failed its second turn (tokens 2-3), row 3 failed its only turn.
    loss = np.array([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]], bool)
    failed = np.array([[0, 0, 0, 0], [0, 0, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0]], bool)
    batch = types.SimpleNamespace(
        rewards={
            "task": np.array([1.0, 0.0, 0.0, 0.0], np.float32),
            "tool_json": np.array([1.0, 0.5, 1.0, 0.0], np.float32),
        },
        group_ids_B=np.array([0, 0, 1, 1], np.int32),
        valid_B=np.ones(4, bool),
        head_B=None,
        requirement_names=("tool_json",),
        loss_mask_BxT=loss,
        failed_turn_mask_BxT=failed,
        unmet_turn_mask_BxT=failed,  # no turn refused by the environment
    )
    weights = (("task", 1.0), ("tool_json", 0.5))
    episode = RLConfig(reward_weights=weights, adv_eps=0.0)
    adv_e, total, _ = batch_advantages(batch, episode)
    assert adv_e.shape == (4,)
    np.testing.assert_allclose(total, [1.5, 0.25, 0.5, 0.0])
    turn = RLConfig(reward_weights=weights, adv_eps=0.0, requirement_credit="turn")
    adv_t, total_t, _ = batch_advantages(batch, turn)
    np.testing.assert_allclose(total_t, total)  # the logged reward is the episode's
    # Task advantages: group 0 [+1, -1], group 1 [0, 0] (equal task rewards).
    # Turn term, group 0: 6 of 8 tokens pass (mean 3/4, std sqrt(3)/4): +1/sqrt(3) on
    # passing tokens, -sqrt(3) on failing ones; group 1: 2 of 4 pass: +-1. Weight 0.5.
    a, b = 0.5 / np.sqrt(3), -0.5 * np.sqrt(3)
    want = np.array(
        [
            [1 + a, 1 + a, 1 + a, 1 + a],
            [-1 + a, -1 + a, -1 + b, -1 + b],
            [0.5, 0.5, 0, 0],
            [-0.5, -0.5, 0, 0],
        ]
    )
    np.testing.assert_allclose(adv_t, want, rtol=1e-5, atol=1e-6)
    # Row 0's second turn (tokens 2-3) met the requirement but the environment refused it:
    # unmet for the credit. Group 0: 4 of 8 tokens pass (mean 1/2, std 1/2): +-1, weight 0.5.
    batch.unmet_turn_mask_BxT = failed | np.array([[0, 0, 1, 1]] + [[0] * 4] * 3, bool)
    adv_r, _, _ = batch_advantages(batch, turn)
    want[0], want[1] = [1.5, 1.5, 0.5, 0.5], [-0.5, -0.5, -1.5, -1.5]
    np.testing.assert_allclose(adv_r, want, rtol=1e-5, atol=1e-6)
    batch.unmet_turn_mask_BxT = failed
    # Row 1's first turn (tokens 0-1) keeps a positive requirement term: its own turn passed.
    no_req = RLConfig(reward_weights=(("task", 1.0),), requirement_credit="turn")
    with pytest.raises(ValueError, match="requirement_credit"):
        batch_advantages(batch, no_req)
    with pytest.raises(ValueError, match="requirement_credit"):  # the run's start-up check
        no_req.credit_split(("tool_json",))
    assert turn.credit_split(("tool_json", "fence")) == (["tool_json"], {"task": 1.0})
    with pytest.raises(ValueError, match="requirement_credit"):
        RLConfig(requirement_credit="step")
