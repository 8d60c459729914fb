"""Targeted guidance's term of the loss: lambda_tg * sum_{t in M} D_t / N.

A turn that breaks requirement r is a *failed turn*. The *teacher* is the same weights run on
the context with the hint h_r inserted right before that turn, under stop-gradient; the
*student* is the policy on the original context. M is the tokens distilled (the answer tokens
of failed turns by default; `tg_jax.rl.tg.mask`, built once per batch on the host and carried
as `Batch.tg_mask_BxT`); D_t the divergence of the two next-token distributions at t
(`tg_jax.rl.tg.divergence`). Then

    L_TG = lambda_tg * sum_{t in M} D_t / (trajectories x tg.norm_length)   (tg.normalize token_sum)
    L = L_GRPO + L_TG  (+ optional reference KL: `tg_jax.rl.loss.loss_fn`)

 - `lambda_tg`: the weight at a step, tg.lambda_tg shaped by tg.schedule;
 - `tg_loss`: sums D over M and divides by a fixed constant (token_sum: trajectories x
   tg.norm_length) or averages it over M (token_mean), times the weight; it is exactly 0 when
   M is empty, so a batch without failed turns is plain GRPO;
 - `tg_term`: that loss as one (micro-)batch's share of the whole batch's.

The recipe (kind, normalize, lambda_tg) is TGConfig's (tg_jax.rl.step_config; its defaults are
the shipped one).
"""

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from tg_jax.rl.core import Batch, Normalizers, fraction
from tg_jax.rl.step_config import TGConfig

Normalize = Literal["token_mean", "token_sum"]


def lambda_tg(step: int | jax.Array, tg_cfg: TGConfig) -> jax.Array:
    """lambda_tg at a training step: tg.lambda_tg on tg.schedule; pure jnp, so `step` may be
    traced.

    Schedule kinds (`LambdaSchedule`):
      constant: tg.lambda_tg at every step.
      linear_warmup: ramps 0 -> tg.lambda_tg over steps [0, warmup_steps], then stays (step 0
        gives 0 when there is a ramp; warmup_steps 0 = no ramp).
      cosine: the same ramp, then decays from tg.lambda_tg to final_value over decay_steps and
        stays at final_value afterwards.

    Returns:
      Scalar float32.
    """
    value, schedule = tg_cfg.lambda_tg, tg_cfg.schedule
    step = jnp.asarray(step, jnp.float32)
    if schedule.kind == "constant":
        return jnp.asarray(value, jnp.float32)
    warmup = schedule.warmup_steps
    ramp = jnp.clip(step / warmup, 0.0, 1.0) if warmup > 0 else jnp.asarray(1.0, jnp.float32)
    if schedule.kind == "linear_warmup":
        return value * ramp
    if schedule.kind == "cosine":
        final = schedule.final_value
        progress = jnp.clip((step - warmup) / schedule.decay_steps, 0.0, 1.0)
        cosine = final + (value - final) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(step < warmup, value * ramp, cosine)
    raise ValueError(f"unknown lambda schedule kind {schedule.kind!r}")


class TGMetrics(NamedTuple):
    """Diagnostics of the TG loss.

    Attributes:
      loss: lambda_tg * sum_{t in M} D_t / N (scalar; N: see `tg_loss`).
      divergence_mean: mean D over distilled tokens, 0 if none (scalar).
      distilled_fraction: |M| / |assistant tokens| (scalar).
      num_distilled: |M| (scalar).
      per_requirement_divergence: [R] mean D over distilled tokens of each requirement.
      per_requirement_tokens: [R] number of distilled tokens of each requirement.
    """

    loss: jax.Array
    divergence_mean: jax.Array
    distilled_fraction: jax.Array
    num_distilled: jax.Array
    per_requirement_divergence: jax.Array
    per_requirement_tokens: jax.Array


def tg_loss(
    divergence_BxT: jax.Array,
    mask_BxT: jax.Array,
    weight: float | jax.Array,
    *,
    assistant_mask_BxT: jax.Array | None = None,
    requirement_ids_BxT: jax.Array | None = None,
    num_requirements: int = 0,
    normalize: Normalize,
    norm_constant: float | jax.Array = 1.0,
) -> tuple[jax.Array, TGMetrics]:
    """L_TG = lambda_tg * sum_{t in M} D_t / N; exactly 0.0 when M is empty.

    N = max(|M|, 1) with normalize="token_mean" (every distilled token weighs 1/|M|, so the
    fewer failed turns a batch has, the more each of their tokens weighs), N = norm_constant
    with "token_sum" (a token's weight does not depend on how many others are distilled).

    Args:
      divergence_BxT: [B, T] D_t (from `chunked_token_stats`).
      mask_BxT: [B, T] M (`Batch.tg_mask_BxT`, from `tg_jax.rl.tg.mask.tg_mask`).
      weight: lambda_tg (a float or a traced scalar from `lambda_tg`).
      assistant_mask_BxT: [B, T] assistant tokens, the denominator of `distilled_fraction`
        (default: every position).
      requirement_ids_BxT: [B, T] int, the requirement whose hint the teacher saw at each
        token, -1 for none; ids >= num_requirements are ignored.
      num_requirements: R, static.
      normalize: "token_mean" or "token_sum" (static).
      norm_constant: N of "token_sum" (> 0), e.g. trajectories x tg.norm_length.

    Returns:
      loss: scalar float32.
      metrics: `TGMetrics` (divergence_mean is the mean over M in both modes).
    """
    if normalize not in ("token_mean", "token_sum"):
        raise ValueError(f"unknown normalize {normalize!r}")
    mask_BxT = mask_BxT.astype(bool)
    # where, not multiply: garbage (inf/NaN) at unmasked positions must not reach the sum.
    d_BxT = jnp.where(mask_BxT, divergence_BxT.astype(jnp.float32), 0.0)
    num_distilled = mask_BxT.sum()
    divergence_mean = d_BxT.sum() / jnp.maximum(num_distilled, 1).astype(jnp.float32)
    if normalize == "token_mean":
        loss = jnp.asarray(weight, jnp.float32) * divergence_mean
    else:
        loss = jnp.asarray(weight, jnp.float32) * d_BxT.sum() / norm_constant

    if assistant_mask_BxT is None:
        num_assistant = jnp.asarray(mask_BxT.size, jnp.float32)
    else:
        num_assistant = jnp.maximum(assistant_mask_BxT.astype(bool).sum(), 1).astype(jnp.float32)
    if requirement_ids_BxT is None or num_requirements == 0:
        per_req_sum_R = per_req_count_R = jnp.zeros((num_requirements,), jnp.float32)
    else:
        # one_hot maps -1 (and out-of-range ids) to an all-zero row.
        onehot_BxTxR = jax.nn.one_hot(requirement_ids_BxT, num_requirements, dtype=jnp.float32)
        onehot_BxTxR = onehot_BxTxR * mask_BxT[..., None].astype(jnp.float32)
        per_req_sum_R = jax.lax.stop_gradient(jnp.einsum("bt,btr->r", d_BxT, onehot_BxTxR))
        per_req_count_R = onehot_BxTxR.sum(axis=(0, 1))
    metrics = TGMetrics(
        loss=loss,
        divergence_mean=jax.lax.stop_gradient(divergence_mean),
        distilled_fraction=num_distilled.astype(jnp.float32) / num_assistant,
        num_distilled=num_distilled,
        per_requirement_divergence=per_req_sum_R / jnp.maximum(per_req_count_R, 1.0),
        per_requirement_tokens=per_req_count_R,
    )
    return loss, metrics


class TGTerm(NamedTuple):
    """The TG term's share and its metric shares (scalars; R = requirements)."""

    loss: jax.Array  # weight * sum_{t in M} D_t / N
    kl: jax.Array  # sum_{t in M} D_t / |M|
    kl_R: jax.Array  # the same per requirement (over that requirement's |M|)


def tg_term(
    divergence_BxT: jax.Array | None,
    batch: Batch,
    weight: jax.Array,
    tg_cfg: TGConfig,
    norms: Normalizers,
) -> TGTerm:
    """weight * sum_{t in M} D_t / N, this batch's share of it; zeros for the GRPO arm and for
    a method that distils nothing (`TGConfig.distils`). weight: `lambda_tg` at the step for TG
    (the peers' methods bring their own, `tg_jax.rl.loss.distill_weight`).

    N = |M| (tg.normalize token_mean) or the whole batch's trajectories x tg.norm_length
    (token_sum: a micro-batch's sum over that N is already its share)."""
    num_req = len(batch.requirement_names)
    if not tg_cfg.enabled or not tg_cfg.distils:
        zero = jnp.zeros((), jnp.float32)
        return TGTerm(loss=zero, kl=zero, kl_R=jnp.zeros((num_req,), jnp.float32))
    local, tm = tg_loss(
        divergence_BxT,
        batch.tg_mask_BxT,
        weight,
        assistant_mask_BxT=batch.loss_mask_BxT.astype(bool),
        requirement_ids_BxT=batch.requirement_ids_BxT,
        num_requirements=num_req,
        normalize=tg_cfg.normalize,
        norm_constant=jnp.maximum(norms.num_episodes, 1.0) * tg_cfg.norm_length,
    )
    share = fraction(tm.num_distilled, norms.num_distilled)
    req_share_R = tm.per_requirement_tokens / jnp.maximum(norms.req_tokens_R, 1.0)
    return TGTerm(
        loss=local * (1.0 if tg_cfg.normalize == "token_sum" else share),
        kl=tm.divergence_mean * share,
        kl_R=tm.per_requirement_divergence * req_share_R,
    )
