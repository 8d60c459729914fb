"""The programs `tg_jax.tpu.aot` compiles for a TPU topology, each lowered on abstract inputs
(`jax.ShapeDtypeStruct`s with their shardings: nothing runs and no weights exist): the real RL
train step (`compile_tg_train_step`), the LM baseline step (`compile_lm_train_step`), one step
of the sampler's decode loop (`compile_sample_step`); and the abstract params, batch and
published copy of the weights they take."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tg_jax import sharding, tracing
from tg_jax.models import ModelConfig, Transformer, hidden_states
from tg_jax.sampling import placement


def _fit(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """Drops mesh axes that do not divide their dimension (e.g. 4 KV heads on tensor=8)."""
    out = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=True):
        names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        kept = []
        for a in names:
            if dim % (math.prod(mesh.shape[k] for k in kept) * mesh.shape[a]) == 0:
                kept.append(a)
        out.append(tuple(kept) if len(kept) > 1 else (kept[0] if kept else None))
    return PartitionSpec(*out)


def _abstract(shape, dtype, mesh: Mesh, spec: PartitionSpec) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, _fit(spec, shape, mesh)))


def _with_shardings(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def abstract_params(model: Transformer, mesh: Mesh, rules: sharding.Rules) -> Any:
    boxed = tracing.eval_shape(
        lambda k: model.init(k, jnp.zeros((1, 8), jnp.int32))["params"], jax.random.key(0)
    )
    return _with_shardings(nn.unbox(boxed), sharding.logical_to_shardings(boxed, mesh, rules))


def _batch_spec(mesh: Mesh, rules: sharding.Rules, ndim: int) -> PartitionSpec:
    return sharding.data_sharding(mesh, rules, ndim).spec


@dataclasses.dataclass(frozen=True)
class TrainShapes:
    """Sizes of a train step's batch (see `tg_jax.rl.batch.Batch`)."""

    rows: int  # B: student rows, a multiple of the batch divisor x micro-batches
    seq_len: int  # T: student positions
    teacher_rows: int  # B_t
    teacher_len: int  # T_t
    prefix_len: int  # compact teacher rows: the student key/value slots the teacher sees


def abstract_tg_batch(
    shapes: TrainShapes,
    mesh: Mesh,
    rules: sharding.Rules,
    reqs=("req",),
    *,
    compact: bool = False,
    mode: str = "per_trajectory",
    routes: tuple[int, int] | None = None,
) -> Any:
    """An abstract `tg_jax.rl.batch.Batch` of `shapes`; compact: with the compact teacher
    rows' source rows, starts and prefix slots (`tg_jax.rl.tg.compact`); routes: (layers,
    experts per token) of the router-replay records (`model.router_replay`), int16 per student
    and teacher token (`tg_jax.rl.routing.batch_routes`)."""
    from tg_jax.rl.batch import Batch  # noqa: PLC0415 (the real step only)

    def a(shape, dtype):
        return _abstract(shape, dtype, mesh, _batch_spec(mesh, rules, len(shape)))

    s = functools.partial(a, (shapes.rows, shapes.seq_len))
    t = functools.partial(a, (shapes.teacher_rows, shapes.teacher_len))
    rows = functools.partial(a, (shapes.rows,))
    extra = {}
    if compact:
        extra = dict(
            teacher_src_row_Bt=a((shapes.teacher_rows,), jnp.int32),
            teacher_start_Bt=a((shapes.teacher_rows,), jnp.int32),
            teacher_compact=True,
            teacher_prefix_len=shapes.prefix_len,
        )
    if routes is not None:  # teacher rows' only with a teacher (`build_batch`, mode "none")
        extra["routes_BxTxLxJ"] = a((shapes.rows, shapes.seq_len, *routes), jnp.int16)
        teacher = (shapes.teacher_rows, shapes.teacher_len, *routes)
        if mode != "none":
            extra["teacher_routes_BtxTtxLxJ"] = a(teacher, jnp.int16)
    return Batch(
        tokens_BxT=s(jnp.int32),
        positions_BxT=s(jnp.int32),
        segment_ids_BxT=s(jnp.int32),
        targets_BxT=s(jnp.int32),
        loss_mask_BxT=s(jnp.bool_),
        answer_mask_BxT=s(jnp.bool_),
        thinking_mask_BxT=s(jnp.bool_),
        failed_turn_mask_BxT=s(jnp.bool_),
        unmet_turn_mask_BxT=s(jnp.bool_),
        tg_mask_BxT=s(jnp.bool_),
        requirement_ids_BxT=s(jnp.int32),
        turn_ids_BxT=s(jnp.int32),
        behaviour_logprobs_BxT=s(jnp.float32),
        teacher_row_BxT=s(jnp.int32),
        teacher_pos_BxT=s(jnp.int32),
        teacher_tokens_BtxTt=t(jnp.int32),
        teacher_positions_BtxTt=t(jnp.int32),
        teacher_segment_ids_BtxTt=t(jnp.int32),
        rewards={name: rows(jnp.float32) for name in ("task", *reqs)},
        group_ids_B=rows(jnp.int32),
        policy_version_B=rows(jnp.int32),
        valid_B=rows(jnp.bool_),
        requirement_names=tuple(reqs),
        teacher_mode=mode,
        **extra,
    )


def state_bytes(config: Any, mesh: Mesh, rules) -> int:
    """Bytes per device of what the trainer keeps on its chips between steps: the params and
    the optimizer's state (`TrainState` as `train_state_shardings` places it), and the frozen
    reference params where the step reads them (rl.kl_coef > 0, the reference teacher)."""
    from tg_jax.rl import train_state as tst  # noqa: PLC0415
    from tg_jax.rl.step_config import StepConfig  # noqa: PLC0415
    from tg_jax.tpu.hbm import bytes_per_device  # noqa: PLC0415

    model = Transformer(ModelConfig.from_config(config.model))
    state = tst.abstract_train_state(model, tst.make_optimizer(config.optim), mesh, rules)
    total = bytes_per_device((state.params, state.opt_state))
    if StepConfig.from_config(config).needs_reference:
        total += bytes_per_device(state.params)
    return total


def compile_tg_train_step(config: Any, mesh: Mesh, rules, shapes: TrainShapes):
    """The real RL train step as `tg_jax.train.rl` builds it (`make_train_step` on the
    trainer's mesh, the frozen reference params when rl.kl_coef > 0 or for the reference
    teacher), lowered on an abstract state and a batch laid out as `build_batch` lays it for
    the config (compact teacher rows when tg.compact_rows; no teacher rows for the GRPO arm,
    tg.enabled False)."""
    from tg_jax.rl import train_state as tst  # noqa: PLC0415
    from tg_jax.rl import train_step as ts  # noqa: PLC0415
    from tg_jax.rl.step_config import StepConfig  # noqa: PLC0415

    typed = StepConfig.from_config(config)

    cfg = ModelConfig.from_config(config.model)
    model = Transformer(cfg)
    step = ts.make_train_step(config, model, mesh, rules)
    optimizer = tst.make_optimizer(config.optim)
    state_sh = tst.train_state_shardings(model, optimizer, mesh, rules)
    boxed = tracing.eval_shape(
        lambda k: model.init(k, jnp.zeros((1, 8), jnp.int32))["params"], jax.random.key(0)
    )
    state = tst.TrainState(
        params=nn.unbox(boxed),
        opt_state=nn.unbox(tracing.eval_shape(optimizer.init, boxed)),
        step=jax.ShapeDtypeStruct((), jnp.int32),
        rng=tracing.eval_shape(lambda: jax.random.key(0)),
    )
    state = _with_shardings(state, state_sh)
    tg_on = bool(config.tg.enabled)
    if not tg_on:  # build_batch(mode="none"): one empty teacher token per row
        shapes = dataclasses.replace(shapes, teacher_rows=shapes.rows, teacher_len=1)
    reqs = tuple(config.env.requirements) if "env" in config else ("req",)
    batch = abstract_tg_batch(
        shapes,
        mesh,
        rules,
        reqs,
        compact=typed.tg.compact_rows,
        mode=str(config.tg.teacher_mode) if tg_on else "none",
        routes=(cfg.num_layers, cfg.experts_per_token) if cfg.router_replay else None,
    )
    args = (state, batch)
    if typed.needs_reference:
        args += (state.params,)
    with jax.set_mesh(mesh):
        return step.jitted.lower(*args).compile()


def compile_lm_train_step(config: Any, mesh: Mesh, rules, rows: int, seq_len: int, chunk: int):
    """Baseline step: next-token cross-entropy over [rows, seq_len] (logits in chunks of
    `chunk` positions, rematerialised) + AdamW, state donated."""
    model = Transformer(ModelConfig.from_config(config.model))
    params = abstract_params(model, mesh, rules)
    optimizer = optax.adamw(1e-5)
    with jax.set_mesh(mesh):
        init = tracing.jit(optimizer.init).lower(params).compile()
    opt_state = _with_shardings(tracing.eval_shape(optimizer.init, params), init.output_shardings)
    tokens = _abstract((rows, seq_len), jnp.int32, mesh, _batch_spec(mesh, rules, 2))

    def loss_fn(p, tokens_BxT):
        h_BxTxD = hidden_states(model, p, tokens_BxT)
        b, t, d = h_BxTxD.shape
        n = t // chunk
        h_NxBxCxD = h_BxTxD.reshape(b, n, chunk, d).swapaxes(0, 1)
        y_NxBxC = jnp.roll(tokens_BxT, -1, axis=1).reshape(b, n, chunk).swapaxes(0, 1)

        @jax.checkpoint
        def chunk_nll(h_BxCxD, y_BxC):
            logits = model.apply({"params": p}, h_BxCxD, method=Transformer.unembed)
            logp = jax.nn.log_softmax(logits)
            return -jnp.take_along_axis(logp, y_BxC[..., None], axis=-1).sum()

        def body(total, xs):
            return total + chunk_nll(*xs), None

        total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (h_NxBxCxD, y_NxBxC))
        return total / (b * t)

    def step(state, tokens_BxT):
        p, o = state
        with nn.logical_axis_rules(rules):
            loss, grads = jax.value_and_grad(loss_fn)(p, tokens_BxT)
        updates, o = optimizer.update(grads, o, p)
        return (optax.apply_updates(p, updates), o), loss

    state_sh = jax.tree.map(lambda x: x.sharding, (params, opt_state))
    jitted = tracing.jit(step, out_shardings=(state_sh, None), donate_argnums=0)
    with jax.set_mesh(mesh):
        return jitted.lower((params, opt_state), tokens).compile()


def in_dtype(tree: Any, dtype: str) -> Any:
    """Abstract params as `HostReplicas` publishes them (`placement.published_dtype`)."""
    compute = jnp.dtype(dtype)
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, placement.published_dtype(x.shape, x.dtype, compute), sharding=x.sharding
        ),
        tree,
    )


def compile_sample_step(
    config: Any,
    mesh: Mesh,
    rules,
    rows: int,
    cache_len: int,
    max_new: int,
    weights_dtype: str | None = None,
):
    """One step of the sampler's decode loop (`tg_jax.models.decode.decode_one`): one
    token for each of `rows` rows against a KV cache of `cache_len` slots, the last `max_new`
    of them for generated tokens; the cache is donated (updated in place). The step's weights
    are what the sampler feeds its loop (`decode_weights(params)` where that exists), its
    weight matrices in `weights_dtype` when given (per-host samplers), else param_dtype."""
    from tg_jax.models import decode  # noqa: PLC0415

    cfg = ModelConfig.from_config(config.model)
    model = Transformer(cfg)
    params = abstract_params(model, mesh, rules)
    if weights_dtype:
        params = in_dtype(params, weights_dtype)
    if hasattr(decode, "decode_weights"):
        # The sampler rearranges the params once per sampling call; a step takes the result.
        def prepare(p):
            with nn.logical_axis_rules(rules):
                return decode.decode_weights(model, p)

        with jax.set_mesh(mesh):
            prepared = tracing.jit(prepare).lower(params).compile()
        params = _with_shardings(tracing.eval_shape(prepare, params), prepared.output_shardings)
    # The cache as the sampler's own prefill makes it (its layout is the sampler's business):
    # per layer [B, K, ...] with rows over the data axes and KV heads over "kv_heads".
    rows_spec = _batch_spec(mesh, rules, 1)
    prompt = jax.ShapeDtypeStruct((rows, cache_len - max_new), jnp.int32)
    lengths = jax.ShapeDtypeStruct((rows,), jnp.int32)
    _, shapes = tracing.eval_shape(
        lambda p, t, n: decode.prefill(model, p, t, n, max_new, routes=cfg.router_replay),
        abstract_params(model, mesh, rules),
        prompt,
        lengths,
    )
    spec = nn.logical_to_mesh_axes(("batch", "kv_heads"), rules)
    cache = jax.tree.map(
        lambda x: _abstract(x.shape, x.dtype, mesh, PartitionSpec(*spec[: x.ndim])), shapes
    )
    cache = cache.replace(
        **{  # the RoPE tables are by position (no row axis): replicated
            name: _abstract(getattr(shapes, name).shape, jnp.float32, mesh, PartitionSpec())
            for name in ("rope_cos", "rope_sin")
        }
    )
    if shapes.routes is not None:  # by row only (no KV-head axis)
        cache = cache.replace(
            routes=_abstract(shapes.routes.shape, shapes.routes.dtype, mesh, PartitionSpec(spec[0]))
        )
    tokens = _abstract((rows,), jnp.int32, mesh, rows_spec)
    index = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))

    def step(p, tokens_B, i, c):
        with nn.logical_axis_rules(rules):
            logits_BxV, c = decode.decode_one(model, p, tokens_B, i, c)
        return jnp.argmax(logits_BxV, axis=-1), c

    cache_sh = jax.tree.map(lambda x: x.sharding, cache)
    jitted = tracing.jit(step, out_shardings=(None, cache_sh), donate_argnums=3)
    with jax.set_mesh(mesh):
        return jitted.lower(params, tokens, index, cache).compile()
