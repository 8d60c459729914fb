"""The loss of one (micro-)batch: the door of every method (GRPO, TG and the peers' methods).

`loss_fn(params, batch)` reads top to bottom (the train step sums the micro-batches' shares,
`tg_jax.rl.train_step`):

    L = L_GRPO(A) + w * sum_{t in M} D_t / N  (+ kl_coef * KL to the reference)

 a. the advantages A and the whole-batch counts (`batch_advantages`, `core.normalizers`);
 b. `token_stats`: the student forward to final hidden states [B, T, D]; when TG is on, the
    teacher forward on the hinted teacher rows with the SAME params under stop_gradient
    (compact rows reuse the student's prefix keys and values, `tg_jax.rl.tg.teacher`; with
    tg.teacher_params "reference", the frozen reference params on full rows), then the
    chunked pass: the student's log-prob of each target, its entropy and the divergence D_t
    to the teacher (`tg_jax.rl.tg.divergence`; never the whole [B, T, V] of either model);
 c. `policy_term`: L_GRPO, the clipped surrogate on the assistant tokens (`ppo_loss`);
 d. `tg_term` (`tg_jax.rl.tg.loss`): w * sum_{t in M} D_t / N over M, the batch's
    `tg_mask_BxT` (built once on the host, `tg_jax.rl.tg.mask`), w = `distill_weight(step)`:
    lambda_tg (tg.lambda_tg on tg.schedule) for TG;
 e. `reference_term`, and the sum (`policy_and_distill`).
The methods are siblings over this core: tg.method picks D_t (`teacher_term_options`), w
(`distill_weight`) and how the terms combine: sdpo blends (1 - w) L_GRPO + w L_distill, sgcd
reweights the advantages (`peer_advantages`) and distils nothing (`TGConfig.distils`); opsd is
tg with the all-turns gate (`tg_jax.rl.peers`).
Every mean is divided by whole-batch counts (`Normalizers`), so micro-batch shares add up to
the big batch's loss for every aggregation mode.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tg_jax.models import hidden_states, unembed
from tg_jax.rl import peers
from tg_jax.rl.advantages import AdvantageMetrics, compute_advantages, turn_advantages
from tg_jax.rl.core import Batch, Normalizers, Shares, normalizers, shares
from tg_jax.rl.policy_loss import PolicyLossMetrics, ppo_loss, reference_kl
from tg_jax.rl.step_config import RLConfig, TGConfig
from tg_jax.rl.tg.divergence import TokenStats, chunked_token_stats, divergence_options
from tg_jax.rl.tg.loss import TGTerm, lambda_tg, tg_term
from tg_jax.rl.tg.teacher import (
    divergence_at_slots,
    gather_teacher,
    slot_divergence,
    student_forward,
    teacher_rows_hidden,
)

Metrics = dict[str, jax.Array]


def unembed_fn(model: nn.Module, params: Any, temperature: float) -> Callable:
    """h [B, C, D] -> logits [B, C, V] / temperature (the sampler's distribution)."""

    def fn(h_BxCxD: jax.Array) -> jax.Array:
        logits_BxCxV = unembed(model, params, h_BxCxD)
        return logits_BxCxV if temperature == 1.0 else logits_BxCxV / temperature

    return fn


def teacher_term_options(tg_cfg: TGConfig) -> dict[str, Any]:
    """kind, beta, estimator (a name or a per-token callable) and top_k of the teacher term D_t
    that `chunked_token_stats` computes: TG's (tg and opsd) or a peer's (`tg_jax.rl.peers`)."""
    if tg_cfg.method in peers.METHODS:
        return peers.divergence_options(tg_cfg)
    return divergence_options(tg_cfg)


def distill_weight(step: int | jax.Array, tg_cfg: TGConfig) -> jax.Array:
    """The weight of the distillation term at `step`: lambda_tg (tg.lambda_tg on tg.schedule)
    for tg, opsd and sdar; sdpo's w (tg.peer_weight); 0 for sgcd (no distillation term)."""
    if tg_cfg.method == "sdpo":
        return jnp.asarray(tg_cfg.peer_weight, jnp.float32)
    if not tg_cfg.distils:
        return jnp.zeros((), jnp.float32)
    return lambda_tg(step, tg_cfg)


def token_stats(
    params: Any,
    batch: Batch,
    *,
    model: nn.Module,
    rl_cfg: RLConfig,
    tg_cfg: TGConfig,
    teacher_hidden_BxTxD: jax.Array | None = None,
    teacher_params: Any = None,
) -> tuple[TokenStats, jax.Array]:
    """Student forward (+ the teacher's when TG is on) -> log-probs, entropy, D per token, and
    the MoE router load-balancing loss (0 unless the model sets router_aux_loss_coef).

    The teacher is the same params under stop_gradient on the hinted teacher tokens
    (`tg_jax.rl.tg.teacher`: compact rows continue the student's prefix keys and values),
    gathered to student positions (`gather_teacher`; compact rows with few slots: D computed at
    the teacher rows' slots instead, `slot_divergence`); `teacher_hidden_BxTxD` replaces it.
    `teacher_params` (e.g. the frozen reference, tg.teacher_params "reference") run the
    teacher forward and its unembedding instead; they need full teacher rows.
    """
    run_teacher = tg_cfg.enabled and teacher_hidden_BxTxD is None
    if teacher_params is not None and batch.teacher_compact:
        raise ValueError(
            "teacher params other than the policy's need full teacher rows: compact rows "
            "continue the student's (the policy's) prefix keys and values; build the batch "
            "with compact=tg.compact_rows (False for tg.teacher_params='reference')"
        )
    teacher_unembed_fn, teacher_batch = None, batch
    if teacher_params is None:
        teacher_params = params
    else:  # other weights than the rollouts' route by their own routers (no replay)
        teacher_unembed_fn = unembed_fn(model, teacher_params, rl_cfg.temperature)
        teacher_batch = batch.replace(teacher_routes_BtxTtxLxJ=None)
    cfg = model.config
    with_router = bool(cfg.is_moe and cfg.router_aux_loss_coef > 0)
    hidden_BxTxD, prefix, router = student_forward(
        model,
        params,
        batch,
        keep_prefix=run_teacher and batch.teacher_compact,
        router_loss=with_router,
    )
    if run_teacher:
        # The teacher forward sees stop-gradiented params (and prefix): no backward pass.
        teacher_BtxTtxD = teacher_rows_hidden(model, teacher_params, teacher_batch, prefix)
        if not divergence_at_slots(batch):  # else D at the teacher's slots only, below
            teacher_hidden_BxTxD = gather_teacher(teacher_BtxTtxD, batch)
    stats = chunked_token_stats(
        hidden_BxTxD,
        batch.targets_BxT,
        unembed_fn(model, params, rl_cfg.temperature),
        teacher_hidden_BxTxD=teacher_hidden_BxTxD if tg_cfg.enabled else None,
        teacher_unembed_fn=teacher_unembed_fn,
        chunk_size=tg_cfg.chunk_size,
        **teacher_term_options(tg_cfg),
    )
    if run_teacher and divergence_at_slots(batch):
        stats = stats._replace(
            divergence_BxT=slot_divergence(
                hidden_BxTxD,
                teacher_BtxTtxD,
                batch,
                unembed_fn(model, params, rl_cfg.temperature),
                batch.tg_mask_BxT,
                chunk_size=tg_cfg.chunk_size,
                **teacher_term_options(tg_cfg),
            )
        )
    return stats, router if router is not None else jnp.zeros((), jnp.float32)


def policy_term(
    logprob_BxT: jax.Array,
    batch: Batch,
    advantages_B: jax.Array,
    rl_cfg: RLConfig,
    share: Shares,
    logp_proximal_BxT: jax.Array | None = None,
) -> tuple[jax.Array, PolicyLossMetrics]:
    """L_GRPO(A): this batch's share of the clipped surrogate over the assistant tokens.

    The proximal policy is the trainer's at the start of the update phase. With one update
    per batch its log-probs are the current ones without gradient (used for TIS when
    rl.tis_cap is set; otherwise the ratio is taken to the behaviour policy, plain PPO).
    Decoupled updates pass `logp_proximal_BxT` [B, T]: the ratio is current / proximal and
    the weight pi_prox / pi_b (capped at rl.tis_cap, uncapped without it) scales the loss.
    """
    tis_cap = rl_cfg.tis_cap
    if logp_proximal_BxT is not None:
        tis_cap = tis_cap or math.inf
    elif tis_cap:
        logp_proximal_BxT = jax.lax.stop_gradient(logprob_BxT)
    pg_loss, pm = ppo_loss(
        logprob_BxT,
        batch.behaviour_logprobs_BxT,
        advantages_B,
        batch.loss_mask_BxT.astype(bool),
        logp_proximal_BxT=logp_proximal_BxT,
        clip_low=rl_cfg.clip_low,
        clip_high=rl_cfg.clip_high,
        dual_clip=rl_cfg.dual_clip,
        tis_cap=tis_cap,
        agg_mode=rl_cfg.agg_mode,
        norm_length=rl_cfg.norm_length,
    )
    return pg_loss * share.agg, pm


def reference_term(
    logprob_BxT: jax.Array,
    batch: Batch,
    *,
    model: nn.Module,
    ref_params: Any,
    rl_cfg: RLConfig,
    tg_cfg: TGConfig,
    share: Shares,
) -> tuple[jax.Array, jax.Array]:
    """(kl_coef * KL(pi_theta || pi_ref), KL) shares; zeros without a reference (kl_coef 0)."""
    if rl_cfg.kl_coef == 0:
        zero = jnp.zeros((), jnp.float32)
        return zero, zero
    if ref_params is None:
        raise ValueError("rl.kl_coef > 0 needs ref_params")
    ref_params = jax.lax.stop_gradient(ref_params)
    ref_hidden_BxTxD = hidden_states(
        model, ref_params, batch.tokens_BxT, batch.positions_BxT, batch.segment_ids_BxT
    )
    ref_stats = chunked_token_stats(
        jax.lax.stop_gradient(ref_hidden_BxTxD),
        batch.targets_BxT,
        unembed_fn(model, ref_params, rl_cfg.temperature),
        chunk_size=tg_cfg.chunk_size,
    )
    kl = reference_kl(
        logprob_BxT,
        jax.lax.stop_gradient(ref_stats.logprob_BxT),
        batch.loss_mask_BxT.astype(bool),
        rl_cfg.agg_mode,
        norm_length=rl_cfg.norm_length,
        estimator=rl_cfg.kl_estimator,
    )
    return rl_cfg.kl_coef * kl * share.agg, kl * share.agg


def loss_metrics(
    loss: jax.Array,
    policy: jax.Array,
    pm: PolicyLossMetrics,
    tg: TGTerm,
    ref_kl: jax.Array,
    stats: TokenStats,
    batch: Batch,
    norms: Normalizers,
    share: Shares,
) -> tuple[Metrics, Metrics]:
    """(sums, maxes): metric shares to sum over micro-batches, and metrics to max over them."""
    loss_mask_BxT = batch.loss_mask_BxT.astype(bool)
    logprob_sg_BxT = jax.lax.stop_gradient(stats.logprob_BxT)
    mismatch_BxT = jnp.where(
        loss_mask_BxT, jnp.abs(batch.behaviour_logprobs_BxT - logprob_sg_BxT), 0.0
    )
    entropy_BxT = jnp.where(loss_mask_BxT, jax.lax.stop_gradient(stats.entropy_BxT), 0.0)
    num_tokens = jnp.maximum(norms.num_tokens, 1.0)
    sums = {
        "loss": loss,
        "pg_loss": policy,
        "ref_kl": ref_kl,
        "tg_loss": tg.loss,
        "tg_kl": tg.kl,
        "clip_frac_low": pm.clip_frac_low * share.tokens,
        "clip_frac_high": pm.clip_frac_high * share.tokens,
        "dual_clip_frac": pm.dual_clip_frac * share.tokens,
        "ratio_mean": pm.ratio_mean * share.tokens,
        "ratio_abs_dev": pm.ratio_abs_dev * share.tokens,
        "approx_kl": pm.approx_kl * share.tokens,
        "tis_weight_mean": pm.tis_weight_mean * share.tokens,
        "entropy": entropy_BxT.sum() / num_tokens,
        "logprob_mismatch_mean": mismatch_BxT.sum() / num_tokens,
    }
    for r, name in enumerate(batch.requirement_names):
        sums[f"tg_kl/{name}"] = tg.kl_R[r]
    maxes = {"ratio_max": pm.ratio_max, "logprob_mismatch_max": mismatch_BxT.max()}
    sums = {k: jax.lax.stop_gradient(v) for k, v in sums.items()}
    maxes = {k: jax.lax.stop_gradient(v) for k, v in maxes.items()}
    return sums, maxes


def loss_fn(
    params: Any,
    batch: Batch,
    *,
    model: nn.Module,
    rl_cfg: RLConfig,
    tg_cfg: TGConfig,
    step: int | jax.Array = 0,
    ref_params: Any = None,
    advantages_B: jax.Array | None = None,
    norms: Normalizers | None = None,
    teacher_hidden_BxTxD: jax.Array | None = None,
    logp_proximal_BxT: jax.Array | None = None,
) -> tuple[jax.Array, tuple[Metrics, Metrics]]:
    """L = L_GRPO(A) + w * sum_{t in M} D_t / N (+ kl_coef * KL to the reference).

    The loss and the summed metrics are this batch's *share* of the whole-batch values: each
    mean is divided by the whole-batch count in `norms`, so summing over micro-batches gives
    the big-batch value (with norms=None the batch is the whole batch).

    Args:
      params: model params (differentiated).
      batch: a `Batch` (or one micro-batch of it).
      model: the Transformer.
      rl_cfg: the typed `rl` section.
      tg_cfg: the typed `tg` section.
      step: train step, for the weight of the distillation term (`distill_weight`).
      ref_params: frozen reference params; used when rl_cfg.kl_coef > 0, and as the teacher
        with tg.teacher_params "reference".
      advantages_B: [B] precomputed advantages (whole-batch groups); default: from the batch.
      norms: whole-batch `Normalizers`; default: this batch's.
      teacher_hidden_BxTxD: teacher hidden states already gathered to student positions (e.g.
        constants in a test); default: the teacher forward on the batch's teacher tokens.
      logp_proximal_BxT: [B, T] log-probs of the params at the start of a decoupled update
        phase (`policy_term`); default: one update per batch.

    Returns:
      loss: scalar float32.
      (sums, maxes): metric shares to sum over micro-batches, and metrics to max over them.
    """
    if advantages_B is None:
        advantages_B, _, _ = batch_advantages(batch, rl_cfg)
    if norms is None:
        norms = normalizers(batch, tg_cfg)
    share = shares(batch, norms, rl_cfg)
    stats, router = token_stats(
        params,
        batch,
        model=model,
        rl_cfg=rl_cfg,
        tg_cfg=tg_cfg,
        teacher_hidden_BxTxD=teacher_hidden_BxTxD,
        teacher_params=reference_teacher_params(tg_cfg, ref_params),
    )

    advantages_B, peer_metrics = peer_advantages(advantages_B, stats, batch, tg_cfg, norms)
    policy, pm = policy_term(
        stats.logprob_BxT, batch, advantages_B, rl_cfg, share, logp_proximal_BxT
    )
    tg = tg_term(stats.divergence_BxT, batch, distill_weight(step, tg_cfg), tg_cfg, norms)
    reference, ref_kl = reference_term(
        stats.logprob_BxT,
        batch,
        model=model,
        ref_params=ref_params,
        rl_cfg=rl_cfg,
        tg_cfg=tg_cfg,
        share=share,
    )
    # The router loss is a mean over this batch's tokens: weighted like the other token means.
    router = router * share.tokens
    loss = policy_and_distill(policy, tg, tg_cfg) + reference + router

    sums, maxes = loss_metrics(loss, policy, pm, tg, ref_kl, stats, batch, norms, share)
    sums = {**sums, "router_aux_loss": jax.lax.stop_gradient(router), **peer_metrics}
    return loss, (sums, maxes)


def reference_teacher_params(tg_cfg: TGConfig, ref_params: Any) -> Any:
    """The teacher's own params: the frozen reference with tg.teacher_params "reference", else
    None (the teacher is the policy itself, under stop_gradient)."""
    if not tg_cfg.reference_teacher:
        return None
    if ref_params is None:
        raise ValueError("tg.teacher_params='reference' needs ref_params")
    return ref_params


def peer_advantages(
    advantages: jax.Array, stats: TokenStats, batch: Batch, tg_cfg: TGConfig, norms: Normalizers
) -> tuple[jax.Array, Metrics]:
    """tg.method "sgcd": the advantages times the per-token teacher weights (`peers.sgcd`),
    [B, T], and the metric shares sgcd_weight_mean / sgcd_score_mean (over assistant tokens);
    any other method: the advantages as they are and no metrics."""
    if not (tg_cfg.enabled and tg_cfg.method == "sgcd"):
        return advantages, {}
    score_BxT = peers.sgcd.score(stats.divergence_BxT, batch.tg_mask_BxT)
    weight_BxT = peers.sgcd.advantage_weight(
        score_BxT, advantages, tg_cfg.sgcd_alpha, tg_cfg.sgcd_clip
    )
    mask_BxT = batch.loss_mask_BxT.astype(jnp.float32)
    num_tokens = jnp.maximum(norms.num_tokens, 1.0)
    metrics = {
        "sgcd_weight_mean": (jnp.where(mask_BxT > 0, weight_BxT, 0.0)).sum() / num_tokens,
        "sgcd_score_mean": (score_BxT * mask_BxT).sum() / num_tokens,
    }
    return peers.sgcd.reweight(advantages, weight_BxT), jax.lax.stop_gradient(metrics)


def policy_and_distill(policy: jax.Array, tg: TGTerm, tg_cfg: TGConfig) -> jax.Array:
    """L_GRPO + the distillation term (`TGTerm.loss`, weighted by `distill_weight`);
    tg.method "sdpo": (1 - w) L_GRPO + w L_distill (`peers.sdpo.blend`)."""
    if tg_cfg.enabled and tg_cfg.method == "sdpo":
        return peers.sdpo.blend(policy, tg.loss, tg_cfg.peer_weight)
    return policy + tg.loss


def batch_advantages(
    batch: Batch, rl_cfg: RLConfig
) -> tuple[jax.Array, jax.Array, AdvantageMetrics]:
    """`compute_advantages` on the batch's rewards and groups (padding rows excluded).

    With `rl.requirement_credit` "turn" the requirement rewards (the weights named in
    `batch.requirement_names`) leave the episode reward and come back per turn
    (`turn_advantages` on `failed_turn_mask_BxT`, weighted by their summed weights): the
    advantages are then [B, T]. The combined reward and its metrics stay the episode's, every
    weight included.
    """
    weights = dict(rl_cfg.reward_weights)
    kw = dict(mode=rl_cfg.advantage_mode, eps=rl_cfg.adv_eps, valid_B=batch.valid_B)
    adv_B, rewards_B, metrics = compute_advantages(
        dict(batch.rewards),
        weights,
        batch.group_ids_B,
        reward_norm=rl_cfg.reward_norm,
        stats_B=batch.head_B,
        **kw,
    )
    if rl_cfg.requirement_credit == "episode":
        return adv_B, rewards_B, metrics
    req, episode = rl_cfg.credit_split(batch.requirement_names)
    adv_B, _, _ = compute_advantages(
        dict(batch.rewards),
        episode,
        batch.group_ids_B,
        reward_norm=rl_cfg.reward_norm,
        stats_B=batch.head_B,
        **kw,
    )
    mask_BxT = batch.loss_mask_BxT
    unmet = batch.unmet_turn_mask_BxT  # failed or rejected (met on a refused turn earns nothing)
    unmet = batch.failed_turn_mask_BxT if unmet is None else unmet
    turn_BxT = turn_advantages(~unmet, mask_BxT, batch.group_ids_B, **kw)
    w_req = sum(weights[k] for k in req)
    return adv_B[:, None] * mask_BxT + w_req * turn_BxT, rewards_B, metrics
