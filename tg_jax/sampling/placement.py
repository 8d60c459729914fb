"""Where the rollout sampler runs, and how the trainer's weights get there.

Three placements (`rollout_sampler` picks one):

  colocated     one process, `config.sampler_mesh.num_devices == 0`: the sampler runs on the
                trainer's mesh with the trainer's params (no copy but the loop's own).
  own mesh      one process, num_devices N > 0: the sampler has the last N devices, on a
                ("data", "tensor") mesh (`sharding.make_sampler_mesh`), and the trainer's mesh
                covers the rest. Each published policy is resharded onto the sampler's
                shardings by a `WeightPublisher`, device to device.
  per process   several processes (`jax.distributed`): each samples its own share of the
                groups on its own devices, with params all-gathered to them
                (`multihost.local_replica`).

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

from tg_jax import multihost, sharding, tracing
from tg_jax.sampling.loop import data_parallel_mesh
from tg_jax.sampling.sampler import Sampler


class WeightPublisher:
    """Trainer params -> the same params on the sampler's mesh (new buffers, device to device).

    Attributes:
      shardings: the sampler's NamedShardings of the params (a pytree like the params).
      staging: the same PartitionSpecs on a mesh of the trainer's devices.
    """

    def __init__(self, shardings: Any, trainer_devices: Sequence[jax.Device]):
        """Args:
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
        self._stage = tracing.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=self.staging)

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


def own_mesh_sampler(
    model: nn.Module,
    pad_id: int,
    sampler_mesh_cfg: Any,
    sampler_devices: Sequence[jax.Device],
    trainer_devices: Sequence[jax.Device],
) -> tuple[Sampler, WeightPublisher]:
    """(a sampler on its own devices' mesh, the publisher of the trainer's params onto it)."""
    mesh, rules = sharding.make_sampler_mesh(sampler_mesh_cfg, sampler_devices)
    shardings = sharding.param_partition_specs(model, mesh, rules)
    publisher = WeightPublisher(shardings, trainer_devices)
    sampler_kw = {"mesh": mesh, "rules": rules} if mesh.devices.size > 1 else {}
    divisor = sharding.batch_divisor(mesh, rules)
    return Sampler(model, pad_id=pad_id, batch_divisor=divisor, **sampler_kw), publisher


def rollout_sampler(
    model: nn.Module,
    pad_id: int,
    mesh: Mesh,
    rules: sharding.Rules,
    divisor: int,
    *,
    sampler_mesh_cfg: Any = None,
    sampler_devices: Sequence[jax.Device] | None = None,
) -> tuple[Sampler, Callable[[Any], Any] | None]:
    """(the RL loop's rollout sampler, trainer params -> its params, or None: the same).

    Args:
      model: the policy.
      pad_id: the tokenizer's padding id.
      mesh, rules, divisor: the trainer's mesh, logical rules and batch divisor.
      sampler_mesh_cfg, sampler_devices: `config.sampler_mesh` and the sampler's devices
        (`sharding.split_devices`); None = no devices of its own.
    """
    if sampler_devices:
        trainer_devices = list(mesh.devices.flat)
        return own_mesh_sampler(model, pad_id, sampler_mesh_cfg, sampler_devices, trainer_devices)
    if jax.process_count() == 1:
        sampler_kw = {"mesh": mesh, "rules": rules} if mesh.devices.size > 1 else {}
        return Sampler(model, pad_id=pad_id, batch_divisor=divisor, **sampler_kw), None
    local, local_rules = data_parallel_mesh(jax.local_devices())
    sampler = Sampler(
        model, pad_id=pad_id, batch_divisor=local.devices.size, mesh=local, rules=local_rules
    )
    return sampler, lambda params: multihost.local_replica(params, mesh, local)


__all__ = ["WeightPublisher", "own_mesh_sampler", "rollout_sampler"]
