"""The pure, sharded train step: one rollout batch -> one or more optimizer updates.

One call of `train_step(state, batch)` (one rollout batch, one `TrainState.step`):

 1. GRPO advantages from the combined reward, per group, over the WHOLE batch (before any
    minibatch or micro-batch split, so that a group split across them keeps its statistics).
 2. Normalisers over the whole batch (assistant tokens, sequences, distilled tokens), so that
    the sum of the micro-batch losses equals the loss of the single big batch for every
    aggregation mode.
 3. Per micro-batch (`lax.scan` over `rl.micro_batches`, gradients summed), `loss_fn`
    (`tg_jax.rl.loss`: student and teacher forwards, L = L_GRPO(A) + lambda_tg *
    sum_{t in M} D_t / |M| (+ kl_coef * KL to the reference)). The teacher runs on the
    policy's params, or on the frozen reference params with tg.teacher_params "reference".
 4. Global-norm of the gradients; a non-finite loss or gradient skips the update (params and
    optimizer state are kept as they were) and sets `update_skipped`.
 5. AdamW update (clipping and schedule in `make_optimizer`).
 6. With `rl.num_updates` x `rl.num_minibatches` > 1, steps 3-5 run once per minibatch of
    each epoch instead (`update_phase`, `tg_jax.rl.updates`: the decoupled PPO form, ratio to
    the params at the start of the phase, importance weight pi_prox / pi_b); each minibatch's
    normalisers are its own, the advantages stay those of step 1. The lr schedule counts
    optimizer updates (num_updates x num_minibatches per step).

`make_train_step` makes the config typed (`StepConfig`, validated once), jits the step with
explicit shardings (params by the logical rules, batch over the data axes) and donates the
state. The state, optimizer and their shardings live in `tg_jax.rl.train_state`.

Metrics (float32 scalars; token means over assistant tokens of the whole batch; with several
updates, the update metrics are means over the update phase and maxima its max):
  loss, pg_loss, ref_kl, tg_loss (= lambda_tg * tg_kl), tg_kl (mean D over distilled tokens),
  tg_kl/<requirement>, tg_tokens/<requirement>, tg_distilled_frac (|M| / assistant tokens),
  tg_num_distilled, num_tokens, lambda_tg (the distillation weight: `loss.distill_weight`),
  sgcd_weight_mean / sgcd_score_mean (tg.method "sgcd" only), tg_teacher_param_norm,
  tg_teacher_drift (`teacher_metrics`), clip_frac_low, clip_frac_high, dual_clip_frac,
  ratio_mean, ratio_max, ratio_abs_dev (mean |ratio - 1|), approx_kl (KL(proximal || current)
  when the ratio is to the proximal policy), tis_weight_mean, entropy, logprob_mismatch_mean /
  logprob_mismatch_max (|behaviour - trainer log-prob| on assistant tokens: ~0 on-policy),
  grad_norm (before clipping), update_skipped (1 = non-finite, params kept; several updates:
  the fraction skipped), lr (at the step's first update), reward (combined), reward_std,
  reward/<component>, frac_zero_std_groups, advantage_abs_mean, policy_version_mean.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tg_jax import sharding, tracing
from tg_jax.rl import updates
from tg_jax.rl.core import Batch, Normalizers, Shares, normalizers, shares
from tg_jax.rl.loss import (
    batch_advantages,
    distill_weight,
    loss_fn,
    loss_metrics,
    policy_term,
    reference_term,
    token_stats,
)
from tg_jax.rl.step_config import StepConfig, TGConfig
from tg_jax.rl.tg.loss import TGTerm, tg_term
from tg_jax.rl.tg.teacher import gather_teacher
from tg_jax.rl.train_state import (
    TrainState,
    make_lr_schedule,
    make_optimizer,
    schedule_count,
    train_state_shardings,
)

# The loss lives in tg_jax.rl.loss (its core in tg_jax.rl.core, the TG term in tg_jax.rl.tg.loss);
# these names stay importable from here.
__all__ = [
    "Normalizers",
    "Shares",
    "TGTerm",
    "batch_advantages",
    "gather_teacher",
    "loss_fn",
    "loss_metrics",
    "make_train_step",
    "normalizers",
    "optimizer_update",
    "policy_term",
    "reference_term",
    "shares",
    "single_update",
    "teacher_metrics",
    "tg_term",
    "token_stats",
    "train_step",
    "update_phase",
]

Metrics = dict[str, jax.Array]


# ---------------------------------------------------------------------------------------------
# Step.
# ---------------------------------------------------------------------------------------------


def optimizer_update(
    params: Any,
    opt_state: Any,
    grads: Any,
    loss: jax.Array,
    optimizer: optax.GradientTransformation,
) -> tuple[Any, Any, Metrics]:
    """Steps 4-5: (params, opt_state, {grad_norm, update_skipped}); a non-finite loss or
    gradient keeps params and optimizer state as they were."""
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    deltas, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, deltas)

    def keep_if_bad(new, old):
        return jnp.where(finite, new, old)

    return (
        jax.tree.map(keep_if_bad, new_params, params),
        jax.tree.map(keep_if_bad, new_opt_state, opt_state),
        {"grad_norm": grad_norm, "update_skipped": (~finite).astype(jnp.float32)},
    )


def _loss(config: StepConfig, model: nn.Module, step: jax.Array, ref_params: Any, norms):
    """`loss_fn` with the step's static parts and normalisers bound."""
    return functools.partial(
        loss_fn,
        model=model,
        rl_cfg=config.rl,
        tg_cfg=config.tg,
        step=step,
        ref_params=ref_params,
        norms=norms,
    )


def single_update(
    state: TrainState,
    batch: Batch,
    adv_B: jax.Array,
    norms: Normalizers,
    ref_params: Any,
    *,
    model: nn.Module,
    config: StepConfig,
    optimizer: optax.GradientTransformation,
) -> tuple[Any, Any, Metrics]:
    """One optimizer update from the whole batch (micro-batches accumulated): (params,
    opt_state, metrics)."""
    grad_fn = jax.grad(_loss(config, model, state.step, ref_params, norms), has_aux=True)
    grads, sums, maxes = updates.accumulate_grads(
        grad_fn, state.params, batch, adv_B, config.rl.micro_batches
    )
    params, opt_state, extra = optimizer_update(
        state.params, state.opt_state, grads, sums["loss"], optimizer
    )
    return params, opt_state, {**sums, **maxes, **extra}


def _proximal_logprob_fn(model: nn.Module, config: StepConfig) -> Callable:
    """(params, batch) -> [B, T] log-probs of the targets: the student forward alone."""
    student_only = dataclasses.replace(config.tg, enabled=False)

    def fn(params: Any, batch: Batch) -> jax.Array:
        stats, _ = token_stats(params, batch, model=model, rl_cfg=config.rl, tg_cfg=student_only)
        return stats.logprob_BxT

    return fn


def _abs_mean(adv: jax.Array, batch: Batch) -> jax.Array:
    """Mean |advantage| over episodes ([B], `_episode_rows`) or over produced tokens ([B, T],
    turn credit)."""
    if adv.ndim == 1:
        valid_B = _episode_rows(batch)
        return (jnp.abs(adv) * valid_B).sum() / jnp.maximum(valid_B.sum(), 1.0)
    mask_BxT = batch.loss_mask_BxT.astype(jnp.float32)
    return (jnp.abs(adv) * mask_BxT).sum() / jnp.maximum(mask_BxT.sum(), 1.0)


def _episode_rows(batch: Batch) -> jax.Array:
    """[B] float32, 1 on the rows that count an episode once (`Batch.head_B`, else valid)."""
    rows_B = batch.valid_B if batch.head_B is None else batch.valid_B & batch.head_B
    return rows_B.astype(jnp.float32)


def update_phase(
    state: TrainState,
    batch: Batch,
    adv_B: jax.Array,
    ref_params: Any,
    key: jax.Array,
    *,
    model: nn.Module,
    config: StepConfig,
    optimizer: optax.GradientTransformation,
) -> tuple[Any, Any, Metrics]:
    """rl.num_updates epochs x rl.num_minibatches decoupled PPO updates (`tg_jax.rl.updates`):
    (params, opt_state, each update's metrics stacked [U x N]).

    Each minibatch's loss is `loss_fn` of that minibatch alone (its own normalisers, the
    whole batch's advantages), with the proximal log-probs of the params at the start.
    """
    rl_cfg = config.rl
    chunks = updates.chunk((batch, adv_B), rl_cfg.num_chunks)
    prox = updates.proximal_logprobs(_proximal_logprob_fn(model, config), state.params, chunks[0])

    def update_fn(carry, minibatch):
        params, opt_state = carry
        minibatch = jax.tree.map(updates.constrain_micro, minibatch)
        norms = normalizers(updates.unchunk(minibatch[0]), config.tg)
        loss = _loss(config, model, state.step, ref_params, norms)

        def grad_fn(p, mb, adv, prox_BxT):
            return jax.grad(loss, has_aux=True)(p, mb, advantages_B=adv, logp_proximal_BxT=prox_BxT)

        grads, sums, maxes = updates.accumulate_stacked(grad_fn, params, minibatch)
        params, opt_state, extra = optimizer_update(
            params, opt_state, grads, sums["loss"], optimizer
        )
        return (params, opt_state), {**sums, **maxes, **extra}

    (params, opt_state), stacked = updates.update_phase(
        update_fn,
        (state.params, state.opt_state),
        (*chunks, prox),
        key,
        num_updates=rl_cfg.num_updates,
        num_minibatches=rl_cfg.num_minibatches,
    )
    return params, opt_state, stacked


def phase_mean(stacked: Metrics) -> Metrics:
    """Each update's metrics [U x N] -> one value: the mean, the max for maxima (`_max`)."""
    return {k: v.max() if k.endswith("_max") else v.mean() for k, v in stacked.items()}


def teacher_metrics(params: Any, ref_params: Any, tg_cfg: TGConfig) -> Metrics:
    """tg_teacher_param_norm (global norm of the params the teacher forward ran on: constant
    over a run with the reference teacher) and tg_teacher_drift (global norm of teacher -
    policy params at the step's start: 0 with the policy teacher)."""
    if not tg_cfg.reference_teacher:
        return {"tg_teacher_param_norm": optax.tree.norm(params), "tg_teacher_drift": 0.0}
    drift = jax.tree.map(lambda t, p: t.astype(jnp.float32) - p, ref_params, params)
    return {
        "tg_teacher_param_norm": optax.tree.norm(ref_params),
        "tg_teacher_drift": optax.tree.norm(drift),
    }


def train_step(
    state: TrainState,
    batch: Batch,
    ref_params: Any = None,
    *,
    model: nn.Module,
    config: StepConfig,
    optimizer: optax.GradientTransformation,
) -> tuple[TrainState, Metrics]:
    """The optimizer updates of one rollout batch (steps 1-6 of the module docstring); pure.

    Args:
      state: `TrainState`.
      batch: `Batch` with B and B_t multiples of config.rl.num_chunks (the batch built with
        micro_batches = num_minibatches x micro_batches).
      ref_params: frozen reference params (needed when config.rl.kl_coef > 0 or
        config.tg.teacher_params is "reference": `StepConfig.needs_reference`).
      model: the Transformer.
      config: the typed `rl`, `tg` and `optim` sections (`StepConfig.from_config`).
      optimizer: from `make_optimizer(config.optim)`.

    Returns:
      (new state, metrics): metrics is a dict of float32 scalars; with several updates the
      loss metrics are their means over the update phase (maxima: the max).
    """
    rl_cfg, tg_cfg = config.rl, config.tg
    # Every random choice of the step derives from step_rng (the minibatch shuffles).
    step_rng = jax.random.fold_in(state.rng, state.step)
    adv_B, _, adv_metrics = batch_advantages(batch, rl_cfg)
    norms = normalizers(batch, tg_cfg)
    kw = {"model": model, "config": config, "optimizer": optimizer}
    if rl_cfg.decoupled:
        params, opt_state, stacked = update_phase(state, batch, adv_B, ref_params, step_rng, **kw)
        update_metrics = phase_mean(stacked)
    else:
        params, opt_state, update_metrics = single_update(
            state, batch, adv_B, norms, ref_params, **kw
        )
    new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1)

    valid_B = _episode_rows(batch)
    num_valid = jnp.maximum(valid_B.sum(), 1.0)
    metrics = dict(update_metrics)
    metrics.update(
        lr=make_lr_schedule(config.optim)(schedule_count(state.opt_state)),
        lambda_tg=(distill_weight(state.step, tg_cfg) if tg_cfg.enabled else jnp.zeros(())),
        reward=adv_metrics.reward_mean,
        reward_std=adv_metrics.reward_std,
        frac_zero_std_groups=adv_metrics.frac_zero_std_groups,
        tg_distilled_frac=norms.num_distilled / jnp.maximum(norms.num_tokens, 1.0),
        tg_num_distilled=norms.num_distilled,
        num_tokens=norms.num_tokens,
        advantage_abs_mean=_abs_mean(adv_B, batch),
        policy_version_mean=(batch.policy_version_B * valid_B).sum() / num_valid,
    )
    if tg_cfg.enabled:
        metrics.update(teacher_metrics(state.params, ref_params, tg_cfg))
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
        default: `StepConfig.needs_reference` (rl.kl_coef > 0, or the reference teacher).

    Returns:
      step(state, batch) -> (state, metrics), or step(state, batch, ref_params) with a
      reference. The batch must be placed (or placeable) with B a multiple of
      `sharding.batch_divisor(mesh, rules) * config.rl.micro_batches`. `step.jitted` is the
      underlying jitted function (for lowering and compile-cache inspection).
    """
    config = StepConfig.from_config(config)
    optimizer = make_optimizer(config.optim)
    if with_reference is None:
        with_reference = config.needs_reference
    elif config.needs_reference and not with_reference:
        raise ValueError(
            "rl.kl_coef > 0 and tg.teacher_params='reference' need the reference params: "
            "with_reference=False is not allowed"
        )
    state_sh = train_state_shardings(model, optimizer, mesh, rules)
    batch_sh = sharding.data_sharding(mesh, rules, ndim=1)  # a prefix: dim 0 of every leaf
    replicated = NamedSharding(mesh, PartitionSpec())
    body = functools.partial(train_step, model=model, config=config, optimizer=optimizer)
    # Named rl_train_step: the name profiles and compile logs show.
    if with_reference:

        def rl_train_step(state, batch, ref_params):
            with nn.logical_axis_rules(rules):
                return body(state, batch, ref_params)

        in_sh = (state_sh, batch_sh, state_sh.params)
    else:

        def rl_train_step(state, batch):
            with nn.logical_axis_rules(rules):
                return body(state, batch)

        in_sh = (state_sh, batch_sh)
    fn = rl_train_step
    jitted = tracing.jit(
        fn, in_shardings=in_sh, out_shardings=(state_sh, replicated), donate_argnames="state"
    )

    @functools.wraps(fn)
    def step(*args):
        with jax.set_mesh(mesh):
            return jitted(*args)

    step.jitted = jitted
    return step
