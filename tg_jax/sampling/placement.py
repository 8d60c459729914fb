"""Where the rollout sampler runs, and how the trainer's weights get there.

Four placements (`rollout_sampler` picks one):

  colocated     one process, `config.sampler_mesh.num_devices == 0`: the sampler runs on the
                trainer's mesh with the trainer's params (no copy but the loop's own).
  own mesh      one process, num_devices N > 0: the sampler has the last N devices, on a
                ("data", "tensor") mesh (`sharding.make_sampler_mesh`), and the trainer's mesh
                covers the rest. Each published policy is resharded onto the sampler's
                shardings by a `WeightPublisher`, device to device, its weight matrices in
                the compute dtype (bf16 on TPU), as every placement's sampler copy.
  per process   several processes (`jax.distributed`): each samples its own share of the
                groups on its own devices, on `config.sampler_mesh`'s ("data", "tensor")
                mesh of them. A `HostReplicas` gives every process its copy of each
                published policy: the weight matrices in the compute dtype (bf16 on TPU),
                split `tensor` ways over the process's chips, never a full fp32 copy per chip.
                With num_devices N > 0 each process samples on the last N / P of its devices
                and trains on the rest (one trainer mesh over every process's); its copy is
                staged on its trainer devices and moved to its sampler devices within the
                process, device to device.
  whole hosts   several processes, `sampler_mesh.processes` H > 0: the last H processes
                sample on all their devices and the others train; a `HostTransfer` stages
                each published policy on the trainer's devices and copies it to the sampler
                processes' devices across processes, device to device.

The publisher, in two steps that both stay on devices:

    trainer params (e.g. FSDP over the trainer's devices)
      -- jit on the trainer's devices -->  staged: the sampler's PartitionSpecs on a
                                           (n_trainer / T, T) mesh of the trainer's devices
      -- jax.device_put -->                the sampler's NamedShardings: every sampler
                                           device's shard exists on a trainer device, so
                                           each is one device-to-device copy

(a plain device_put straight from the trainer's sharding would fetch to the host whenever no
trainer shard equals a sampler shard). The staging gather is dispatched in the trainer's thread
(its next step queues behind it); the copy waits for the staged arrays, so the sampling loop
makes it in its own thread, between batches, once they are computed
(`tg_jax.sampling.loop.SamplingLoop`'s two-step `place`): publishing never blocks the
trainer, and the sampler keeps sampling with the previous policy until the new one is there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from tg_jax import sharding, tracing
from tg_jax.sampling.sampler import Sampler


class WeightPublisher:
    """Trainer params -> the same params on the sampler's mesh (new buffers, device to device),
    the weight matrices in the model's compute dtype (`published_dtype`: bf16 on TPU), as
    every other placement publishes them: the staged and the sampler's copies are half the
    fp32 params' bytes, and the sampler computes exactly what it would from fp32 weights
    (its matmuls cast them to the compute dtype anyway).

    Attributes:
      shardings: the sampler's NamedShardings of the params (a pytree like the params).
      staging: the same PartitionSpecs on a mesh of the trainer's devices.
    """

    def __init__(self, model: nn.Module, shardings: Any, trainer_devices: Sequence[jax.Device]):
        """Args:
        model: the policy (its compute dtype).
        shardings: the params' NamedShardings on the sampler's ("data", "tensor") mesh.
        trainer_devices: the devices the trainer's params live on.
        """
        self.shardings = shardings
        leaves = jax.tree.leaves(shardings)
        target = leaves[0].mesh
        tensor = int(target.shape.get("tensor", 1))
        devices = np.asarray(list(trainer_devices))
        if devices.size % tensor:
            raise ValueError(f"tensor axis {tensor} does not divide {devices.size} trainer devices")
        staging_mesh = Mesh(devices.reshape(-1, tensor), ("data", "tensor"))
        self.staging = jax.tree.map(lambda s: NamedSharding(staging_mesh, s.spec), shardings)
        # A copy, never the input buffer itself: the train step donates the params it is given.
        self._stage = _published_copy(model, self.staging)

    def stage(self, params: Any) -> Any:
        """Step 1, in the trainer's thread: new buffers in the staging layout (dispatched)."""
        return self._stage(params)

    def copy(self, staged: Any) -> Any:
        """Step 2: the sampler's copy of `stage`'s output (waits for it to be computed, then
        dispatches the device-to-device copies)."""
        return jax.device_put(staged, self.shardings)

    def __call__(self, params: Any) -> Any:
        """Both steps: the sampler's copy of `params`."""
        return self.copy(self.stage(params))


def published_dtype(shape: Sequence[int], dtype: Any, compute: Any) -> Any:
    """The dtype a sampler's own copy holds a param leaf in: weight matrices (2+ dims,
    floating) in the compute dtype, the rest (norm scales) as they are."""
    return compute if len(shape) >= 2 and jnp.issubdtype(dtype, jnp.floating) else dtype


def _published_copy(model: nn.Module, out_shardings: Any) -> Callable[[Any], Any]:
    """A jitted copy of the params onto `out_shardings`, weight matrices cast to the model's
    compute dtype on the way (`published_dtype`): every publisher's."""
    compute = model.config.jnp_dtype

    def cast(x):
        return jnp.copy(x.astype(published_dtype(x.shape, x.dtype, compute)))

    return tracing.jit(lambda t: jax.tree.map(cast, t), out_shardings=out_shardings)


class HostReplicas:
    """Trainer params (on the global mesh) -> this process's copy for its sampler.

    One jitted copy per publish, on a ("host", "data", "tensor") mesh stacking a (data, tensor)
    mesh of every process's staging devices: each leaf gets the sampler's PartitionSpec
    (tensor-parallel dims over "tensor", nothing over "host" or "data"), so every process ends
    up with a whole copy split over its own devices; the weight matrices (2+ dims) are cast to
    the compute dtype on the way (the sampler's matmuls cast them to it anyway; norm scales
    keep the param dtype). `local` then views this process's shards as arrays on its sampler
    mesh. Colocated, the staging devices are the sampler's (its mesh); with a sampler on
    devices of its own (`sharding.split_devices` over several processes) they are the
    process's trainer devices, and `local` copies each shard to the sampler devices of its
    tensor index, device to device within the process (the staged copy is then freed).

    Attributes:
      meshes: per process (in process order), its sampler mesh.
      rules: the sampler's logical rules.
    """

    def __init__(
        self,
        model: nn.Module,
        sampler_mesh_cfg: Any,
        hosts: Sequence[Sequence[Any]],
        targets: Sequence[Sequence[Any]] | None = None,
    ):
        """Args:
        model: the policy (its config gives the compute dtype).
        sampler_mesh_cfg: `config.sampler_mesh` (axes and shape of each process's mesh).
        hosts: per process, the devices the copy is staged on (`devices_by_process`): its
          trainer devices, which are also its sampler's when `targets` is None.
        targets: per process, the sampler's own devices (None: colocated).
        """
        built = [sharding.make_sampler_mesh(sampler_mesh_cfg, d) for d in (targets or hosts)]
        self.meshes = [mesh for mesh, _ in built]
        self.rules = built[0][1]
        if targets is None:
            self.staging = [m.devices for m in self.meshes]
        else:
            tensor = int(self.meshes[0].shape["tensor"])
            if any(len(h) % tensor for h in hosts):
                raise ValueError(f"tensor axis {tensor} does not divide every host's devices")
            self.staging = [np.asarray(list(h), dtype=object).reshape(-1, tensor) for h in hosts]
        stacked = Mesh(np.stack(self.staging), ("host", *sharding.SAMPLER_AXES))
        local = sharding.param_partition_specs(model, self.meshes[0], self.rules)
        self.specs = jax.tree.map(lambda s: s.spec, local)
        out = jax.tree.map(lambda spec: NamedSharding(stacked, spec), self.specs)
        self._copy = _published_copy(model, out)

    def local(self, tree: Any, host: int) -> Any:
        """Process `host`'s shards of `copy`'s output, as arrays on its sampler mesh (each
        sampler device's shard copied from the staging device of its tensor index)."""
        mesh, staging = self.meshes[host], self.staging[host]

        def wrap(x: jax.Array, spec: Any) -> jax.Array:
            by_device = {s.device: s.data for s in x.addressable_shards}
            shards = []
            for (i, j), device in np.ndenumerate(mesh.devices):
                shard = by_device[staging[i % staging.shape[0], j]]
                shards.append(shard if shard.device == device else jax.device_put(shard, device))
            return jax.make_array_from_single_device_arrays(
                x.shape, NamedSharding(mesh, spec), shards
            )

        return jax.tree.map(wrap, tree, self.specs)

    def copy(self, params: Any) -> Any:
        """Every process's copy (a collective: every process calls it with its params)."""
        return self._copy(params)

    def __call__(self, params: Any) -> Any:
        """This process's copy of `params`."""
        return self.local(self.copy(params), jax.process_index())


class HostTransfer(HostReplicas):
    """The whole-host split's publisher: trainer params -> every sampler process's copy.

    Sampler processes hold no trainer device, so the copy crosses processes, and JAX copies
    between processes only between device lists of one size. One jitted copy (every process
    calls it; the trainer processes compute it) stages the weights on the trainer's devices,
    the sampler's PartitionSpecs on a (n_trainer / T, T) mesh of them (the weight matrices cast
    to the compute dtype, as `HostReplicas` does): every T staging devices hold a whole copy.
    The first (sampler devices / T) rows of them, viewed as a ("host", "data", "tensor") mesh
    shaped like the stacked sampler meshes, are then copied there by one `jax.device_put`,
    device to device across processes (every process sets its transfer socket:
    `tg_jax.tpu.distributed.transfer_address`). A sampler process views its shards as arrays
    on its own mesh (`local`); a trainer process gets None.

    Attributes:
      meshes: per sampler process (in process order), its sampler mesh.
      processes: the sampler processes' indices, in that order.
    """

    def __init__(
        self,
        model: nn.Module,
        sampler_mesh_cfg: Any,
        trainer_devices: Sequence[Any],
        samplers: Sequence[Sequence[Any]],
    ):
        """Args:
        model: the policy (its config gives the compute dtype).
        sampler_mesh_cfg: `config.sampler_mesh` (each sampler process's mesh).
        trainer_devices: the trainer's devices (every trainer process's).
        samplers: per sampler process, its devices (`devices_by_process`).
        """
        built = [sharding.make_sampler_mesh(sampler_mesh_cfg, d) for d in samplers]
        self.meshes = [mesh for mesh, _ in built]
        self.rules = built[0][1]
        self.processes = tuple(int(d[0].process_index) for d in samplers)
        self.staging = [m.devices for m in self.meshes]  # `local`: shards already in place
        local = sharding.param_partition_specs(model, self.meshes[0], self.rules)
        self.specs = jax.tree.map(lambda s: s.spec, local)
        tensor = int(self.meshes[0].shape["tensor"])
        grid = np.asarray(list(trainer_devices), dtype=object).reshape(-1, tensor)
        stage_mesh = Mesh(grid, sharding.SAMPLER_AXES)
        stacked = np.stack([m.devices for m in self.meshes])
        rows = stacked.size // tensor
        if rows > grid.shape[0]:
            raise ValueError(f"{stacked.size} sampler devices > {grid.size} trainer devices")
        self._view_mesh = Mesh(grid[:rows].reshape(stacked.shape), ("host", *sharding.SAMPLER_AXES))
        self._view_devices = set(self._view_mesh.devices.flat)
        self._target = Mesh(stacked, ("host", *sharding.SAMPLER_AXES))
        out = jax.tree.map(lambda spec: NamedSharding(stage_mesh, spec), self.specs)
        self._copy = _published_copy(model, out)

    def copy(self, params: Any) -> Any:
        """Every sampler process's copy, on the stacked sampler meshes (a collective: every
        process calls it with its params)."""
        staged = self._copy(params)

        def view(x: jax.Array, spec: Any) -> jax.Array:
            mine = [s.data for s in x.addressable_shards if s.device in self._view_devices]
            return jax.make_array_from_single_device_arrays(
                x.shape, NamedSharding(self._view_mesh, spec), mine, dtype=x.dtype
            )

        viewed = jax.tree.map(view, staged, self.specs)
        target = jax.tree.map(lambda spec: NamedSharding(self._target, spec), self.specs)
        return jax.device_put(viewed, target)

    def __call__(self, params: Any) -> Any:
        """This process's copy of `params` (None on a trainer process)."""
        moved = self.copy(params)
        me = jax.process_index()
        return self.local(moved, self.processes.index(me)) if me in self.processes else None


def devices_by_process(devices: Sequence[Any] | None = None) -> list[list[Any]]:
    """`devices` (default all) grouped by process, in process order, each in id order."""
    groups: dict[int, list[Any]] = {}
    for d in devices if devices is not None else jax.devices():
        groups.setdefault(d.process_index, []).append(d)
    return [sorted(groups[p], key=lambda d: d.id) for p in sorted(groups)]


def own_mesh_sampler(
    model: nn.Module,
    pad_id: int,
    sampler_mesh_cfg: Any,
    sampler_devices: Sequence[jax.Device],
    trainer_devices: Sequence[jax.Device],
    record_routes: bool = False,
) -> tuple[Sampler, WeightPublisher]:
    """(a sampler on its own devices' mesh, the publisher of the trainer's params onto it)."""
    mesh, rules = sharding.make_sampler_mesh(sampler_mesh_cfg, sampler_devices)
    shardings = sharding.param_partition_specs(model, mesh, rules)
    publisher = WeightPublisher(model, shardings, trainer_devices)
    sampler_kw = {"mesh": mesh, "rules": rules} if mesh.devices.size > 1 else {}
    divisor = sharding.batch_divisor(mesh, rules)
    sampler = Sampler(
        model, pad_id=pad_id, batch_divisor=divisor, record_routes=record_routes, **sampler_kw
    )
    return sampler, publisher


def rollout_sampler(
    model: nn.Module,
    pad_id: int,
    mesh: Mesh,
    rules: sharding.Rules,
    divisor: int,
    *,
    sampler_mesh_cfg: Any = None,
    sampler_devices: Sequence[jax.Device] | None = None,
    record_routes: bool = False,
) -> tuple[Sampler, Callable[[Any], Any] | None]:
    """(the RL loop's rollout sampler, trainer params -> its params, or None: the same).

    Args:
      model: the policy.
      pad_id: the tokenizer's padding id.
      mesh, rules, divisor: the trainer's mesh, logical rules and batch divisor.
      sampler_mesh_cfg, sampler_devices: `config.sampler_mesh` and the sampler's devices
        (`sharding.split_devices`); None = no devices of its own.
      record_routes: the sampler records MoE routing (`Sampler`, router replay).
    """
    kw = {"record_routes": record_routes}
    if jax.process_count() == 1:
        if sampler_devices:
            trainer_devices = list(mesh.devices.flat)
            return own_mesh_sampler(
                model, pad_id, sampler_mesh_cfg, sampler_devices, trainer_devices, **kw
            )
        sampler_kw = {"mesh": mesh, "rules": rules} if mesh.devices.size > 1 else {}
        return Sampler(model, pad_id=pad_id, batch_divisor=divisor, **sampler_kw, **kw), None
    if sampler_mesh_cfg is None:
        raise ValueError("several processes need config.sampler_mesh (each process's mesh)")
    trainers = {d.process_index for d in mesh.devices.flat}
    if sampler_devices and not trainers & {d.process_index for d in sampler_devices}:
        transfer = HostTransfer(  # the whole-host split
            model, sampler_mesh_cfg, list(mesh.devices.flat), devices_by_process(sampler_devices)
        )
        me = jax.process_index()
        # A trainer process holds a sampler it never calls (its mesh: the first sampler's).
        local = transfer.meshes[transfer.processes.index(me) if me in transfer.processes else 0]
        divisor = sharding.batch_divisor(local, transfer.rules)
        return Sampler(
            model, pad_id=pad_id, batch_divisor=divisor, mesh=local, rules=transfer.rules, **kw
        ), transfer
    replicas = HostReplicas(
        model,
        sampler_mesh_cfg,
        devices_by_process(list(mesh.devices.flat)),
        devices_by_process(sampler_devices) if sampler_devices else None,
    )
    local = replicas.meshes[jax.process_index()]
    divisor = sharding.batch_divisor(local, replicas.rules)
    sampler = Sampler(
        model, pad_id=pad_id, batch_divisor=divisor, mesh=local, rules=replicas.rules, **kw
    )
    return sampler, replicas


__all__ = [
    "HostReplicas",
    "HostTransfer",
    "WeightPublisher",
    "devices_by_process",
    "own_mesh_sampler",
    "published_dtype",
    "rollout_sampler",
]
