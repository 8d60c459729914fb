"""Does a config fit a TPU slice? Compile its steps ahead of time on a CPU host and read memory.

    python -m tg_jax.tpu.aot --config=configs/qwen3_coder_30b_a3b_tg.py --topology=v5p:2x4x4 \
        [--config.model.hf_checkpoint=configs/hf/qwen3_coder_30b_a3b] [--config.a.b=v]

libtpu describes any TPU topology without the hardware (`jax.experimental.topologies`); a mesh
over those devices, abstract inputs (`jax.ShapeDtypeStruct` with their shardings) and
`jax.jit(...).lower(...).compile()` give the real XLA:TPU executable, whose
`memory_analysis()` is the per-chip HBM it needs: arguments + outputs - donated aliases +
temporaries + code. Nothing runs and no weights exist; only libtpu must be importable (the
`aot` extra: `pip install -e .[aot]`).

The architecture is the config's, or that of `model.hf_checkpoint`'s config.json (only that
file is read; configs/hf/ has the published ones of the Qwen3 checkpoints the qwen3 configs
are for). Two programs are compiled:
* train: the real RL train step as `tg_jax.train.rl` builds it (`make_train_step`, RL from the
  checkpoint's params) on the largest batch `build_batch` makes for the config (`train_shapes`:
  `--train_rows` student rows of `--seq_len` tokens; `--teacher_rows` teacher rows of
  `--teacher_len`, compact ones with `--prefix_len` student key/value slots when
  tg.compact), with `config.rl.micro_batches`; or, with `--step=lm`, a next-token loss +
  AdamW step of the same student shapes (no teacher), the baseline.
* sample: one step of the sampler's decode loop (`tg_jax.models.decode.decode_one`)
  for `--decode_rows` rows with a KV cache of `--cache_len` slots (prompt + generated).

With `config.sampler_mesh.num_devices = N > 0` the train step compiles over the first
(total - N) devices (config.mesh) and the sample step over the last N (the sampler's
("data", "tensor") mesh, `config.sampler_mesh.shape`); otherwise both over all devices.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import re
import types
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from ml_collections import config_flags

from tg_jax import config_files, paths, sharding, tracing
from tg_jax.models import ModelConfig, Transformer, hf_dir, hidden_states
from tg_jax.models.hf_io import model_config_from_hf
from tg_jax.sampling import placement
from tg_jax.tpu.hbm import bytes_per_device, hbm_bytes_per_device, memory_report


def topology_devices(topology: str) -> list[jax.Device]:
    """The devices of a TPU topology such as "v5p:2x4x4" (libtpu, no hardware needed)."""
    from jax.experimental import topologies  # noqa: PLC0415 (needs libtpu)

    # Off a TPU VM libtpu cannot discover worker hostnames; AOT does not need them. Nor does
    # it hold a chip: several compiles may run at once (libtpu's lockfile is for chips).
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return list(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)


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


def _in_dtype(tree: Any, dtype: str) -> Any:
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
        params = _in_dtype(params, weights_dtype)
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


# ---------------------------------------------------------------------------------------------
# A config's architecture, meshes and shapes.
# ---------------------------------------------------------------------------------------------


def resolve_architecture(config: Any) -> Any:
    """`config` with the architecture of `model.hf_checkpoint`'s config.json when one is set
    (only that file is read: no weights, no tokenizer; fields the config sets are checked
    against it, as `hf_dir.resolve_config` does). configs/hf/<model>/config.json are the
    published files of the Qwen3 checkpoints the configs/qwen3_*.py configs are for."""
    ckpt = config.model.get("hf_checkpoint")
    if ckpt:
        hf = paths.read_json(paths.as_path(ckpt) / hf_dir.CONFIG_FILE)
        md = types.SimpleNamespace(path=str(ckpt), architecture=model_config_from_hf(hf))
        fields = hf_dir.resolve_model_section(config.model, md)
        config = config_files.apply_overrides(config, {f"model.{k}": v for k, v in fields.items()})
    unset = [name for name in hf_dir.ARCHITECTURE_FIELDS if config.model.get(name) is None]
    if unset:
        raise ValueError(
            f"model.{unset[0]} (and {len(unset) - 1} more) unset: pass "
            "--config.model.hf_checkpoint=DIR, a directory with the checkpoint's config.json "
            "(e.g. configs/hf/qwen3_1p7b)"
        )
    return config


@dataclasses.dataclass(frozen=True)
class Meshes:
    """The trainer's mesh and rules, and the sampler's: the trainer's when colocated on one
    host; with several hosts, one host's sampler mesh (`placement.HostReplicas`: every host
    samples on its own chips, or its `sampler_mesh.num_devices / hosts` chips of its own, with
    its own bf16 copy); with `sampler_mesh.num_devices` on one host, the sampler's devices."""

    trainer: Mesh
    trainer_rules: Any
    sampler: Mesh
    sampler_rules: Any
    hosts: int = 1  # hosts (processes) of the slice; > 1: per-host samplers
    own: bool = False  # the sampler has devices of its own (`sharding.split_devices`)
    samplers: int = 1  # the hosts a step's rows are shared over (the whole-host split's last)

    @property
    def split(self) -> bool:
        return self.own and self.hosts == 1

    @property
    def per_host(self) -> bool:
        return self.hosts > 1


def make_meshes(
    config: Any, devices: Sequence[Any], hosts: Sequence[Sequence[Any]] | None = None
) -> Meshes:
    """The meshes of `config` over `devices` as a run places them (`sharding.split_devices`:
    with config.sampler_mesh.num_devices = N > 0 the last N / hosts of each host are the
    sampler's), with several hosts (`hosts`, default `devices` by process) one host's."""
    hosts = placement.devices_by_process(devices) if hosts is None else hosts
    trainer_devices, sampler_devices = sharding.split_devices(config, devices, hosts)
    mesh = sharding.make_mesh(config.mesh, trainer_devices)
    rules = sharding.logical_rules(config.mesh)
    own = sampler_devices is not None
    sampling = [h for h in hosts if not own or any(d in sampler_devices for d in h)]
    first = [d for d in sampling[0] if d in sampler_devices] if own else hosts[0]
    if len(hosts) > 1 or own:
        sampler, sampler_rules = sharding.make_sampler_mesh(
            config.sampler_mesh, first if len(hosts) > 1 else sampler_devices
        )
        return Meshes(mesh, rules, sampler, sampler_rules, len(hosts), own, len(sampling))
    return Meshes(mesh, rules, mesh, rules, samplers=1)


def train_shapes(config: Any, divisor: int, **given: int) -> TrainShapes:
    """The largest batch `build_batch` makes for `config` (a field of `given` that is > 0
    replaces its default): B = groups x rollouts padded as build_batch pads it; T =
    rl_loop.seq_len; B_t = B (per_trajectory: at most a row per trajectory) or
    tg.max_teacher_rows (per_turn); T_t = model.max_seq_len (a hinted sequence's limit);
    prefix = T (compact rows starting at the last student position)."""
    from tg_jax.rl.batch import num_rows  # noqa: PLC0415

    micro = int(config.rl.micro_batches) if "rl" in config else 1
    rows = num_rows(given.get("rows") or _config_rows(config), divisor, micro)
    seq_len = given.get("seq_len") or _config_seq_len(config)
    per_turn = "tg" in config and str(config.tg.teacher_mode) == "per_turn"
    teacher_rows = given.get("teacher_rows") or (
        int(config.tg.max_teacher_rows) if per_turn else rows
    )
    return TrainShapes(
        rows,
        seq_len,
        teacher_rows,
        given.get("teacher_len") or int(config.model.max_seq_len),
        given.get("prefix_len") or seq_len,
    )


def _config_rows(config: Any) -> int:
    """Rows of one train step: groups x rollouts per group (x turns with hidden thinking)."""
    for name in config.keys():
        s = config[name]
        if hasattr(s, "get") and s.get("groups_per_step") and s.get("rollouts_per_group"):
            rows = int(s.groups_per_step) * int(s.rollouts_per_group)
            from tg_jax.rl import hidden_thinking  # noqa: PLC0415 (as the train step's)

            return rows * hidden_thinking.rows_per_episode(config)
    raise ValueError("No groups_per_step / rollouts_per_group in the config: pass --train_rows")


def _config_seq_len(config: Any) -> int:
    """The padded student length: a section's `seq_len` when set, else model.max_seq_len."""
    for name in config.keys():
        s = config[name]
        if hasattr(s, "get") and s.get("seq_len"):
            return int(s.seq_len)
    return int(config.model.max_seq_len)


def _config_max_new(config: Any) -> int:
    """Generated-token slots of the decode cache: the config's decode budget per turn."""
    for name in config.keys():
        s = config[name]
        if hasattr(s, "get") and s.get("max_new_tokens"):
            return int(s.max_new_tokens)
    return 256


def compile_programs(
    config: Any,
    devices: Sequence[Any],
    what: Sequence[str],
    *,
    step: str = "tg",
    chunk: int = 512,
    decode_rows: int = 0,
    cache_len: int = 0,
    hosts: Sequence[Sequence[Any]] | None = None,
    **given: int,
) -> Iterator[Program]:
    """The `Program` of each of `what` ("train", "sample", "engine") for `config` on
    `devices`: the train step on the trainer's mesh, the sample step on the sampler's
    (`make_meshes`; with several hosts, one host's share of the rows with its bf16 copy of
    the weights); `given` = `train_shapes` overrides."""
    config = resolve_architecture(config)
    meshes = make_meshes(config, devices, hosts)
    mesh, rules = meshes.trainer, meshes.trainer_rules
    shapes = train_shapes(config, sharding.batch_divisor(mesh, rules), **given)
    micro = int(config.rl.micro_batches) if "rl" in config else 1
    logging.info("meshes %s; batch %s", meshes, shapes)
    for name in what:
        if name == "train" and step == "tg":
            compiled = compile_tg_train_step(config, mesh, rules, shapes)
            label = f"train step (TG, {micro} micro-batches of {shapes.rows // micro} rows)"
        elif name == "train":
            compiled = compile_lm_train_step(
                config, mesh, rules, shapes.rows, shapes.seq_len, chunk
            )
            label = f"train step (LM baseline, {shapes.rows} rows)"
        elif name == "sample":
            drows = decode_rows or _sampler_call_rows(config, shapes.rows, meshes.samplers)
            cache = cache_len or shapes.seq_len
            max_new = min(_config_max_new(config), cache // 2)
            compiled = compile_sample_step(
                config,
                meshes.sampler,
                meshes.sampler_rules,
                drows,
                cache,
                max_new,
                weights_dtype=config.model.dtype if meshes.per_host else None,
            )
            label = f"sample step ({drows} rows, cache {cache})"
        elif name == "engine":
            yield _engine_program(config, meshes, shapes)
            continue
        else:
            raise ValueError(f"unknown program {name!r} (train, sample, engine)")
        yield Program(
            label,
            compiled,
            meshes.trainer if name == "train" else meshes.sampler,
            _resident(config, meshes, name),
        )


def _engine_program(config: Any, meshes: Meshes, shapes: TrainShapes) -> Program:
    """The built-in engine's decode call (`tg_jax.tpu.engine_fit`) on a host's sampler
    devices; beside it: the trainer's params and AdamW moments where the engine shares the
    trainer's chips on one host, else what `_resident` puts beside a sampler and the published
    copy its weights were made from."""
    from tg_jax.engine import paged  # noqa: PLC0415
    from tg_jax.tpu import engine_fit  # noqa: PLC0415

    model = Transformer(ModelConfig.from_config(config.model))
    g = engine_fit.engine_shape(config, shapes.rows, meshes.samplers, shapes.seq_len)
    mesh = engine_fit.engine_mesh(config, meshes.sampler)
    params = abstract_params(model, mesh, sharding.SAMPLER_RULES)
    if meshes.per_host:  # a host's bf16 copy (colocated on one host: the trainer's params)
        params = _in_dtype(params, config.model.dtype)
    compiled = engine_fit.compile_engine_step(config, mesh, g, params)
    if meshes.per_host or meshes.split:
        # + the published copy the engine's weights come from, less what they hold of it.
        outside = bytes_per_device(params) - bytes_per_device(paged.kept_params(model, params))
        resident = _resident(config, meshes, "sample") + outside
    else:  # colocated: the trainer's params (published as they are) and AdamW moments
        trainer_params = abstract_params(model, meshes.trainer, meshes.trainer_rules)
        resident = 3 * bytes_per_device(trainer_params)
    label = (
        f"engine decode call ({g.slots} slots, {g.num_pages - 1} pages of {g.page_size} "
        f"tokens, tables {g.width} pages, {g.steps} token(s) a call)"
    )
    return Program(label, compiled, mesh, resident)


def _sampler_call_rows(config: Any, rows: int, hosts: int) -> int:
    """Rows of one sampler call as a run makes them: a host's share of the step's rows,
    at most `sampler_mesh.max_rows` (when set)."""
    share = -(-rows // hosts)
    cap = int(config.sampler_mesh.get("max_rows", 0)) if "sampler_mesh" in config else 0
    return min(share, cap) if cap else share


def _resident(config: Any, meshes: Meshes, program: str) -> int:
    """Bytes per device that stay beside a program outside it. Split layout
    (`tg_jax.sampling.placement.WeightPublisher`): the published params (param_dtype), the
    sampler's own copy beside the decode step, the staged copy (the sampler's specs on the
    trainer's devices) beside the next train step. Per-host samplers (`HostReplicas`): the
    host's bf16 copy (staged on its trainer chips) beside the train step; beside the decode
    step the trainer's params and AdamW moments (colocated) or the next bf16 copy arriving (on
    chips of its own). 0 when colocated on one host."""
    model = Transformer(ModelConfig.from_config(config.model))
    if not meshes.per_host and not meshes.split:
        return 0
    mesh = meshes.sampler
    if program == "train" and meshes.own:  # the staged copy: sampler specs on trainer chips
        tensor = int(meshes.sampler.shape.get("tensor", 1))
        devices = np.asarray(list(meshes.trainer.devices.flat)).reshape(-1, tensor)
        mesh = Mesh(devices, ("data", "tensor"))
    if meshes.per_host and program != "train" and not meshes.own:
        return 3 * bytes_per_device(abstract_params(model, meshes.trainer, meshes.trainer_rules))
    params = abstract_params(model, mesh, meshes.sampler_rules)
    return bytes_per_device(_in_dtype(params, config.model.dtype) if meshes.per_host else params)


class Program(NamedTuple):
    """A compiled program of `compile_programs`."""

    name: str
    compiled: Any
    mesh: Mesh
    resident: int  # bytes per device that stay on its devices outside it (`MemoryReport`)


def _define_flags() -> dict[str, Any]:
    """The command line's flags, defined only when this module runs as a program (tg_jax.main,
    which imports it for its fit check, has a --config flag of its own)."""
    return {
        "config": config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py)."),
        "topology": flags.DEFINE_string(
            "topology", "v5p:2x2x2", "TPU topology, e.g. v5p:2x4x4, v5e:4x4."
        ),
        "what": flags.DEFINE_list(
            "what", ["train", "sample"], "Programs to compile: train, sample, engine."
        ),
        "step": flags.DEFINE_enum(
            "step", "tg", ["tg", "lm"], "Train step: the real TG step or the LM baseline."
        ),
        "rows": flags.DEFINE_integer("train_rows", 0, "Student rows per train step; 0 = config."),
        "seq_len": flags.DEFINE_integer("seq_len", 0, "Student tokens per row; 0 = config."),
        "teacher_rows": flags.DEFINE_integer("teacher_rows", 0, "Teacher rows; 0 = the most."),
        "teacher_len": flags.DEFINE_integer(
            "teacher_len", 0, "Teacher tokens per row; 0 = model.max_seq_len."
        ),
        "prefix_len": flags.DEFINE_integer("prefix_len", 0, "Compact rows' prefix; 0 = seq_len."),
        "decode_rows": flags.DEFINE_integer(
            "decode_rows",
            0,
            "Rows per decode step; 0 = sampler_mesh.max_rows, else the train rows.",
        ),
        "cache_len": flags.DEFINE_integer("cache_len", 0, "KV-cache slots; 0 = the seq_len."),
        "chunk": flags.DEFINE_integer("chunk", 512, "Positions per logits chunk (LM baseline)."),
    }


_FLAGS: dict[str, Any] = {}


def main(argv: Sequence[str]) -> None:
    del argv
    f = {name: flag.value for name, flag in _FLAGS.items()}
    topology = f["topology"]
    if not re.fullmatch(r"v\w+:\d+(x\d+)*", topology):
        raise app.UsageError(f"--topology must look like v5p:2x4x4, got {topology!r}")
    devices = topology_devices(topology)
    hbm = hbm_bytes_per_device(topology, len(devices))
    print(f"topology {topology}: {len(devices)} devices {devices[0].device_kind}", flush=True)
    programs = compile_programs(
        f["config"],
        devices,
        f["what"],
        step=f["step"],
        chunk=f["chunk"],
        decode_rows=f["decode_rows"],
        cache_len=f["cache_len"],
        rows=f["rows"],
        seq_len=f["seq_len"],
        teacher_rows=f["teacher_rows"],
        teacher_len=f["teacher_len"],
        prefix_len=f["prefix_len"],
    )
    for p in programs:
        print(f"{p.name} on mesh {dict(p.mesh.shape)}", flush=True)
        print(memory_report(p.compiled, p.name, hbm, p.resident).format(), flush=True)


if __name__ == "__main__":
    _FLAGS.update(_define_flags())
    flags.mark_flags_as_required(["config"])
    app.run(main)
