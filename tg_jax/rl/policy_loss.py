"""PPO clipped surrogate for GRPO, with dual clip, truncated importance sampling and a reference KL.

Three policies appear in an asynchronous run, each as per-token log-probs of the sampled tokens:

    behaviour  pi_b    the sampler's policy version that produced the rollout (recorded by the
                       sampler, possibly several versions stale);
    proximal   pi_prox optional: the trainer's policy at the start of the update phase (several
                       optimizer updates with `rl.num_updates` / `rl.num_minibatches`),
                       recomputed on the trainer (the "old" policy of decoupled PPO); without it
                       pi_prox = pi_b;
    current    pi_theta the policy being differentiated.

Per token t of a rollout with advantage A (masked to assistant tokens by `mask_BxT`):

 1. r_t = exp(logp_theta - logp_prox), the PPO ratio; with no proximal log-probs this is
    exp(logp_theta - logp_behaviour).
 2. Clipped surrogate: l_t = max(-A r_t, -A clip(r_t, 1 - clip_low, 1 + clip_high)).
    Tokens with A > 0 and r_t > 1 + clip_high, or A < 0 and r_t < 1 - clip_low, take the
    constant branch and get no gradient.
 3. Dual clip (c > 1): for A < 0, l_t = min(l_t, -A c), so a token whose ratio has grown far
    past 1 while its advantage is negative contributes at most c |A| and no gradient.
 4. Truncated importance sampling (TIS): l_t *= sg(min(pi_prox / pi_b, tis_cap)). This corrects
    for the gap between the sampler and the trainer's proximal policy (staleness, or numerics
    of a different inference stack); the cap bounds the variance. It needs proximal log-probs:
    without them the PPO ratio already is the ratio to the behaviour policy.
 5. Aggregate l_t over masked tokens (`aggregate`), add kl_coef * aggregate(KL_t to a frozen
    reference policy) when reference log-probs are given.
"""

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

AggMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3"]

# |log ratio| is clamped here before exp: a garbage log-prob (e.g. at a token the sampler
# masked) must not overflow to inf and turn the whole loss into NaN. exp(20) ~ 5e8 is far past
# any clip range, so real tokens are unaffected.
_MAX_LOG_RATIO = 20.0


class PolicyLossMetrics(NamedTuple):
    """Scalar diagnostics of the policy loss; fractions are over masked (assistant) tokens.

    Attributes:
      pg_loss: the aggregated clipped surrogate (without the KL term).
      kl_loss: the aggregated reference-KL estimate (0 when no reference is given).
      clip_frac_low: fraction with A < 0 and r < 1 - clip_low (lower clip active).
      clip_frac_high: fraction with A > 0 and r > 1 + clip_high (upper clip active).
      dual_clip_frac: fraction with A < 0 where the dual clip bound -A c is taken.
      ratio_mean: mean of r = pi_theta / pi_prox.
      ratio_max: max of r (0 when the mask is empty).
      ratio_abs_dev: mean of |r - 1|.
      approx_kl: mean of (r - 1) - log r, the k3 estimate of KL(pi_prox || pi_theta).
      tis_weight_mean: mean TIS weight (1 when TIS is off).
    """

    pg_loss: jax.Array
    kl_loss: jax.Array
    clip_frac_low: jax.Array
    clip_frac_high: jax.Array
    dual_clip_frac: jax.Array
    ratio_mean: jax.Array
    ratio_max: jax.Array
    ratio_abs_dev: jax.Array
    approx_kl: jax.Array
    tis_weight_mean: jax.Array


def masked_mean(x_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """Mean of x over mask; 0 for an empty mask.

    Args:
      x_BxT: [B, T] values.
      mask_BxT: [B, T] bool or {0, 1}.

    Returns:
      Scalar float32.
    """
    mask_BxT = mask_BxT.astype(bool)
    total = jnp.where(mask_BxT, x_BxT, 0.0).astype(jnp.float32).sum()
    return total / jnp.maximum(mask_BxT.sum(), 1).astype(jnp.float32)


def aggregate(
    loss_BxT: jax.Array,
    mask_BxT: jax.Array,
    mode: AggMode = "token_mean",
    *,
    norm_length: int | None = None,
) -> jax.Array:
    """Reduces per-token losses to a scalar.

    Modes (N = number of sequences with at least one masked token, so padding rows that a
    static batch size forces in do not dilute the loss):
      token_mean:              sum_{b,t} m l / sum_{b,t} m.
      seq_mean_token_mean:     (1/N) sum_b [ sum_t m l / sum_t m ].
      seq_mean_token_sum_norm: (1/N) sum_b [ sum_t m l / L ], with L = `norm_length`, a constant
        that does not depend on the rollout (Dr. GRPO), so long and short sequences weigh their
        tokens equally. L defaults to T, the padded length of the batch; set it to the maximum
        generation length of the run to make it independent of batch padding.

    Args:
      loss_BxT: [B, T] per-token loss.
      mask_BxT: [B, T] bool or {0, 1}; tokens that count.
      mode: one of the modes above.
      norm_length: L for seq_mean_token_sum_norm; ignored otherwise.

    Returns:
      Scalar float32; exactly 0 when the mask is empty.
    """
    mask_BxT = mask_BxT.astype(bool)
    # where, not multiply: a non-finite value at a masked-out token must not leak into the sum.
    loss_BxT = jnp.where(mask_BxT, loss_BxT.astype(jnp.float32), 0.0)
    if mode == "token_mean":
        return loss_BxT.sum() / jnp.maximum(mask_BxT.sum(), 1).astype(jnp.float32)
    tokens_B = mask_BxT.sum(axis=-1).astype(jnp.float32)
    num_seqs = jnp.maximum((tokens_B > 0).sum(), 1).astype(jnp.float32)
    if mode == "seq_mean_token_mean":
        seq_B = loss_BxT.sum(axis=-1) / jnp.maximum(tokens_B, 1.0)
    elif mode == "seq_mean_token_sum_norm":
        length = loss_BxT.shape[-1] if norm_length is None else norm_length
        seq_B = loss_BxT.sum(axis=-1) / float(length)
    else:
        raise ValueError(f"unknown aggregation mode {mode!r}")
    return seq_B.sum() / num_seqs


def kl_to_reference(
    logp_BxT: jax.Array, logp_ref_BxT: jax.Array, estimator: KLEstimator = "k3"
) -> jax.Array:
    """Per-token estimate of KL(pi_theta || pi_ref) from the sampled tokens' log-probs.

    With log rho = logp_ref - logp (tokens sampled from pi_theta, or close to it):
      k1 = -log rho                  unbiased, can be negative, high variance;
      k2 = (log rho)^2 / 2           biased, >= 0, low variance;
      k3 = (rho - 1) - log rho       unbiased, >= 0, low variance (the GRPO default).
    The reference is frozen: its log-probs get no gradient.

    Args:
      logp_BxT: [B, T] current-policy log-probs of the sampled tokens.
      logp_ref_BxT: [B, T] reference-policy log-probs of the same tokens.
      estimator: "k1", "k2" or "k3".

    Returns:
      kl_BxT: [B, T] float32.
    """
    log_rho_BxT = jax.lax.stop_gradient(logp_ref_BxT).astype(jnp.float32) - logp_BxT.astype(
        jnp.float32
    )
    log_rho_BxT = jnp.clip(log_rho_BxT, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if estimator == "k1":
        return -log_rho_BxT
    if estimator == "k2":
        return 0.5 * log_rho_BxT**2
    if estimator == "k3":
        return jnp.expm1(log_rho_BxT) - log_rho_BxT
    raise ValueError(f"unknown KL estimator {estimator!r}")


def reference_kl(
    logp_BxT: jax.Array,
    logp_ref_BxT: jax.Array,
    mask_BxT: jax.Array,
    agg_mode: AggMode = "token_mean",
    *,
    norm_length: int | None = None,
    estimator: KLEstimator = "k3",
) -> jax.Array:
    """KL(pi_theta || pi_ref) per token (`kl_to_reference`), aggregated over mask like the loss.

    Args:
      logp_BxT: [B, T] current log-probs of the sampled tokens (differentiated).
      logp_ref_BxT: [B, T] frozen reference log-probs of the same tokens.
      mask_BxT: [B, T] bool; the assistant tokens (elsewhere the KL is exactly 0).
      agg_mode: see `aggregate`.
      norm_length: L for "seq_mean_token_sum_norm".
      estimator: "k1", "k2" or "k3".

    Returns:
      Scalar float32.
    """
    mask_BxT = mask_BxT.astype(bool)
    logp_BxT = logp_BxT.astype(jnp.float32)
    ref_BxT = jnp.where(mask_BxT, logp_ref_BxT.astype(jnp.float32), logp_BxT)
    kl_BxT = kl_to_reference(logp_BxT, ref_BxT, estimator)
    return aggregate(kl_BxT, mask_BxT, agg_mode, norm_length=norm_length)


def ppo_loss(
    logp_BxT: jax.Array,
    logp_behaviour_BxT: jax.Array,
    advantages: jax.Array,
    mask_BxT: jax.Array,
    *,
    logp_proximal_BxT: jax.Array | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    tis_cap: float | None = None,
    agg_mode: AggMode = "token_mean",
    norm_length: int | None = None,
    logp_ref_BxT: jax.Array | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
) -> tuple[jax.Array, PolicyLossMetrics]:
    """Clipped-surrogate policy loss (steps 1-5 of the module docstring).

    Args:
      logp_BxT: [B, T] current log-probs of the sampled tokens (differentiated).
      logp_behaviour_BxT: [B, T] sampler log-probs of the same tokens.
      advantages: [B] (one per rollout, broadcast over tokens) or [B, T].
      mask_BxT: [B, T] bool; the assistant tokens the policy produced (prompt, environment and
        tool tokens and padding are 0).
      logp_proximal_BxT: optional [B, T] trainer log-probs at the start of the update.
      clip_low, clip_high: r is clipped to [1 - clip_low, 1 + clip_high] (clip-higher:
        clip_high > clip_low).
      dual_clip: constant c > 1, or None for no dual clip.
      tis_cap: cap of the TIS weight pi_prox / pi_b (math.inf: the uncapped weight of
        decoupled PPO), or None for no TIS.
      agg_mode, norm_length: see `aggregate` (L for "seq_mean_token_sum_norm").
      logp_ref_BxT: optional [B, T] frozen reference log-probs; adds kl_coef * KL with
        estimator kl_estimator ("k1", "k2" or "k3"; `kl_to_reference`).

    Returns:
      (scalar float32 loss, `PolicyLossMetrics`).
    """
    _check_ppo_options(dual_clip, tis_cap, has_proximal=logp_proximal_BxT is not None)
    mask_BxT, adv_BxT, logp_BxT, behaviour_BxT, proximal_BxT = _ppo_inputs(
        mask_BxT, advantages, logp_BxT, logp_behaviour_BxT, logp_proximal_BxT
    )

    # 1. Ratio; masked-out tokens get log r = 0 so garbage there cannot produce inf/NaN.
    log_ratio_BxT = jnp.where(mask_BxT, logp_BxT - proximal_BxT, 0.0)
    log_ratio_BxT = jnp.clip(log_ratio_BxT, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio_BxT = jnp.exp(log_ratio_BxT)

    # 2. Clipped surrogate.
    unclipped_BxT = -adv_BxT * ratio_BxT
    clipped_BxT = -adv_BxT * jnp.clip(ratio_BxT, 1.0 - clip_low, 1.0 + clip_high)
    loss_BxT = jnp.maximum(unclipped_BxT, clipped_BxT)

    # 3. Dual clip, only for negative advantages.
    loss_BxT, dual_active_BxT = _dual_clip(loss_BxT, adv_BxT, mask_BxT, dual_clip)

    # 4. Truncated importance sampling against the behaviour policy.
    tis_w_BxT = _tis_weight(proximal_BxT, behaviour_BxT, mask_BxT, tis_cap)
    loss_BxT = loss_BxT * tis_w_BxT

    # 5. Aggregate, plus the reference KL.
    pg_loss = aggregate(loss_BxT, mask_BxT, agg_mode, norm_length=norm_length)
    if logp_ref_BxT is not None:
        kl_loss = reference_kl(
            logp_BxT,
            logp_ref_BxT,
            mask_BxT,
            agg_mode,
            norm_length=norm_length,
            estimator=kl_estimator,
        )
    else:
        kl_loss = jnp.zeros((), jnp.float32)
    loss = pg_loss + kl_coef * kl_loss

    tokens = _TokenTerms(mask_BxT, adv_BxT, log_ratio_BxT, dual_active_BxT, tis_w_BxT)
    return loss, _ppo_metrics(pg_loss, kl_loss, tokens, clip_low, clip_high)


def _check_ppo_options(dual_clip: float | None, tis_cap: float | None, has_proximal: bool) -> None:
    """Raises ValueError on a dual clip or TIS setting that cannot run."""
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if tis_cap is not None and not has_proximal:
        raise ValueError(
            "tis_cap needs logp_proximal_BxT: without proximal log-probs the PPO ratio is "
            "already taken against the behaviour policy"
        )


def _ppo_inputs(mask_BxT, advantages, logp_BxT, logp_behaviour_BxT, logp_proximal_BxT):
    """(bool mask, [B, T] f32 advantages, f32 log-probs, behaviour and proximal log-probs
    without gradient; proximal = behaviour when not given)."""
    mask_BxT = mask_BxT.astype(bool)
    adv_BxT = jnp.asarray(advantages, jnp.float32)
    adv_BxT = jnp.broadcast_to(adv_BxT[:, None] if adv_BxT.ndim == 1 else adv_BxT, mask_BxT.shape)
    behaviour_BxT = jax.lax.stop_gradient(logp_behaviour_BxT).astype(jnp.float32)
    proximal_BxT = behaviour_BxT
    if logp_proximal_BxT is not None:
        proximal_BxT = jax.lax.stop_gradient(logp_proximal_BxT).astype(jnp.float32)
    return mask_BxT, adv_BxT, logp_BxT.astype(jnp.float32), behaviour_BxT, proximal_BxT


def _dual_clip(loss_BxT, adv_BxT, mask_BxT, dual_clip: float | None):
    """(loss with the dual clip -c A bound on negative-advantage tokens, where it bound)."""
    if dual_clip is None:
        return loss_BxT, jnp.zeros_like(mask_BxT)
    negative_BxT = adv_BxT < 0
    bound_BxT = -adv_BxT * dual_clip
    active_BxT = negative_BxT & (bound_BxT < loss_BxT)
    return jnp.where(negative_BxT, jnp.minimum(loss_BxT, bound_BxT), loss_BxT), active_BxT


def _tis_weight(proximal_BxT, behaviour_BxT, mask_BxT, tis_cap: float | None) -> jax.Array:
    """min(pi_prox / pi_b, cap) per token (ones without TIS)."""
    if tis_cap is None:
        return jnp.ones(mask_BxT.shape, jnp.float32)
    log_w_BxT = jnp.where(mask_BxT, proximal_BxT - behaviour_BxT, 0.0)
    return jnp.minimum(jnp.exp(jnp.minimum(log_w_BxT, _MAX_LOG_RATIO)), tis_cap)


class _TokenTerms(NamedTuple):
    """The per-token [B, T] terms of steps 1-4 that the metrics read."""

    mask_BxT: jax.Array  # bool: the assistant tokens
    adv_BxT: jax.Array
    log_ratio_BxT: jax.Array  # log r, clamped, 0 at masked-out tokens
    dual_active_BxT: jax.Array  # where the dual clip bound was taken
    tis_w_BxT: jax.Array  # the TIS weight (ones without TIS)


def _ppo_metrics(
    pg_loss: jax.Array,
    kl_loss: jax.Array,
    tokens: _TokenTerms,
    clip_low: float,
    clip_high: float,
) -> PolicyLossMetrics:
    """The step's `PolicyLossMetrics` (ratios without gradient)."""
    mask_BxT, adv_BxT, log_ratio_BxT, dual_active_BxT, tis_w_BxT = tokens
    log_ratio_sg_BxT = jax.lax.stop_gradient(log_ratio_BxT)
    ratio_sg_BxT = jnp.exp(log_ratio_sg_BxT)
    return PolicyLossMetrics(
        pg_loss=pg_loss,
        kl_loss=kl_loss,
        clip_frac_low=masked_mean((adv_BxT < 0) & (ratio_sg_BxT < 1.0 - clip_low), mask_BxT),
        clip_frac_high=masked_mean((adv_BxT > 0) & (ratio_sg_BxT > 1.0 + clip_high), mask_BxT),
        dual_clip_frac=masked_mean(dual_active_BxT, mask_BxT),
        ratio_mean=masked_mean(ratio_sg_BxT, mask_BxT),
        ratio_max=jnp.where(mask_BxT, ratio_sg_BxT, 0.0).max(),
        ratio_abs_dev=masked_mean(jnp.abs(ratio_sg_BxT - 1.0), mask_BxT),
        approx_kl=masked_mean(jnp.expm1(log_ratio_sg_BxT) - log_ratio_sg_BxT, mask_BxT),
        tis_weight_mean=masked_mean(tis_w_BxT, mask_BxT),
    )
