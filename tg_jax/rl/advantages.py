"""Group-normalised advantages for GRPO and Dr. GRPO.

Each rollout i belongs to a group g(i) of rollouts of the same task. Its scalar reward is a
weighted sum of reward components (task reward, requirement rewards, ...), and its advantage is

    GRPO:     A_i = (r_i - mean_{j in g(i)} r_j) / (std_{j in g(i)} r_j + eps)
    Dr. GRPO: A_i =  r_i - mean_{j in g(i)} r_j

With several reward components r = sum_k w_k r^k, `reward_norm="per_reward"` normalises each
component in its group before weighting (decoupled normalisation, as GDPO):

    A_i = sum_k w_k (r^k_i - mean_{j in g(i)} r^k_j) / (std_{j in g(i)} r^k_j + eps)

so a requirement reward that varies within a group cannot shrink the task reward's advantage
by inflating the combined std; "combined" (the default) normalises the weighted sum.

Requirement rewards are judged per assistant turn. Folded into the episode's reward (credit
"episode"), a turn that breaks a requirement lowers the advantage of every token of the
episode, the earlier turns' choices included: where later turns fail more often than first
ones, an episode is paid less for every turn it takes (running the tests, say). Credit
"turn" (`turn_advantages`) gives the requirement signal to the turn it judged instead:

    A_{i,t} = A^task_i + w_req (p_{i,t} - mean_g p) / (std_g p + eps)

where p_{i,t} = 1 if token t's turn broke no requirement, the group statistics run over the
group's produced tokens, and w_req is the sum of the requirement weights.

Group ids are arbitrary integers and groups may have any size; everything is computed with
segment ops over the batch, so the functions jit with a fixed batch size and recompile for
nothing else. The advantage is one number per rollout; broadcasting it over the rollout's
tokens is the policy loss's job.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from tg_jax.rl.step_config import REWARD_NORMS

AdvantageMode = Literal["grpo", "dr_grpo"]
RewardNorm = Literal["combined", "per_reward"]


class AdvantageMetrics(NamedTuple):
    """Batch statistics of the rewards behind the advantages (all scalars).

    Attributes:
      reward_mean: mean combined reward over valid rollouts.
      reward_std: population std of the combined reward over valid rollouts.
      num_groups: number of distinct groups among valid rollouts.
      frac_zero_std_groups: fraction of those groups whose rewards are all equal (their
        advantages are all 0, so they carry no GRPO signal; groups of size 1 count here).
    """

    reward_mean: jax.Array
    reward_std: jax.Array
    num_groups: jax.Array
    frac_zero_std_groups: jax.Array


def combine_rewards(rewards: Mapping[str, jax.Array], weights: Mapping[str, float]) -> jax.Array:
    """Weighted sum of reward components.

    Args:
      rewards: name -> reward component, each [B].
      weights: name -> weight. Every name of a non-zero weight must be present in
        `rewards` (a zero weight's may be absent: it weighs nothing); components without a
        weight are ignored (they can still be logged), so a run turns a reward off by
        dropping its weight or setting it to 0.

    Returns:
      rewards_B: float32 [B], sum_k weights[k] * rewards[k].
    """
    weights = present_weights(rewards, weights)
    missing = sorted(set(weights) - set(rewards))
    if missing:
        raise KeyError(f"weights name reward components that are missing: {missing}")
    if not weights:
        raise ValueError("weights is empty: the combined reward would be identically zero")
    total_B = None
    for name in sorted(weights):  # fixed order, so the float sum is reproducible
        term_B = jnp.asarray(rewards[name], jnp.float32) * weights[name]
        total_B = term_B if total_B is None else total_B + term_B
    return total_B


def present_weights(rewards: Mapping[str, object], weights: Mapping[str, float]) -> dict:
    """`weights` without the zero weights of components `rewards` lacks (a reward turned off
    by its weight, e.g. a config's default requirement replaced on the command line)."""
    return {k: w for k, w in weights.items() if k in rewards or float(w) != 0.0}


def resolve_weights(
    weights: Mapping[str, float],
    components: Sequence[str],
    requirements: Mapping[str, float],
) -> dict[str, float]:
    """The reward weights a run uses, reconciled with what its environment provides.

    1. Every weight of `weights` (`rl.reward_weights`) is kept as given.
    2. Where `weights` reward requirements (a key besides "task"), a requirement of
       `requirements` (name -> its own `Requirement.weight`, in env.requirements order) with
       no weight gets that one: naming a requirement in env.requirements (a plug-in, on the
       command line, where no weight key can be added) rewards it as the config rewards
       its others. Weights of the task alone (configs/tiny.py's GRPO) reward no requirement.
    3. A zero weight on a component nobody provides is dropped (`present_weights`).

    Args:
      weights: rl.reward_weights, name -> weight.
      components: the reward components the environment returns (`Environment.reward_keys`:
        "task" and its requirements' names).
      requirements: the run's requirements, name -> default weight.

    Returns:
      name -> weight, in `weights`' order then the requirements'.

    Raises:
      ValueError: a non-zero weight on a component neither a requirement nor the environment
        provides, naming the weight and what is provided.
    """
    provided = tuple(components) + tuple(r for r in requirements if r not in components)
    unknown = [k for k, w in weights.items() if k not in provided and float(w) != 0.0]
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise ValueError(
            f"rl.reward_weights weighs {names}, which no requirement in env.requirements "
            f"{tuple(requirements)} and no reward of the environment {tuple(components)} "
            f"provides: add it to env.requirements, or set rl.reward_weights.{unknown[0]}=0"
        )
    out = {k: float(w) for k, w in weights.items() if k in provided}
    if any(k != "task" for k in weights):
        out.update({r: float(w) for r, w in requirements.items() if r not in out})
    return out


def _dense_groups(
    group_ids_B: jax.Array, valid_B: jax.Array
) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
    """Dense segment ids 0..G-1 of the group ids, and a per-group sum over them ([B] -> [B]).

    Padding rows share one sentinel id so they never make a group of valid rows look bigger;
    with at most B distinct ids, size=B keeps the shapes static.
    """
    batch = valid_B.shape[0]
    sentinel = jnp.iinfo(jnp.int32).min
    ids_B = jnp.where(valid_B, jnp.asarray(group_ids_B, jnp.int32), sentinel)
    _, seg_B = jnp.unique(ids_B, return_inverse=True, size=batch, fill_value=sentinel)
    seg_B = seg_B.reshape(batch)
    return seg_B, lambda x_B: jax.ops.segment_sum(x_B, seg_B, num_segments=batch)


def group_advantages(
    rewards_B: jax.Array,
    group_ids_B: jax.Array,
    *,
    mode: AdvantageMode = "grpo",
    eps: float = 1e-6,
    ddof: int = 0,
    valid_B: jax.Array | None = None,
    stats_B: jax.Array | None = None,
) -> tuple[jax.Array, AdvantageMetrics]:
    """Group-normalised advantages (GRPO or Dr. GRPO) over arbitrary integer group ids.

    Steps:
      1. Map the group ids to dense segment ids 0..G-1 (`jnp.unique` with a static size B).
      2. Per group: count n_g, mean m_g and std s_g of the rewards of valid rollouts, with
         s_g = sqrt(sum (r - m_g)^2 / max(n_g - ddof, 1)).
      3. A_i = (r_i - m_g) / (s_g + eps) for "grpo", r_i - m_g for "dr_grpo"; 0 for invalid
         rollouts. A group whose rewards are all equal gets A = 0 exactly in both modes.

    Args:
      rewards_B: [B] combined reward per rollout (see `combine_rewards`).
      group_ids_B: [B] int, any values; rollouts with the same id form a group.
      mode: "grpo" (divide by the group std) or "dr_grpo" (do not).
      eps: added to the std before dividing.
      ddof: 0 = population std (default; defined for groups of size 1), 1 = unbiased sample std
        as in torch.std-based implementations.
      valid_B: optional [B] bool; False marks padding rows, which get A = 0 and are left out
        of every statistic.
      stats_B: optional [B] bool, the valid rows that make the group statistics and metrics
        (default: every valid row); the others get the advantage of their reward in their
        group (`tg_jax.rl.hidden_thinking`: an episode's turn rows after its first).

    Returns:
      advantages_B: float32 [B].
      metrics: `AdvantageMetrics`.
    """
    if mode not in ("grpo", "dr_grpo"):
        raise ValueError(f"unknown advantage mode {mode!r}")
    rewards_B = jnp.asarray(rewards_B, jnp.float32)
    (batch,) = rewards_B.shape
    valid_B = jnp.ones((batch,), bool) if valid_B is None else jnp.asarray(valid_B, bool)
    stats_B = valid_B if stats_B is None else jnp.asarray(stats_B, bool) & valid_B
    w_B = stats_B.astype(jnp.float32)

    seg_B, seg_sum = _dense_groups(group_ids_B, valid_B)
    count_G = seg_sum(w_B)
    mean_G = seg_sum(w_B * rewards_B) / jnp.maximum(count_G, 1.0)
    centred_B = (rewards_B - mean_G[seg_B]) * valid_B
    var_G = seg_sum(w_B * centred_B**2) / jnp.maximum(count_G - ddof, 1.0)
    std_G = jnp.sqrt(var_G)
    # Equal rewards make the centred rewards exactly 0 only up to rounding of the mean; test
    # equality on max/min instead, and zero those groups' advantages exactly.
    big = jnp.finfo(jnp.float32).max
    max_G = jax.ops.segment_max(jnp.where(stats_B, rewards_B, -big), seg_B, num_segments=batch)
    min_G = jax.ops.segment_min(jnp.where(stats_B, rewards_B, big), seg_B, num_segments=batch)
    present_G = count_G > 0
    zero_std_G = present_G & (max_G == min_G)

    if mode == "grpo":
        adv_B = centred_B / (std_G[seg_B] + eps)
    else:
        adv_B = centred_B
    adv_B = jnp.where(zero_std_G[seg_B] | ~valid_B, 0.0, adv_B)

    num_valid = jnp.maximum(w_B.sum(), 1.0)
    reward_mean = (w_B * rewards_B).sum() / num_valid
    reward_std = jnp.sqrt((w_B * (rewards_B - reward_mean) ** 2).sum() / num_valid)
    num_groups = present_G.sum()
    metrics = AdvantageMetrics(
        reward_mean=reward_mean,
        reward_std=reward_std,
        num_groups=num_groups,
        frac_zero_std_groups=zero_std_G.sum() / jnp.maximum(num_groups, 1),
    )
    return adv_B, metrics


def turn_advantages(
    pass_BxT: jax.Array,
    mask_BxT: jax.Array,
    group_ids_B: jax.Array,
    *,
    mode: AdvantageMode = "grpo",
    eps: float = 1e-6,
    valid_B: jax.Array | None = None,
) -> jax.Array:
    """Group-normalised per-token advantages of a per-turn 0/1 signal (module docstring).

    Args:
      pass_BxT: 1 where the token's turn broke no requirement, else 0.
      mask_BxT: the tokens that count (produced by the policy); 0 elsewhere in the output.
      group_ids_B: [B] int group ids.
      mode: "grpo" (divide by the group std of the signal over its tokens) or "dr_grpo".
      eps: added to the std before dividing.
      valid_B: optional [B] bool; padding rows get 0 and are left out of the statistics.

    Returns:
      advantages_BxT: float32 [B, T]; 0 off the mask, and in groups whose tokens all share
      one value.
    """
    if mode not in ("grpo", "dr_grpo"):
        raise ValueError(f"unknown advantage mode {mode!r}")
    p_BxT = jnp.asarray(pass_BxT, jnp.float32)
    batch = p_BxT.shape[0]
    valid_B = jnp.ones((batch,), bool) if valid_B is None else jnp.asarray(valid_B, bool)
    m_BxT = jnp.asarray(mask_BxT, jnp.float32) * valid_B[:, None]
    seg_B, seg_sum = _dense_groups(group_ids_B, valid_B)
    count_G = seg_sum(m_BxT.sum(-1))
    ones_G = seg_sum((p_BxT * m_BxT).sum(-1))
    mean_G = ones_G / jnp.maximum(count_G, 1.0)
    centred_BxT = (p_BxT - mean_G[seg_B][:, None]) * m_BxT
    # Both values present in the group's tokens, counted exactly (0 < ones < count).
    varies_G = (ones_G > 0) & (ones_G < count_G)
    if mode == "grpo":
        std_G = jnp.sqrt(mean_G * (1.0 - mean_G))
        centred_BxT = centred_BxT / (std_G[seg_B][:, None] + eps)
    return jnp.where(varies_G[seg_B][:, None], centred_BxT, 0.0)


def compute_advantages(
    rewards: Mapping[str, jax.Array],
    weights: Mapping[str, float],
    group_ids_B: jax.Array,
    *,
    mode: AdvantageMode = "grpo",
    eps: float = 1e-6,
    ddof: int = 0,
    valid_B: jax.Array | None = None,
    reward_norm: RewardNorm = "combined",
    stats_B: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, AdvantageMetrics]:
    """`combine_rewards` then `group_advantages` (of the sum, or of each component).

    Args:
      rewards: name -> reward component [B].
      weights: name -> weight.
      group_ids_B: [B] int group ids.
      mode, eps, ddof, valid_B, stats_B: as in `group_advantages`.
      reward_norm: "combined" = the advantage of the weighted sum; "per_reward" = the
        weighted sum of each component's own group advantage (see the module docstring).
        The two agree for a single component and for "dr_grpo".

    Returns:
      advantages_B: float32 [B].
      rewards_B: float32 [B], the combined reward.
      metrics: `AdvantageMetrics` of the combined reward (a group counts as zero-std when
        its combined reward is constant).
    """
    if reward_norm not in REWARD_NORMS:
        raise ValueError(f"unknown reward_norm {reward_norm!r}; known: {REWARD_NORMS}")
    weights = present_weights(rewards, weights)
    rewards_B = combine_rewards(rewards, weights)
    kw = dict(mode=mode, eps=eps, ddof=ddof, valid_B=valid_B, stats_B=stats_B)
    adv_B, metrics = group_advantages(rewards_B, group_ids_B, **kw)
    if reward_norm == "per_reward":
        adv_B = None
        for name in sorted(weights):  # fixed order, as in combine_rewards
            comp_B = jnp.asarray(rewards[name], jnp.float32)
            term_B = weights[name] * group_advantages(comp_B, group_ids_B, **kw)[0]
            adv_B = term_B if adv_B is None else adv_B + term_B
    return adv_B, rewards_B, metrics
