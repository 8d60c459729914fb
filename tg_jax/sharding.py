"""Meshes, logical-axis rules, and parameters created already sharded.

Choice of sharding mode: meshes use `AxisType.Auto` on every axis. Parameters and key
activations carry *logical* axis names ("batch", "embed", "heads", "mlp", "vocab", ...);
the config maps them to mesh axes ("data", "fsdp", "tensor", "expert"). The compiler
propagates shardings between the annotated points (GSPMD/Shardy auto mode), which is what
Flax's logical partitioning and MaxText-style rules are designed for. Explicit ("sharding in
types") mode would make every intermediate's sharding part of its type, which Flax linen's
logical constraints do not drive; we therefore choose Auto deliberately.

Typical use:

    mesh = make_mesh(config.mesh)
    rules = logical_rules(config.mesh)
    params, shardings = create_sharded_params(model, rng, mesh, rules)
    with activation_sharding(mesh, rules):
        logits = jitted_forward(params, tokens)

With a sampler on its own devices (`config.sampler_mesh.num_devices` > 0):

    trainer_devices, sampler_devices = split_devices(config)
    mesh = make_mesh(config.mesh, trainer_devices)
    sampler_mesh, sampler_rules = make_sampler_mesh(config.sampler_mesh, sampler_devices)
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from tg_jax import tracing
from tg_jax.mesh_settings import SamplerMeshConfig, check_sizes

Rules = tuple[tuple[str, Any], ...]

SAMPLER_AXES = ("data", "tensor")
# The sampler's logical->mesh rules: rows over "data", the tensor-parallel dims of the params
# and activations over "tensor"; every other logical axis (embed, head_dim, expert, ...) is
# replicated, so each data replica holds the whole model split `tensor` ways.
SAMPLER_RULES: Rules = (("batch", "data"),) + tuple(
    (name, "tensor") for name in ("heads", "kv_heads", "mlp", "moe_mlp", "vocab")
)


def resolve_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
    """Replaces one -1 entry by whatever makes the product equal `num_devices`."""
    shape = [int(s) for s in shape]
    check_sizes("mesh", tuple(shape))  # the sections' own check (mesh_settings)
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise ValueError(f"Mesh shape {shape} does not divide {num_devices} devices")
        shape[shape.index(-1)] = num_devices // known
    if math.prod(shape) != num_devices:
        raise ValueError(
            f"Mesh shape {tuple(shape)} needs {math.prod(shape)} devices, but {num_devices} "
            "are in use (set one axis to -1 to take the rest)"
        )
    return tuple(shape)


def make_mesh(mesh_config: Any, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Mesh from `config.mesh` (fields `axes` and `shape`), every axis in Auto mode."""
    devices = list(devices) if devices is not None else jax.devices()
    axes = tuple(mesh_config.axes)
    shape = resolve_mesh_shape(mesh_config.shape, len(devices))
    if len(axes) != len(shape):
        raise ValueError(f"mesh.axes {axes} and mesh.shape {shape} differ in length")
    types = (AxisType.Auto,) * len(axes)
    try:  # laid out along the chips' physical links
        return jax.make_mesh(shape, axes, axis_types=types, devices=devices)
    except AssertionError:  # TPU chips that form no box (each host's first chips of a split)
        return Mesh(np.asarray(devices, dtype=object).reshape(shape), axes, axis_types=types)


def split_devices(
    config: Any,
    devices: Sequence[jax.Device] | None = None,
    hosts: Sequence[Sequence[jax.Device]] | None = None,
) -> tuple[list[jax.Device], list[jax.Device] | None]:
    """(trainer's devices, sampler's devices or None) per `config.sampler_mesh`.

    num_devices 0 (or no sampler_mesh section) = colocated: every device is the trainer's and
    the sampler shares them (None). N > 0: every process (host) gives the last N / P of its
    devices to its sampler and the rest to the trainer, P the processes `devices` span (default
    `jax.devices()`; `hosts` groups them otherwise, e.g. a topology's for an ahead-of-time
    compile; one process: the last N devices are the sampler's). The trainer's mesh
    spans every process's trainer devices; each process samples on its own sampler devices
    (`tg_jax.sampling.placement`). `sampler_mesh.processes` H > 0 (the whole-host split):
    the last H processes' devices are the sampler's, the others' the trainer's
    (`_whole_hosts`).

    Raises:
      ValueError: N < 0; N not a multiple of P; N / P leaves a process no trainer device; a
        mesh shape that does not divide its devices; a sampler tensor axis that does not
        divide a process's trainer devices (the weights are staged split that way on them
        before the copy).
    """
    devices = list(devices) if devices is not None else jax.devices()
    cfg = _sampler_mesh(config)
    n = cfg.num_devices  # checked (>= 0, axes and shape of one length) by SamplerMeshConfig
    if n == 0 and cfg.processes == 0:
        return devices, None
    if hosts is None:
        by_process: dict[int, list[jax.Device]] = {}
        for d in devices:  # in the given order within a process
            by_process.setdefault(int(getattr(d, "process_index", 0)), []).append(d)
        hosts = [by_process[p] for p in sorted(by_process)]
    if cfg.processes:
        return _whole_hosts(config, cfg, hosts)
    if n % len(hosts):
        raise ValueError(
            f"sampler_mesh.num_devices={n} over {len(hosts)} processes: each process gives "
            f"as many of its devices to its sampler, so it must be a multiple of {len(hosts)}"
        )
    per = n // len(hosts)
    if any(per >= len(h) for h in hosts):
        where = (
            f"the {len(devices)} devices"
            if len(hosts) == 1
            else (f"each process's {min(len(h) for h in hosts)} devices ({per} per process)")
        )
        raise ValueError(
            f"sampler_mesh.num_devices={n} must be below {where}: the trainer needs at least one"
        )
    trainer = [d for h in hosts for d in h[:-per]]
    sampler = [d for h in hosts for d in h[-per:]]
    try:
        resolve_mesh_shape(config.mesh.shape, len(trainer))
    except ValueError as e:
        raise ValueError(f"mesh over the trainer's {len(trainer)} devices: {e}") from None
    try:
        shape = resolve_mesh_shape(cfg.shape, per)
    except ValueError as e:
        what = f"its {per} devices" + ("" if len(hosts) == 1 else " per process")
        raise ValueError(f"sampler_mesh over {what}: {e}") from None
    tensor = dict(zip(cfg.axes, shape, strict=True)).get("tensor", 1)
    local_trainer = len(hosts[0]) - per
    if local_trainer % tensor:
        raise ValueError(
            f"sampler_mesh tensor axis {tensor} does not divide the trainer's {local_trainer} "
            "devices"
            + ("" if len(hosts) == 1 else " per process")
            + " (the published weights are split that way on them first)"
        )
    return trainer, sampler


MIN_TRAINER_PROCESSES = 2


def _sampler_mesh(config: Any) -> SamplerMeshConfig:
    """`config.sampler_mesh` checked (its defaults without the section)."""
    section = config.get("sampler_mesh")
    return SamplerMeshConfig.from_config(section) if section is not None else SamplerMeshConfig()


def _whole_hosts(
    config: Any, cfg: SamplerMeshConfig, hosts: Sequence[Sequence[jax.Device]]
) -> tuple[list[jax.Device], list[jax.Device]]:
    """`split_devices` of the whole-host split: the last `cfg.processes` hosts sample.

    Raises:
      ValueError: fewer than MIN_TRAINER_PROCESSES trainer processes (orbax cannot checkpoint
        arrays that one process of several holds whole) or no sampler process left; a mesh
        shape that does not divide its devices; more sampler devices than trainer devices
        (the weights are staged on as many trainer devices as the samplers have, then copied
        across); a sampler tensor axis that does not divide the trainer's devices.
    """
    h, p = cfg.processes, len(hosts)
    if p - h < MIN_TRAINER_PROCESSES:
        raise ValueError(
            f"sampler_mesh.processes={h} of {p} processes: the whole-host split needs at least "
            f"{MIN_TRAINER_PROCESSES} trainer processes besides the sampler's (orbax checkpoints "
            "no array that one process of several holds whole); use num_devices for a share of "
            "every process instead"
        )
    trainer = [d for host in hosts[: p - h] for d in host]
    sampler = [d for host in hosts[p - h :] for d in host]
    try:
        resolve_mesh_shape(config.mesh.shape, len(trainer))
    except ValueError as e:
        raise ValueError(f"mesh over the trainer processes' {len(trainer)} devices: {e}") from None
    per = len(hosts[-1])
    try:
        shape = resolve_mesh_shape(cfg.shape, per)
    except ValueError as e:
        raise ValueError(f"sampler_mesh over a sampler process's {per} devices: {e}") from None
    tensor = dict(zip(cfg.axes, shape, strict=True)).get("tensor", 1)
    if len(sampler) > len(trainer) or len(trainer) % tensor:
        raise ValueError(
            f"sampler_mesh.processes={h}: the {len(sampler)} sampler devices must be at most "
            f"the trainer's {len(trainer)}, and the tensor axis {tensor} must divide those "
            "(the published weights are staged on as many trainer devices, split that way)"
        )
    return trainer, sampler


def every_device_mesh(config: Any, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """`config.mesh` over every device (default `jax.devices()`): as given, but under the
    whole-host split (whose `mesh.shape` is the trainer's) with its "fsdp" axis taking the
    rest (any other -1 axis 1), the mesh the stages after RL hold the state on
    (`tg_jax.train.rl_hosts.full_state`).

    Raises:
      ValueError: the mesh has no "fsdp" axis, or its other axes do not divide the devices.
    """
    if not _sampler_mesh(config).processes:
        return make_mesh(config.mesh, devices)
    axes = tuple(config.mesh.axes)
    if "fsdp" not in axes:
        raise ValueError(f"mesh.axes {axes} have no 'fsdp' axis to spread over every device")
    shape = tuple(
        -1 if a == "fsdp" else max(int(n), 1) for a, n in zip(axes, config.mesh.shape, strict=True)
    )
    try:
        return make_mesh(types.SimpleNamespace(axes=axes, shape=shape), devices)
    except ValueError as e:
        raise ValueError(f"the mesh over every device after RL (fsdp the rest): {e}") from None


def sampler_processes(config: Any, count: int | None = None) -> tuple[int, ...]:
    """The processes that roll out: the last `sampler_mesh.processes` ones under the
    whole-host split, else all (`count`: the process count, default jax's)."""
    count = jax.process_count() if count is None else int(count)
    h = _sampler_mesh(config).processes
    return tuple(range(count - h if h else 0, count))


def make_sampler_mesh(sampler_mesh_cfg: Any, devices: Sequence[jax.Device]) -> tuple[Mesh, Rules]:
    """(mesh, logical rules) of a sampler on `devices`: `config.sampler_mesh`'s ("data",
    "tensor") mesh, rows over "data", heads / kv_heads / mlp / vocab over "tensor"."""
    axes = tuple(sampler_mesh_cfg.axes)
    if axes != SAMPLER_AXES:
        raise ValueError(f"sampler_mesh.axes must be {SAMPLER_AXES}, got {axes}")
    return make_mesh(sampler_mesh_cfg, devices), SAMPLER_RULES


def logical_rules(mesh_config: Any) -> Rules:
    """The logical->mesh axis rules from `config.mesh.rules` as a tuple of pairs."""
    rules = []
    for item in mesh_config.rules:
        if len(item) != 2:
            raise ValueError(f"Each logical axis rule is (logical_name, mesh_axes), got {item!r}")
        name, target = item
        if isinstance(target, list):
            target = tuple(target)
        rules.append((str(name), target))
    return tuple(rules)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Rules):
    """Context in which the model's logical activation constraints take effect."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


def logical_to_shardings(abstract_boxed: Any, mesh: Mesh, rules: Rules) -> Any:
    """NamedShardings for a pytree of `nn.Partitioned` (or plain) abstract leaves, each
    dimension split only over the mesh axes that divide it (`fit_spec`)."""
    specs = nn.get_partition_spec(abstract_boxed)
    shardings = nn.logical_to_mesh_sharding(specs, mesh, rules)
    shapes = jax.tree.map(_shape, nn.unbox(abstract_boxed))
    return jax.tree.map(
        lambda s, shape: NamedSharding(
            mesh, fit_spec(s.spec, shape, mesh), memory_kind=s.memory_kind
        ),
        shardings,
        shapes,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(getattr(x, "shape", ()))


def _axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def fit_spec(spec: PartitionSpec, shape: Sequence[int], mesh: Any) -> PartitionSpec:
    """`spec` with each dimension split over the longest prefix of its mesh axes whose sizes'
    product divides it: a dimension that does not divide its mesh axis (a vocabulary of
    50,257 over "tensor" 2, 6 KV heads over "tensor" 4) is replicated over that axis instead
    of failing in JAX (`IndivisibleError`). The same rule in every program (trainer, sampler
    copy, engine), since they all take their shardings from `logical_to_shardings`;
    docs/tpu.md. `mesh`: a Mesh or its axis sizes (name -> size)."""
    sizes = mesh.shape if isinstance(mesh, Mesh) else mesh
    out = []
    for i, entry in enumerate(spec):
        kept: tuple[str, ...] = ()
        for a in _axes(entry):
            if shape[i] % (math.prod(sizes.get(x, 1) for x in kept) * sizes.get(a, 1)):
                break
            kept += (a,)
        if kept == _axes(entry):
            out.append(entry)  # as the rules give it
        else:
            out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*out)


def unfit_dims(
    abstract_boxed: Any, mesh: Any, rules: Rules
) -> list[tuple[str, int, int, tuple[str, ...], tuple[str, ...]]]:
    """(leaf path, dimension, its size, the mesh axes the rules give it, the axes kept) of
    every dimension `fit_spec` does not split as the rules ask, in tree order (`mesh`: a Mesh
    or its axis sizes)."""
    out = []
    flat = jax.tree_util.tree_leaves_with_path(
        abstract_boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned)
    )
    for path, leaf in flat:
        if not isinstance(leaf, nn.Partitioned):
            continue
        shape = tuple(leaf.value.shape)
        spec = PartitionSpec(*nn.logical_to_mesh_axes(leaf.names, rules))
        fitted = fit_spec(spec, shape, mesh)
        for i, entry in enumerate(spec):
            if _axes(entry) != _axes(fitted[i]):
                key = jax.tree_util.keystr(path)
                out.append((key, i, int(shape[i]), _axes(entry), _axes(fitted[i])))
    return out


def create_sharded_params(
    model: nn.Module,
    rng: jax.Array,
    mesh: Mesh,
    rules: Rules,
    *,
    example_tokens: jax.Array | None = None,
    check: bool = True,
) -> tuple[Any, Any]:
    """Initialises params directly into their shardings (no full copy on one device).

    eval_shape gives the abstract, logically-annotated tree; the rules turn it into
    NamedShardings; a jitted init with those `out_shardings` materialises each shard where
    it belongs. Returns (params, shardings), both without metadata boxes.
    """
    tokens = example_tokens if example_tokens is not None else jnp.zeros((1, 8), jnp.int32)

    def init(key):
        return model.init(key, tokens)["params"]

    abstract = tracing.eval_shape(init, rng)
    shardings = logical_to_shardings(abstract, mesh, rules)
    with activation_sharding(mesh, rules):
        params = tracing.jit(lambda k: nn.unbox(init(k)), out_shardings=shardings)(rng)
    if check:
        check_params_sharded(params, mesh)
    return params, shardings


def param_partition_specs(model: nn.Module, mesh: Mesh, rules: Rules) -> Any:
    """Shardings of the model's params without initialising anything."""
    tokens = jnp.zeros((1, 8), jnp.int32)
    abstract = tracing.eval_shape(lambda k: model.init(k, tokens)["params"], jax.random.key(0))
    return logical_to_shardings(abstract, mesh, rules)


def check_params_sharded(params: Any, mesh: Mesh, min_size: int = 2**20) -> None:
    """Fails loudly when a large parameter is fully replicated on a multi-device mesh.

    A param of at least `min_size` elements must be split along some mesh axis of size > 1
    (when the mesh has any). Replicating large weights silently costs a full copy per chip.
    """
    if mesh.size == 1:
        return
    bad = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if not hasattr(leaf, "sharding") or leaf.size < min_size:
            continue
        sharding = leaf.sharding
        if isinstance(sharding, NamedSharding) and all(p is None for p in sharding.spec):
            bad.append(f"{jax.tree_util.keystr(path)} {tuple(leaf.shape)}")
        elif not isinstance(sharding, NamedSharding) and sharding.is_fully_replicated:
            bad.append(f"{jax.tree_util.keystr(path)} {tuple(leaf.shape)}")
    if bad:
        raise ValueError(
            "Large parameters are fully replicated on a mesh of "
            f"{dict(mesh.shape)}: {bad}. Check config.mesh.rules covers their logical axes."
        )


def data_sharding(mesh: Mesh, rules: Rules, ndim: int = 2) -> NamedSharding:
    """Sharding of a [batch, length, ...] input: batch over the rule for 'batch'."""
    spec = nn.logical_to_mesh_axes(("batch",) + (None,) * (ndim - 1), rules)
    return NamedSharding(mesh, PartitionSpec(*spec))


def batch_divisor(mesh: Mesh, rules: Rules) -> int:
    """How many ways the batch dimension is split: batch sizes must be multiples of this."""
    spec = nn.logical_to_mesh_axes(("batch",), rules)[0]
    if spec is None:
        return 1
    axes = (spec,) if isinstance(spec, str) else spec
    return int(np.prod([mesh.shape[a] for a in axes]))
