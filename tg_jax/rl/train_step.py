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
       stop_gradient, gathered to student positions through the batch's index map (the GRPO
       arm skips it entirely);
    c. `chunked_token_stats`: student log-prob of each target, entropy and the divergence to
       the teacher, chunk by chunk along T (never the whole [B, T, V] of either model);
    d. `ppo_loss` on the assistant tokens, `tg_loss` on `tg_mask(...)` with lambda_tg from
       `lambda_schedule(step)`, optional KL to a frozen reference.
 4. Global-norm of the gradients; a non-finite loss or gradient skips the update (params and
    optimizer state are kept as they were) and sets `update_skipped`.
 5. AdamW update (clipping and schedule in `make_optimizer`).

`make_train_step` jits it with explicit shardings (params by the logical rules, batch over the
data axes) and donates the state.

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
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tg_jax import sharding
from tg_jax.models import hidden_states, unembed
from tg_jax.rl.advantages import compute_advantages
from tg_jax.rl.batch import Batch, split_microbatches
from tg_jax.rl.policy_loss import ppo_loss
from tg_jax.rl.tg_loss import chunked_token_stats, lambda_schedule, tg_loss, tg_mask

Metrics = dict[str, jax.Array]


class TrainState(flax.struct.PyTreeNode):
    """Everything a train step updates.

    Attributes:
      params: model params.
      opt_state: optax state.
      step: int32 scalar, number of train steps taken (skipped updates count).
      rng: PRNG key; each step uses fold_in(rng, step).
    """

    params: Any
    opt_state: Any
    step: jax.Array
    rng: jax.Array


# ---------------------------------------------------------------------------------------------
# Optimizer.
# ---------------------------------------------------------------------------------------------


def make_lr_schedule(optim_cfg: Any) -> optax.Schedule:
    """Learning rate per optimizer update: constant or warmup + cosine (config.optim)."""
    lr, warmup = float(optim_cfg.lr), int(optim_cfg.warmup_steps)
    if optim_cfg.schedule == "constant":
        if warmup <= 0:
            return optax.constant_schedule(lr)
        return optax.linear_schedule(0.0, lr, warmup)
    if optim_cfg.schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=lr,
            warmup_steps=warmup,
            decay_steps=max(int(optim_cfg.total_steps), warmup + 1),
            end_value=lr * float(optim_cfg.end_lr_fraction),
        )
    raise ValueError(f"unknown lr schedule {optim_cfg.schedule!r}")


def _decay_mask(params: Any) -> Any:
    """Weight decay on matrices, not on norm scales."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "norm" not in jax.tree_util.keystr(path), params
    )


def make_optimizer(optim_cfg: Any) -> optax.GradientTransformation:
    """AdamW with global-norm gradient clipping and `make_lr_schedule`.

    Args:
      optim_cfg: `config_lib.optim_config()`.

    Returns:
      An optax transformation.
    """
    parts = []
    if optim_cfg.grad_clip_norm > 0:
        parts.append(optax.clip_by_global_norm(float(optim_cfg.grad_clip_norm)))
    parts.append(
        optax.adamw(
            learning_rate=make_lr_schedule(optim_cfg),
            b1=float(optim_cfg.b1),
            b2=float(optim_cfg.b2),
            eps=float(optim_cfg.eps),
            weight_decay=float(optim_cfg.weight_decay),
            mask=_decay_mask,
        )
    )
    return optax.chain(*parts)


def _schedule_count(opt_state: Any) -> jax.Array:
    """Number of updates the optimizer has applied (the count its lr schedule sees)."""
    states = jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState)
    )
    counts = [s.count for s in states if isinstance(s, optax.ScaleByScheduleState)]
    return counts[0] if counts else jnp.zeros((), jnp.int32)


# ---------------------------------------------------------------------------------------------
# Loss.
# ---------------------------------------------------------------------------------------------


class Normalizers(NamedTuple):
    """Whole-batch counts that micro-batch losses are divided by (scalars, R = requirements)."""

    num_tokens: jax.Array  # assistant tokens (loss mask)
    num_seqs: jax.Array  # rows with at least one assistant token
    num_distilled: jax.Array  # |M|
    req_tokens_R: jax.Array  # |M| per requirement


def distill_mask(batch: Batch, tg_cfg: Any) -> jax.Array:
    """M [B, T]: `tg_mask` of the batch under the config's gate and thinking options."""
    return tg_mask(
        batch.distill_mask_BxT,
        batch.thinking_mask_BxT,
        batch.failed_turn_mask_BxT,
        batch.loss_mask_BxT,
        include_thinking=bool(tg_cfg.include_thinking),
        gate=tg_cfg.gate,
    )


def normalizers(batch: Batch, tg_cfg: Any) -> Normalizers:
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


def gather_teacher(teacher_hidden_BtxTtxD: jax.Array, batch: Batch) -> jax.Array:
    """Teacher hidden states at the student positions of the index map -> [B, T, D].

    per_trajectory: teacher row b serves student row b, so the gather stays within a row (and
    within a device's shard); per_turn: a general row gather.
    """
    pos_BxT, mode = batch.teacher_pos_BxT, batch.teacher_mode
    if mode == "per_trajectory":
        if teacher_hidden_BtxTtxD.shape[0] != pos_BxT.shape[0]:
            raise ValueError("per_trajectory needs one teacher row per student row")
        return jax.vmap(lambda h_TtxD, p_T: h_TtxD[p_T])(teacher_hidden_BtxTtxD, pos_BxT)
    if mode == "per_turn":
        return teacher_hidden_BtxTtxD[batch.teacher_row_BxT, pos_BxT]
    raise ValueError(f"TG needs a batch built with teacher rows, got teacher_mode {mode!r}")


def loss_fn(
    params: Any,
    batch: Batch,
    *,
    model: nn.Module,
    rl_cfg: Any,
    tg_cfg: Any,
    step: int | jax.Array = 0,
    ref_params: Any = None,
    advantages_B: jax.Array | None = None,
    norms: Normalizers | None = None,
    teacher_hidden_BxTxD: jax.Array | None = None,
) -> tuple[jax.Array, tuple[Metrics, Metrics]]:
    """Total loss of a (micro-)batch: GRPO surrogate + lambda_tg * TG (+ reference KL).

    The loss and the summed metrics are this batch's *share* of the whole-batch values: each
    mean is divided by the whole-batch count in `norms`, so summing over micro-batches gives
    the big-batch value (with norms=None the batch is the whole batch).

    Args:
      params: model params (differentiated).
      batch: a `Batch` (or one micro-batch of it).
      model: the Transformer.
      rl_cfg: `config_lib.rl_config()`.
      tg_cfg: `config_lib.tg_config()`.
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
    loss_mask_BxT = batch.loss_mask_BxT.astype(bool)
    temperature = float(rl_cfg.temperature)

    def make_unembed(p: Any) -> Callable[[jax.Array], jax.Array]:
        def fn(h_BxCxD: jax.Array) -> jax.Array:
            logits_BxCxV = unembed(model, p, h_BxCxD)
            return logits_BxCxV if temperature == 1.0 else logits_BxCxV / temperature

        return fn

    hidden_BxTxD = hidden_states(
        model, params, batch.tokens_BxT, batch.positions_BxT, batch.segment_ids_BxT
    )
    use_tg = bool(tg_cfg.enabled)
    if use_tg and teacher_hidden_BxTxD is None:
        # Same weights, no gradient: stop_gradient on the params keeps the whole teacher
        # forward out of the backward pass.
        teacher_BtxTtxD = hidden_states(
            model,
            jax.lax.stop_gradient(params),
            batch.teacher_tokens_BtxTt,
            batch.teacher_positions_BtxTt,
            batch.teacher_segment_ids_BtxTt,
        )
        teacher_hidden_BxTxD = gather_teacher(teacher_BtxTtxD, batch)
    stats = chunked_token_stats(
        hidden_BxTxD,
        batch.targets_BxT,
        make_unembed(params),
        teacher_hidden_BxTxD=teacher_hidden_BxTxD if use_tg else None,
        chunk_size=int(tg_cfg.chunk_size),
        kind=tg_cfg.kind,
        beta=float(tg_cfg.beta),
        estimator=tg_cfg.estimator,
        top_k=int(tg_cfg.top_k) or None,
    )

    logp_ref_BxT = None
    kl_coef = float(rl_cfg.kl_coef)
    if kl_coef > 0:
        if ref_params is None:
            raise ValueError("rl.kl_coef > 0 needs ref_params")
        ref_hidden_BxTxD = hidden_states(
            model, ref_params, batch.tokens_BxT, batch.positions_BxT, batch.segment_ids_BxT
        )
        ref_stats = chunked_token_stats(
            jax.lax.stop_gradient(ref_hidden_BxTxD),
            batch.targets_BxT,
            make_unembed(jax.lax.stop_gradient(ref_params)),
            chunk_size=int(tg_cfg.chunk_size),
        )
        logp_ref_BxT = jax.lax.stop_gradient(ref_stats.logprob_BxT)

    tis_cap = float(rl_cfg.tis_cap) or None
    dual_clip = float(rl_cfg.dual_clip) or None
    pg_total, pm = ppo_loss(
        stats.logprob_BxT,
        batch.behaviour_logprobs_BxT,
        advantages_B,
        loss_mask_BxT,
        # The trainer's policy at the start of the update is the proximal one: with a single
        # update per batch its log-probs are the current ones, without gradient.
        logp_proximal_BxT=jax.lax.stop_gradient(stats.logprob_BxT) if tis_cap else None,
        clip_low=float(rl_cfg.clip_low),
        clip_high=float(rl_cfg.clip_high),
        dual_clip=dual_clip,
        tis_cap=tis_cap,
        agg_mode=rl_cfg.agg_mode,
        norm_length=int(rl_cfg.norm_length) or None,
        logp_ref_BxT=logp_ref_BxT,
        kl_coef=kl_coef,
        kl_estimator=rl_cfg.kl_estimator,
    )
    n_tok = loss_mask_BxT.sum()
    n_seq = (loss_mask_BxT.sum(axis=-1) > 0).sum()
    if rl_cfg.agg_mode == "token_mean":
        agg_share = _share(n_tok, norms.num_tokens)
    else:
        agg_share = _share(n_seq, norms.num_seqs)
    tok_share = _share(n_tok, norms.num_tokens)

    num_req = len(batch.requirement_names)
    if use_tg:
        mask_BxT = distill_mask(batch, tg_cfg)
        lambda_tg = lambda_schedule(step, tg_cfg.schedule)
        tg_local, tm = tg_loss(
            stats.divergence_BxT,
            mask_BxT,
            lambda_tg,
            assistant_mask_BxT=loss_mask_BxT,
            requirement_ids_BxT=batch.requirement_ids_BxT,
            num_requirements=num_req,
        )
        dist_share = _share(tm.num_distilled, norms.num_distilled)
        tg_part = tg_local * dist_share
        tg_kl = tm.divergence_mean * dist_share
        req_kl_R = tm.per_requirement_divergence * (
            tm.per_requirement_tokens / jnp.maximum(norms.req_tokens_R, 1.0)
        )
    else:
        tg_part = tg_kl = jnp.zeros((), jnp.float32)
        req_kl_R = jnp.zeros((num_req,), jnp.float32)

    loss = pg_total * agg_share + tg_part

    logprob_sg_BxT = jax.lax.stop_gradient(stats.logprob_BxT)
    mismatch_BxT = jnp.where(
        loss_mask_BxT, jnp.abs(batch.behaviour_logprobs_BxT - logprob_sg_BxT), 0.0
    )
    entropy_BxT = jnp.where(loss_mask_BxT, jax.lax.stop_gradient(stats.entropy_BxT), 0.0)
    sums = {
        "loss": jax.lax.stop_gradient(loss),
        "pg_loss": pm.pg_loss * agg_share,
        "ref_kl": pm.kl_loss * agg_share,
        "tg_loss": jax.lax.stop_gradient(tg_part),
        "tg_kl": tg_kl,
        "clip_frac_low": pm.clip_frac_low * tok_share,
        "clip_frac_high": pm.clip_frac_high * tok_share,
        "dual_clip_frac": pm.dual_clip_frac * tok_share,
        "ratio_mean": pm.ratio_mean * tok_share,
        "approx_kl": pm.approx_kl * tok_share,
        "tis_weight_mean": pm.tis_weight_mean * tok_share,
        "entropy": entropy_BxT.sum() / jnp.maximum(norms.num_tokens, 1.0),
        "logprob_mismatch_mean": mismatch_BxT.sum() / jnp.maximum(norms.num_tokens, 1.0),
    }
    for r, name in enumerate(batch.requirement_names):
        sums[f"tg_kl/{name}"] = req_kl_R[r]
    maxes = {"ratio_max": pm.ratio_max, "logprob_mismatch_max": mismatch_BxT.max()}
    sums = {k: jax.lax.stop_gradient(v) for k, v in sums.items()}
    maxes = {k: jax.lax.stop_gradient(v) for k, v in maxes.items()}
    return loss, (sums, maxes)


def batch_advantages(batch: Batch, rl_cfg: Any) -> tuple[jax.Array, jax.Array, Any]:
    """`compute_advantages` on the batch's rewards and groups (padding rows excluded)."""
    return compute_advantages(
        dict(batch.rewards),
        dict(rl_cfg.reward_weights),
        batch.group_ids_B,
        mode=rl_cfg.advantage_mode,
        eps=float(rl_cfg.adv_eps),
        valid_B=batch.valid_B,
    )


# ---------------------------------------------------------------------------------------------
# Step.
# ---------------------------------------------------------------------------------------------


def _constrain_micro(x: jax.Array) -> jax.Array:
    """Keeps the batch axis of a [M, B/M, ...] micro-batch array on the data axes."""
    return nn.with_logical_constraint(x, (None, "batch") + (None,) * (x.ndim - 2))


def train_step(
    state: TrainState,
    batch: Batch,
    ref_params: Any = None,
    *,
    model: nn.Module,
    config: Any,
    optimizer: optax.GradientTransformation,
) -> tuple[TrainState, Metrics]:
    """One optimizer update from one batch (steps 1-5 of the module docstring); pure.

    Args:
      state: `TrainState`.
      batch: `Batch` with B and B_t multiples of config.rl.micro_batches.
      ref_params: frozen reference params (needed when config.rl.kl_coef > 0).
      model: the Transformer.
      config: a config with `rl`, `tg` (and `optim`, used through `optimizer`) sections.
      optimizer: from `make_optimizer(config.optim)`.

    Returns:
      (new state, metrics): metrics is a dict of float32 scalars.
    """
    rl_cfg, tg_cfg = config.rl, config.tg
    step_rng = jax.random.fold_in(state.rng, state.step)
    del step_rng  # no loss term samples yet; every future one must derive from step_rng
    adv_B, _, adv_metrics = batch_advantages(batch, rl_cfg)
    norms = normalizers(batch, tg_cfg)
    grad_fn = jax.grad(
        functools.partial(
            loss_fn,
            model=model,
            rl_cfg=rl_cfg,
            tg_cfg=tg_cfg,
            step=state.step,
            ref_params=ref_params,
            norms=norms,
        ),  # fmt: skip
        has_aux=True,
    )
    num_micro = int(rl_cfg.micro_batches)
    if num_micro == 1:
        grads, (sums, maxes) = grad_fn(state.params, batch, advantages_B=adv_B)
    else:
        micro = jax.tree.map(_constrain_micro, split_microbatches((batch, adv_B), num_micro))

        def body(carry, xs):
            g_acc, s_acc, m_acc = carry
            mb, adv = xs
            g, (s, m) = grad_fn(state.params, mb, advantages_B=adv)
            return (
                jax.tree.map(jnp.add, g_acc, g),
                jax.tree.map(jnp.add, s_acc, s),
                jax.tree.map(jnp.maximum, m_acc, m),
            ), None

        first = jax.tree.map(lambda x: x[0], micro)
        shapes = jax.eval_shape(
            lambda p, xs: grad_fn(p, xs[0], advantages_B=xs[1]), state.params, first
        )
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        (grads, sums, maxes), _ = jax.lax.scan(body, (zeros[0], *zeros[1]), micro)

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
        lr=make_lr_schedule(config.optim)(_schedule_count(state.opt_state)),
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
# Sharded state and the jitted step.
# ---------------------------------------------------------------------------------------------


def train_state_shardings(
    model: nn.Module, optimizer: optax.GradientTransformation, mesh: Mesh, rules: sharding.Rules
) -> TrainState:
    """NamedShardings of a `TrainState`: params and their optimizer moments by the logical
    rules (optax maps the boxed params' metadata into its state), scalars replicated."""
    tokens = jnp.zeros((1, 8), jnp.int32)
    boxed = jax.eval_shape(lambda k: model.init(k, tokens)["params"], jax.random.key(0))
    abstract = TrainState(
        params=boxed,
        opt_state=jax.eval_shape(optimizer.init, boxed),
        step=jax.ShapeDtypeStruct((), jnp.int32),
        rng=jax.eval_shape(lambda: jax.random.key(0)),
    )
    return sharding.logical_to_shardings(abstract, mesh, rules)


def create_train_state(
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    rules: sharding.Rules,
    rng: jax.Array,
    params: Any = None,
) -> TrainState:
    """A sharded `TrainState`; params are initialised from rng unless given (then copied)."""
    shardings = train_state_shardings(model, optimizer, mesh, rules)
    init_rng, state_rng = jax.random.split(rng)
    if params is None:
        params, _ = sharding.create_sharded_params(model, init_rng, mesh, rules, check=False)
    # Fresh buffers, never aliases of the caller's params (device_put may reuse a shard when
    # resharding): the step donates the state, which must not delete the caller's arrays.
    params = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings.params)(params)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
    replicated = NamedSharding(mesh, PartitionSpec())
    return TrainState(
        params=params,
        opt_state=opt_state,
        step=jax.device_put(jnp.zeros((), jnp.int32), replicated),
        rng=jax.device_put(state_rng, replicated),
    )


def make_train_step(
    config: Any,
    model: nn.Module,
    mesh: Mesh,
    rules: sharding.Rules,
    *,
    with_reference: bool | None = None,
) -> Callable[..., tuple[TrainState, Metrics]]:
    """`train_step` jitted with explicit shardings and a donated state.

    Args:
      config: a config with `rl`, `tg` and `optim` sections (`config_lib`).
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
    optimizer = make_optimizer(config.optim)
    if with_reference is None:
        with_reference = float(config.rl.kl_coef) > 0
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
