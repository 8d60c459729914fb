"""The RL/SFT train state, its optimizer and its shardings.

`TrainState` is everything a train step updates; `make_optimizer` is AdamW with global-norm
clipping and `make_lr_schedule`; `create_train_state` places a fresh state on the mesh with
params (and their optimizer moments) sharded by the logical-axis rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tg_jax import multihost, sharding, tracing
from tg_jax.models import init_params
from tg_jax.rl.step_config import OptimConfig


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


def make_lr_schedule(optim_cfg: OptimConfig | Mapping[str, Any]) -> optax.Schedule:
    """Learning rate per optimizer update: constant or warmup + cosine (config.optim)."""
    optim_cfg = OptimConfig.from_config(optim_cfg)
    lr, warmup = optim_cfg.lr, optim_cfg.warmup_steps
    if optim_cfg.schedule == "constant":
        if warmup <= 0:
            return optax.constant_schedule(lr)
        return optax.linear_schedule(0.0, lr, warmup)
    if optim_cfg.schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=lr,
            warmup_steps=warmup,
            decay_steps=max(optim_cfg.total_steps, warmup + 1),
            end_value=lr * optim_cfg.end_lr_fraction,
        )
    raise ValueError(f"unknown lr schedule {optim_cfg.schedule!r}")


def _decay_mask(params: Any) -> Any:
    """Weight decay on matrices, not on norm scales."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "norm" not in jax.tree_util.keystr(path), params
    )


def make_optimizer(
    optim_cfg: OptimConfig | Mapping[str, Any], schedule: optax.Schedule | None = None
) -> optax.GradientTransformation:
    """AdamW with global-norm gradient clipping and `make_lr_schedule`.

    Args:
      optim_cfg: an `OptimConfig`, or `config_lib.optim_config()` (made typed here).
      schedule: another learning-rate schedule (same optimizer state; default
        `make_lr_schedule(optim_cfg)`).

    Returns:
      An optax transformation.
    """
    optim_cfg = OptimConfig.from_config(optim_cfg)
    parts = []
    if optim_cfg.grad_clip_norm is not None:
        parts.append(optax.clip_by_global_norm(optim_cfg.grad_clip_norm))
    parts.append(
        optax.adamw(
            learning_rate=make_lr_schedule(optim_cfg) if schedule is None else schedule,
            b1=optim_cfg.b1,
            b2=optim_cfg.b2,
            eps=optim_cfg.eps,
            weight_decay=optim_cfg.weight_decay,
            mask=_decay_mask,
        )
    )
    return optax.chain(*parts)


def schedule_count(opt_state: Any) -> jax.Array:
    """Number of updates the optimizer has applied (the count its lr schedule sees)."""
    states = jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState)
    )
    counts = [s.count for s in states if isinstance(s, optax.ScaleByScheduleState)]
    return counts[0] if counts else jnp.zeros((), jnp.int32)


def train_state_shardings(
    model: nn.Module, optimizer: optax.GradientTransformation, mesh: Mesh, rules: sharding.Rules
) -> TrainState:
    """NamedShardings of a `TrainState`: params and their optimizer moments by the logical
    rules (optax maps the boxed params' metadata into its state), scalars replicated."""
    tokens = jnp.zeros((1, 8), jnp.int32)
    boxed = tracing.eval_shape(lambda k: model.init(k, tokens)["params"], jax.random.key(0))
    abstract = TrainState(
        params=boxed,
        opt_state=tracing.eval_shape(optimizer.init, boxed),
        step=jax.ShapeDtypeStruct((), jnp.int32),
        rng=tracing.eval_shape(lambda: jax.random.key(0)),
    )
    return sharding.logical_to_shardings(abstract, mesh, rules)


def abstract_train_state(
    model: nn.Module, optimizer: optax.GradientTransformation, mesh: Mesh, rules: sharding.Rules
) -> TrainState:
    """A `TrainState` of ShapeDtypeStructs with their shardings, nothing allocated: the target
    a checkpoint is restored into."""
    params = tracing.eval_shape(lambda k: init_params(model, k), jax.random.key(0))
    abstract = TrainState(
        params=params,
        opt_state=tracing.eval_shape(optimizer.init, params),
        step=jax.ShapeDtypeStruct((), jnp.int32),
        rng=tracing.eval_shape(lambda: jax.random.key(0)),
    )
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract,
        train_state_shardings(model, optimizer, mesh, rules),
    )


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
    elif jax.process_count() > 1:  # arrays on this host's devices cannot enter a global jit
        params = jax.tree.map(
            lambda x: np.asarray(x) if isinstance(x, jax.Array) and x.is_fully_addressable else x,
            params,
        )
    # Fresh buffers, never aliases of the caller's params (device_put may reuse a shard when
    # resharding): the step donates the state, which must not delete the caller's arrays.
    params = tracing.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings.params)(
        params
    )
    opt_state = tracing.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
    replicated = NamedSharding(mesh, PartitionSpec())
    # From host data: device_put cannot reach other hosts' devices.
    rng_data = np.asarray(jax.random.key_data(state_rng))
    return TrainState(
        params=params,
        opt_state=opt_state,
        step=multihost.from_host(replicated, np.zeros((), np.int32)),
        rng=jax.random.wrap_key_data(
            multihost.from_host(replicated, rng_data),
            impl=jax.random.key_impl(state_rng),
        ),
    )
