"""The loss of one (micro-)batch: GRPO policy loss + targeted-guidance distillation.

`loss_fn(params, batch)`, on one micro-batch (the train step sums the micro-batches' shares,
`tg_jax.rl.train_step`):
 a. student forward to final hidden states [B, T, D];
 b. when TG is on, teacher forward on the hinted teacher tokens with the SAME params under
    stop_gradient (compact teacher rows start at the first hint and reuse the student's keys
    and values for the prefix, `tg_jax.rl.tg.teacher`), gathered to student positions through
    the batch's index map (the GRPO arm skips it entirely); with tg.teacher_params
    "reference", the frozen reference params instead, on full teacher rows;
 c. `chunked_token_stats`: student log-prob of each target, entropy and the divergence to the
    teacher, chunk by chunk along T (never the whole [B, T, V] of either model);
 d. the README equation, one named term each:
    L = L_GRPO(A) + lambda_tg * sum_{t in M} D_t / |M| (+ kl_coef * KL to the reference):
    `policy_term` (`ppo_loss` on the assistant tokens), `tg_term` (`tg_loss` on `tg_mask(...)`
    with lambda_tg from `lambda_schedule(step)`), `reference_term`.
 e. tg.method other than "tg" (the peers' methods, `tg_jax.rl.peers`) changes only the
    teacher term D_t of step c (`peers.divergence_options`), its weight
    (`peers.distill_weight`) and how the terms combine: sdpo blends (1 - w) L_GRPO + w L_distill
    (`policy_and_distill`), sgcd reweights the advantages and has no distillation term
    (`peer_advantages`); opsd is tg with the all-turns gate.
Every mean is divided by whole-batch counts (`Normalizers`), so micro-batch shares add up to
the big batch's loss for every aggregation mode.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from tg_jax.models import hidden_states, unembed
from tg_jax.rl import peers
from tg_jax.rl.advantages import AdvantageMetrics, compute_advantages, turn_advantages
from tg_jax.rl.batch import Batch
from tg_jax.rl.policy_loss import PolicyLossMetrics, ppo_loss, reference_kl
from tg_jax.rl.step_config import RLConfig, TGConfig
from tg_jax.rl.tg.loss import TokenStats, chunked_token_stats, tg_loss, tg_mask
from tg_jax.rl.tg.teacher import (
    divergence_at_slots,
    gather_teacher,
    slot_divergence,
    student_forward,
    teacher_rows_hidden,
)

Metrics = dict[str, jax.Array]


class Normalizers(NamedTuple):
    """Whole-batch counts that micro-batch losses are divided by (scalars, R = requirements)."""

    num_tokens: jax.Array  # assistant tokens (loss mask)
    num_seqs: jax.Array  # rows with at least one assistant token
    num_episodes: jax.Array  # of those, the head rows (Batch.head_B; = num_seqs without)
    num_distilled: jax.Array  # |M|
    req_tokens_R: jax.Array  # |M| per requirement


def teacher_mask(batch: Batch, tg_cfg: TGConfig) -> jax.Array:
    """[B, T]: `tg_mask` of the batch under the config's gate and thinking options, the tokens
    whose teacher term D_t the loss reads (for every tg.method)."""
    return tg_mask(
        batch.distill_mask_BxT,
        batch.thinking_mask_BxT,
        batch.failed_turn_mask_BxT,
        batch.loss_mask_BxT,
        include_thinking=tg_cfg.include_thinking,
        gate=tg_cfg.gate,
    )


def distill_mask(batch: Batch, tg_cfg: TGConfig) -> jax.Array:
    """M [B, T]: the tokens under the distillation term, `teacher_mask`; empty for tg.method
    "sgcd", which distils nothing (its teacher signal reweights the advantages instead)."""
    mask_BxT = teacher_mask(batch, tg_cfg)
    return jnp.zeros_like(mask_BxT) if tg_cfg.method == "sgcd" else mask_BxT


def normalizers(batch: Batch, tg_cfg: TGConfig) -> Normalizers:
    """Counts over the whole batch (before a micro-batch split)."""
    loss_mask_BxT = batch.loss_mask_BxT.astype(bool)
    mask_BxT = distill_mask(batch, tg_cfg)
    num_req = len(batch.requirement_names)
    onehot_BxTxR = jax.nn.one_hot(batch.requirement_ids_BxT, num_req, dtype=jnp.float32)
    req_tokens_R = (onehot_BxTxR * mask_BxT[..., None].astype(jnp.float32)).sum(axis=(0, 1))
    seqs_B = loss_mask_BxT.sum(axis=-1) > 0
    heads_B = seqs_B if batch.head_B is None else seqs_B & batch.head_B.astype(bool)
    return Normalizers(
        num_tokens=loss_mask_BxT.sum().astype(jnp.float32),
        num_seqs=seqs_B.sum().astype(jnp.float32),
        num_episodes=heads_B.sum().astype(jnp.float32),
        num_distilled=mask_BxT.sum().astype(jnp.float32),
        req_tokens_R=req_tokens_R,
    )


def _share(local: jax.Array, total: jax.Array) -> jax.Array:
    """local / total, 0 when total is 0: the weight of a micro-batch's mean in the batch mean."""
    return local.astype(jnp.float32) / jnp.maximum(total, 1.0)


class Shares(NamedTuple):
    """A micro-batch's weight in the whole-batch means (scalars)."""

    agg: jax.Array  # of the policy loss's aggregation (tokens or sequences, by agg_mode)
    tokens: jax.Array  # of token means over assistant tokens


def shares(batch: Batch, norms: Normalizers, rl_cfg: RLConfig) -> Shares:
    """This (micro-)batch's `Shares` of the whole batch counted in `norms`."""
    loss_mask_BxT = batch.loss_mask_BxT.astype(bool)
    n_tok = loss_mask_BxT.sum()
    n_seq = (loss_mask_BxT.sum(axis=-1) > 0).sum()
    tokens = _share(n_tok, norms.num_tokens)
    agg = tokens if rl_cfg.agg_mode == "token_mean" else _share(n_seq, norms.num_seqs)
    return Shares(agg=agg, tokens=tokens)


def _unembed_fn(model: nn.Module, params: Any, temperature: float) -> Callable:
    """h [B, C, D] -> logits [B, C, V] / temperature (the sampler's distribution)."""

    def fn(h_BxCxD: jax.Array) -> jax.Array:
        logits_BxCxV = unembed(model, params, h_BxCxD)
        return logits_BxCxV if temperature == 1.0 else logits_BxCxV / temperature

    return fn


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
        teacher_unembed_fn = _unembed_fn(model, teacher_params, rl_cfg.temperature)
        teacher_batch = batch.replace(teacher_routes_BtxTtxLxJ=None)
    cfg = model.config
    with_router = bool(cfg.is_moe and cfg.router_aux_loss_coef > 0)
    hidden_BxTxD, prefix, router = student_forward(
        model, params, batch, keep_prefix=run_teacher and batch.teacher_compact,
        router_loss=with_router,
    )  # fmt: skip
    if run_teacher:
        # The teacher forward sees stop-gradiented params (and prefix): no backward pass.
        teacher_BtxTtxD = teacher_rows_hidden(model, teacher_params, teacher_batch, prefix)
        if not divergence_at_slots(batch):  # else D at the teacher's slots only, below
            teacher_hidden_BxTxD = gather_teacher(teacher_BtxTtxD, batch)
    stats = chunked_token_stats(
        hidden_BxTxD,
        batch.targets_BxT,
        _unembed_fn(model, params, rl_cfg.temperature),
        teacher_hidden_BxTxD=teacher_hidden_BxTxD if tg_cfg.enabled else None,
        teacher_unembed_fn=teacher_unembed_fn,
        chunk_size=tg_cfg.chunk_size,
        **peers.divergence_options(tg_cfg),
    )
    if run_teacher and divergence_at_slots(batch):
        stats = stats._replace(divergence_BxT=slot_divergence(
            hidden_BxTxD, teacher_BtxTtxD, batch, _unembed_fn(model, params, rl_cfg.temperature),
            teacher_mask(batch, tg_cfg), chunk_size=tg_cfg.chunk_size,
            **peers.divergence_options(tg_cfg),
        ))  # fmt: skip
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


class TGTerm(NamedTuple):
    """The TG term's share and its metric shares (scalars; R = requirements)."""

    loss: jax.Array  # lambda_tg * sum_{t in M} D_t / |M|
    kl: jax.Array  # sum_{t in M} D_t / |M|
    kl_R: jax.Array  # the same per requirement (over that requirement's |M|)


def tg_term(
    divergence_BxT: jax.Array | None,
    batch: Batch,
    tg_cfg: TGConfig,
    norms: Normalizers,
    step: int | jax.Array,
) -> TGTerm:
    """lambda_tg * sum_{t in M} D_t / N (this batch's share of it); zeros for the GRPO arm
    and for tg.method "sgcd" (no distillation term). lambda_tg: `peers.distill_weight` (the
    schedule; sdpo's w).

    N = |M| (tg.normalize token_mean) or the whole batch's trajectories x tg.norm_length
    (token_sum: a micro-batch's sum over that N is already its share)."""
    num_req = len(batch.requirement_names)
    if not tg_cfg.enabled or tg_cfg.method == "sgcd":
        zero = jnp.zeros((), jnp.float32)
        return TGTerm(loss=zero, kl=zero, kl_R=jnp.zeros((num_req,), jnp.float32))
    local, tm = tg_loss(
        divergence_BxT,
        distill_mask(batch, tg_cfg),
        peers.distill_weight(step, tg_cfg),
        assistant_mask_BxT=batch.loss_mask_BxT.astype(bool),
        requirement_ids_BxT=batch.requirement_ids_BxT,
        num_requirements=num_req,
        normalize=tg_cfg.normalize,
        norm_constant=jnp.maximum(norms.num_episodes, 1.0) * tg_cfg.norm_length,
    )
    share = _share(tm.num_distilled, norms.num_distilled)
    req_share_R = tm.per_requirement_tokens / jnp.maximum(norms.req_tokens_R, 1.0)
    return TGTerm(
        loss=local * (1.0 if tg_cfg.normalize == "token_sum" else share),
        kl=tm.divergence_mean * share,
        kl_R=tm.per_requirement_divergence * req_share_R,
    )


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
        _unembed_fn(model, ref_params, rl_cfg.temperature),
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
    """L = L_GRPO(A) + lambda_tg * sum_{t in M} D_t / |M| (+ kl_coef * KL to the reference).

    The loss and the summed metrics are this batch's *share* of the whole-batch values: each
    mean is divided by the whole-batch count in `norms`, so summing over micro-batches gives
    the big-batch value (with norms=None the batch is the whole batch).

    Args:
      params: model params (differentiated).
      batch: a `Batch` (or one micro-batch of it).
      model: the Transformer.
      rl_cfg: the typed `rl` section.
      tg_cfg: the typed `tg` section.
      step: train step, for lambda_schedule.
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
    teacher_params = None
    if tg_cfg.reference_teacher:
        if ref_params is None:
            raise ValueError("tg.teacher_params='reference' needs ref_params")
        teacher_params = ref_params
    stats, router = token_stats(
        params, batch, model=model, rl_cfg=rl_cfg, tg_cfg=tg_cfg,
        teacher_hidden_BxTxD=teacher_hidden_BxTxD, teacher_params=teacher_params,
    )  # fmt: skip

    advantages_B, peer_metrics = peer_advantages(advantages_B, stats, batch, tg_cfg, norms)
    policy, pm = policy_term(
        stats.logprob_BxT, batch, advantages_B, rl_cfg, share, logp_proximal_BxT
    )
    tg = tg_term(stats.divergence_BxT, batch, tg_cfg, norms, step)
    reference, ref_kl = reference_term(
        stats.logprob_BxT, batch, model=model, ref_params=ref_params, rl_cfg=rl_cfg,
        tg_cfg=tg_cfg, share=share,
    )  # fmt: skip
    # The router loss is a mean over this batch's tokens: weighted like the other token means.
    router = router * share.tokens
    loss = policy_and_distill(policy, tg, tg_cfg) + reference + router

    sums, maxes = loss_metrics(loss, policy, pm, tg, ref_kl, stats, batch, norms, share)
    sums = {**sums, "router_aux_loss": jax.lax.stop_gradient(router), **peer_metrics}
    return loss, (sums, maxes)


def peer_advantages(
    advantages: jax.Array, stats: TokenStats, batch: Batch, tg_cfg: TGConfig, norms: Normalizers
) -> tuple[jax.Array, Metrics]:
    """tg.method "sgcd": the advantages times the per-token teacher weights (`peers.sgcd`),
    [B, T], and the metric shares sgcd_weight_mean / sgcd_score_mean (over assistant tokens);
    any other method: the advantages as they are and no metrics."""
    if not (tg_cfg.enabled and tg_cfg.method == "sgcd"):
        return advantages, {}
    score_BxT = peers.sgcd.score(stats.divergence_BxT, teacher_mask(batch, tg_cfg))
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
    """L_GRPO + the distillation term (`TGTerm.loss`, weighted by `peers.distill_weight`);
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
        dict(batch.rewards), weights, batch.group_ids_B, reward_norm=rl_cfg.reward_norm,
        stats_B=batch.head_B, **kw,
    )  # fmt: skip
    if rl_cfg.requirement_credit == "episode":
        return adv_B, rewards_B, metrics
    req, episode = rl_cfg.credit_split(batch.requirement_names)
    adv_B, _, _ = compute_advantages(
        dict(batch.rewards), episode, batch.group_ids_B, reward_norm=rl_cfg.reward_norm,
        stats_B=batch.head_B, **kw,
    )  # fmt: skip
    mask_BxT = batch.loss_mask_BxT
    unmet = batch.unmet_turn_mask_BxT  # failed or rejected (met on a refused turn earns nothing)
    unmet = batch.failed_turn_mask_BxT if unmet is None else unmet
    turn_BxT = turn_advantages(~unmet, mask_BxT, batch.group_ids_B, **kw)
    w_req = sum(weights[k] for k in req)
    return adv_B[:, None] * mask_BxT + w_req * turn_BxT, rewards_B, metrics
