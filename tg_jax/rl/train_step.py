"""The pure, sharded train step: GRPO policy loss + targeted-guidance distillation.

One call of `train_step(state, batch)`:

 1. GRPO advantages from the combined reward, per group, over the WHOLE batch (before any
    micro-batch split, so that a group split across micro-batches keeps its statistics).
 2. Normalisers over the whole batch (assistant tokens, sequences, distilled tokens), so that
    the sum of the micro-batch losses equals the loss of the single big batch for every
    aggregation mode.
 3. Per micro-batch (`lax.scan` over `rl.micro_batches`, gradients summed), `loss_fn`:
    a. student forward to final hidden states [B, T, D];
    b. when TG is on, teacher forward on the hinted teacher tokens with the SAME params under
       stop_gradient (compact teacher rows start at the first hint and reuse the student's
       keys and values for the prefix, `tg_jax.rl.teacher`), gathered to student positions
       through the batch's index map (the GRPO arm skips it entirely);
    c. `chunked_token_stats`: student log-prob of each target, entropy and the divergence to
       the teacher, chunk by chunk along T (never the whole [B, T, V] of either model);
    d. the README equation, one named term each:
       L = L_GRPO(A) + lambda_tg * sum_{t in M} D_t / |M| (+ kl_coef * KL to the reference):
       `policy_term` (`ppo_loss` on the assistant tokens), `tg_term` (`tg_loss` on
       `tg_mask(...)` with lambda_tg from `lambda_schedule(step)`), `reference_term`.
 4. Global-norm of the gradients; a non-finite loss or gradient skips the update (params and
    optimizer state are kept as they were) and sets `update_skipped`.
 5. AdamW update (clipping and schedule in `make_optimizer`).

`make_train_step` makes the config typed (`StepConfig`, validated once), jits the step with
explicit shardings (params by the logical rules, batch over the data axes) and donates the
state. The state, optimizer and their shardings live in `tg_jax.rl.train_state`.

Metrics (float32 scalars; token means over assistant tokens of the whole batch):
  loss, pg_loss, ref_kl, tg_loss (= lambda_tg * tg_kl), tg_kl (mean D over distilled tokens),
  tg_kl/<requirement>, tg_tokens/<requirement>, tg_distilled_frac (|M| / assistant tokens),
  tg_num_distilled, num_tokens, lambda_tg, clip_frac_low, clip_frac_high, dual_clip_frac,
  ratio_mean, ratio_max, approx_kl, tis_weight_mean, entropy, logprob_mismatch_mean /
  logprob_mismatch_max (|behaviour - trainer log-prob| on assistant tokens: ~0 on-policy),
  grad_norm (before clipping), update_skipped (1 = non-finite, params kept), lr, reward
  (combined), reward_std, reward/<component>, frac_zero_std_groups, advantage_abs_mean,
  policy_version_mean.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tg_jax import sharding
from tg_jax.models import hidden_states, unembed
from tg_jax.rl.advantages import AdvantageMetrics, compute_advantages
from tg_jax.rl.batch import Batch, split_microbatches
from tg_jax.rl.policy_loss import PolicyLossMetrics, ppo_loss, reference_kl
from tg_jax.rl.step_config import RLConfig, StepConfig, TGConfig
from tg_jax.rl.teacher import gather_teacher, student_forward, teacher_rows_hidden
from tg_jax.rl.tg_loss import TokenStats, chunked_token_stats, lambda_schedule, tg_loss, tg_mask
from tg_jax.rl.train_state import (
    TrainState,
    make_lr_schedule,
    make_optimizer,
    schedule_count,
    train_state_shardings,
)

Metrics = dict[str, jax.Array]


# ---------------------------------------------------------------------------------------------
# Loss.
# ---------------------------------------------------------------------------------------------


class Normalizers(NamedTuple):
    """Whole-batch counts that micro-batch losses are divided by (scalars, R = requirements)."""

    num_tokens: jax.Array  # assistant tokens (loss mask)
    num_seqs: jax.Array  # rows with at least one assistant token
    num_distilled: jax.Array  # |M|
    req_tokens_R: jax.Array  # |M| per requirement


def distill_mask(batch: Batch, tg_cfg: TGConfig) -> jax.Array:
    """M [B, T]: `tg_mask` of the batch under the config's gate and thinking options."""
    return tg_mask(
        batch.distill_mask_BxT,
        batch.thinking_mask_BxT,
        batch.failed_turn_mask_BxT,
        batch.loss_mask_BxT,
        include_thinking=tg_cfg.include_thinking,
        gate=tg_cfg.gate,
    )


def normalizers(batch: Batch, tg_cfg: TGConfig) -> Normalizers:
    """Counts over the whole batch (before a micro-batch split)."""
    loss_mask_BxT = batch.loss_mask_BxT.astype(bool)
    mask_BxT = distill_mask(batch, tg_cfg)
    num_req = len(batch.requirement_names)
    onehot_BxTxR = jax.nn.one_hot(batch.requirement_ids_BxT, num_req, dtype=jnp.float32)
    req_tokens_R = (onehot_BxTxR * mask_BxT[..., None].astype(jnp.float32)).sum(axis=(0, 1))
    return Normalizers(
        num_tokens=loss_mask_BxT.sum().astype(jnp.float32),
        num_seqs=(loss_mask_BxT.sum(axis=-1) > 0).sum().astype(jnp.float32),
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
) -> tuple[TokenStats, jax.Array]:
    """Student forward (+ the teacher's when TG is on) -> log-probs, entropy, D per token, and
    the MoE router load-balancing loss (0 unless the model sets router_aux_loss_coef).

    The teacher is the same params under stop_gradient on the hinted teacher tokens
    (`tg_jax.rl.teacher`: compact rows continue the student's prefix keys and values),
    gathered to student positions (`gather_teacher`); `teacher_hidden_BxTxD` replaces it.
    """
    run_teacher = tg_cfg.enabled and teacher_hidden_BxTxD is None
    cfg = model.config
    with_router = bool(cfg.is_moe and cfg.router_aux_loss_coef > 0)
    hidden_BxTxD, prefix, router = student_forward(
        model, params, batch, keep_prefix=run_teacher and batch.teacher_compact,
        router_loss=with_router,
    )  # fmt: skip
    if run_teacher:
        # The teacher forward sees stop-gradiented params (and prefix): no backward pass.
        teacher_BtxTtxD = teacher_rows_hidden(model, params, batch, prefix)
        teacher_hidden_BxTxD = gather_teacher(teacher_BtxTtxD, batch)
    stats = chunked_token_stats(
        hidden_BxTxD,
        batch.targets_BxT,
        _unembed_fn(model, params, rl_cfg.temperature),
        teacher_hidden_BxTxD=teacher_hidden_BxTxD if tg_cfg.enabled else None,
        chunk_size=tg_cfg.chunk_size,
        kind=tg_cfg.kind,
        beta=tg_cfg.beta,
        estimator=tg_cfg.estimator,
        top_k=tg_cfg.top_k,
    )
    return stats, router if router is not None else jnp.zeros((), jnp.float32)


def policy_term(
    logprob_BxT: jax.Array,
    batch: Batch,
    advantages_B: jax.Array,
    rl_cfg: RLConfig,
    share: Shares,
) -> tuple[jax.Array, PolicyLossMetrics]:
    """L_GRPO(A): this batch's share of the clipped surrogate over the assistant tokens."""
    pg_loss, pm = ppo_loss(
        logprob_BxT,
        batch.behaviour_logprobs_BxT,
        advantages_B,
        batch.loss_mask_BxT.astype(bool),
        # The trainer's policy at the start of the update is the proximal one: with a single
        # update per batch its log-probs are the current ones, without gradient.
        logp_proximal_BxT=jax.lax.stop_gradient(logprob_BxT) if rl_cfg.tis_cap else None,
        clip_low=rl_cfg.clip_low,
        clip_high=rl_cfg.clip_high,
        dual_clip=rl_cfg.dual_clip,
        tis_cap=rl_cfg.tis_cap,
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
    """lambda_tg * sum_{t in M} D_t / N (this batch's share of it); zeros for the GRPO arm.

    N = |M| (tg.normalize token_mean) or the whole batch's trajectories x tg.norm_length
    (token_sum: a micro-batch's sum over that N is already its share)."""
    num_req = len(batch.requirement_names)
    if not tg_cfg.enabled:
        zero = jnp.zeros((), jnp.float32)
        return TGTerm(loss=zero, kl=zero, kl_R=jnp.zeros((num_req,), jnp.float32))
    local, tm = tg_loss(
        divergence_BxT,
        distill_mask(batch, tg_cfg),
        lambda_schedule(step, tg_cfg.schedule),
        assistant_mask_BxT=batch.loss_mask_BxT.astype(bool),
        requirement_ids_BxT=batch.requirement_ids_BxT,
        num_requirements=num_req,
        normalize=tg_cfg.normalize,
        norm_constant=jnp.maximum(norms.num_seqs, 1.0) * tg_cfg.norm_length,
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
      ref_params: frozen reference params; used when rl_cfg.kl_coef > 0.
      advantages_B: [B] precomputed advantages (whole-batch groups); default: from the batch.
      norms: whole-batch `Normalizers`; default: this batch's.
      teacher_hidden_BxTxD: teacher hidden states already gathered to student positions (e.g.
        constants in a test); default: the teacher forward on the batch's teacher tokens.

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
        params, batch, model=model, rl_cfg=rl_cfg, tg_cfg=tg_cfg,
        teacher_hidden_BxTxD=teacher_hidden_BxTxD,
    )  # fmt: skip

    policy, pm = policy_term(stats.logprob_BxT, batch, advantages_B, rl_cfg, share)
    tg = tg_term(stats.divergence_BxT, batch, tg_cfg, norms, step)
    reference, ref_kl = reference_term(
        stats.logprob_BxT, batch, model=model, ref_params=ref_params, rl_cfg=rl_cfg,
        tg_cfg=tg_cfg, share=share,
    )  # fmt: skip
    # The router loss is a mean over this batch's tokens: weighted like the other token means.
    router = router * share.tokens
    loss = policy + tg.loss + reference + router

    sums, maxes = loss_metrics(loss, policy, pm, tg, ref_kl, stats, batch, norms, share)
    return loss, ({**sums, "router_aux_loss": jax.lax.stop_gradient(router)}, maxes)


def batch_advantages(
    batch: Batch, rl_cfg: RLConfig
) -> tuple[jax.Array, jax.Array, AdvantageMetrics]:
    """`compute_advantages` on the batch's rewards and groups (padding rows excluded)."""
    return compute_advantages(
        dict(batch.rewards),
        dict(rl_cfg.reward_weights),
        batch.group_ids_B,
        mode=rl_cfg.advantage_mode,
        eps=rl_cfg.adv_eps,
        valid_B=batch.valid_B,
    )


# ---------------------------------------------------------------------------------------------
# Step.
# ---------------------------------------------------------------------------------------------


def _constrain_micro(x: jax.Array) -> jax.Array:
    """Keeps the batch axis of a [M, B/M, ...] micro-batch array on the data axes."""
    return nn.with_logical_constraint(x, (None, "batch") + (None,) * (x.ndim - 2))


def accumulate_grads(
    grad_fn: Callable[..., tuple[Any, tuple[Metrics, Metrics]]],
    params: Any,
    batch: Batch,
    advantages_B: jax.Array,
    num_micro: int,
) -> tuple[Any, Metrics, Metrics]:
    """(grads, sums, maxes) of `grad_fn` summed (maxed) over `num_micro` micro-batches.

    `grad_fn(params, batch, advantages_B=...)` returns (grads, (sums, maxes)) of one
    micro-batch's share; the micro-batches run in a `lax.scan` (one compiled body).
    """
    if num_micro == 1:
        grads, (sums, maxes) = grad_fn(params, batch, advantages_B=advantages_B)
        return grads, sums, maxes
    micro = jax.tree.map(_constrain_micro, split_microbatches((batch, advantages_B), num_micro))

    def body(carry, xs):
        g_acc, s_acc, m_acc = carry
        mb, adv = xs
        g, (s, m) = grad_fn(params, mb, advantages_B=adv)
        return (
            jax.tree.map(jnp.add, g_acc, g),
            jax.tree.map(jnp.add, s_acc, s),
            jax.tree.map(jnp.maximum, m_acc, m),
        ), None

    first = jax.tree.map(lambda x: x[0], micro)
    shapes = jax.eval_shape(lambda p, xs: grad_fn(p, xs[0], advantages_B=xs[1]), params, first)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    (grads, sums, maxes), _ = jax.lax.scan(body, (zeros[0], *zeros[1]), micro)
    return grads, sums, maxes


def train_step(
    state: TrainState,
    batch: Batch,
    ref_params: Any = None,
    *,
    model: nn.Module,
    config: StepConfig,
    optimizer: optax.GradientTransformation,
) -> tuple[TrainState, Metrics]:
    """One optimizer update from one batch (steps 1-5 of the module docstring); pure.

    Args:
      state: `TrainState`.
      batch: `Batch` with B and B_t multiples of config.rl.micro_batches.
      ref_params: frozen reference params (needed when config.rl.kl_coef > 0).
      model: the Transformer.
      config: the typed `rl`, `tg` and `optim` sections (`StepConfig.from_config`).
      optimizer: from `make_optimizer(config.optim)`.

    Returns:
      (new state, metrics): metrics is a dict of float32 scalars.
    """
    rl_cfg, tg_cfg = config.rl, config.tg
    step_rng = jax.random.fold_in(state.rng, state.step)
    del step_rng  # no loss term samples yet; every future one must derive from step_rng
    adv_B, _, adv_metrics = batch_advantages(batch, rl_cfg)
    norms = normalizers(batch, tg_cfg)
    loss = functools.partial(
        loss_fn, model=model, rl_cfg=rl_cfg, tg_cfg=tg_cfg, step=state.step,
        ref_params=ref_params, norms=norms,
    )  # fmt: skip
    grad_fn = jax.grad(loss, has_aux=True)
    grads, sums, maxes = accumulate_grads(grad_fn, state.params, batch, adv_B, rl_cfg.micro_batches)

    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(sums["loss"]) & jnp.isfinite(grad_norm)
    updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)

    def keep_if_bad(new, old):
        return jnp.where(finite, new, old)

    new_state = state.replace(
        params=jax.tree.map(keep_if_bad, new_params, state.params),
        opt_state=jax.tree.map(keep_if_bad, new_opt_state, state.opt_state),
        step=state.step + 1,
    )

    valid_B = batch.valid_B.astype(jnp.float32)
    num_valid = jnp.maximum(valid_B.sum(), 1.0)
    metrics = {**sums, **maxes}
    metrics.update(
        grad_norm=grad_norm,
        update_skipped=(~finite).astype(jnp.float32),
        lr=make_lr_schedule(config.optim)(schedule_count(state.opt_state)),
        lambda_tg=(
            lambda_schedule(state.step, tg_cfg.schedule) if tg_cfg.enabled else jnp.zeros(())
        ),
        reward=adv_metrics.reward_mean,
        reward_std=adv_metrics.reward_std,
        frac_zero_std_groups=adv_metrics.frac_zero_std_groups,
        tg_distilled_frac=norms.num_distilled / jnp.maximum(norms.num_tokens, 1.0),
        tg_num_distilled=norms.num_distilled,
        num_tokens=norms.num_tokens,
        advantage_abs_mean=(jnp.abs(adv_B) * valid_B).sum() / num_valid,
        policy_version_mean=(batch.policy_version_B * valid_B).sum() / num_valid,
    )
    for name, r_B in batch.rewards.items():
        metrics[f"reward/{name}"] = (r_B.astype(jnp.float32) * valid_B).sum() / num_valid
    for r, name in enumerate(batch.requirement_names):
        metrics[f"tg_tokens/{name}"] = norms.req_tokens_R[r]
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    return new_state, metrics


# ---------------------------------------------------------------------------------------------
# The jitted step.
# ---------------------------------------------------------------------------------------------


def make_train_step(
    config: ml_collections.ConfigDict | StepConfig,
    model: nn.Module,
    mesh: Mesh,
    rules: sharding.Rules,
    *,
    with_reference: bool | None = None,
) -> Callable[..., tuple[TrainState, Metrics]]:
    """`train_step` jitted with explicit shardings and a donated state.

    Args:
      config: a config with `rl`, `tg` and `optim` sections (`config_lib`), made typed and
        validated here (`StepConfig.from_config`), or a `StepConfig`.
      model: the Transformer.
      mesh: the trainer's mesh.
      rules: logical-axis rules.
      with_reference: whether the step takes frozen reference params as a third argument;
        default: config.rl.kl_coef > 0.

    Returns:
      step(state, batch) -> (state, metrics), or step(state, batch, ref_params) with a
      reference. The batch must be placed (or placeable) with B a multiple of
      `sharding.batch_divisor(mesh, rules) * config.rl.micro_batches`. `step.jitted` is the
      underlying jitted function (for lowering and compile-cache inspection).
    """
    config = StepConfig.from_config(config)
    optimizer = make_optimizer(config.optim)
    if with_reference is None:
        with_reference = config.rl.kl_coef > 0
    state_sh = train_state_shardings(model, optimizer, mesh, rules)
    batch_sh = sharding.data_sharding(mesh, rules, ndim=1)  # a prefix: dim 0 of every leaf
    replicated = NamedSharding(mesh, PartitionSpec())
    body = functools.partial(train_step, model=model, config=config, optimizer=optimizer)
    if with_reference:

        def fn(state, batch, ref_params):
            with nn.logical_axis_rules(rules):
                return body(state, batch, ref_params)

        in_sh = (state_sh, batch_sh, state_sh.params)
    else:

        def fn(state, batch):
            with nn.logical_axis_rules(rules):
                return body(state, batch)

        in_sh = (state_sh, batch_sh)
    jitted = jax.jit(
        fn, in_shardings=in_sh, out_shardings=(state_sh, replicated), donate_argnames="state"
    )

    @functools.wraps(fn)
    def step(*args):
        with jax.set_mesh(mesh):
            return jitted(*args)

    step.jitted = jitted
    return step
