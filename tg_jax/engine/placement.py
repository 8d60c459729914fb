"""Where the engine's arrays live when it runs on several devices (`Engine(mesh=...)`).

One engine is one model replica over a ("data", "tensor") mesh (`sharding.SAMPLER_AXES`):

  weights   the sampler's rules (`sharding.SAMPLER_RULES`: heads, KV heads, MLP, experts' MLP
            and vocab over "tensor"), in the dtype they come in (a host's bf16 copy stays bf16;
            weights already placed so are not moved);
  KV pool   each layer's [pages, page_size, K, H] split over "tensor" on its KV heads (when K
            divides by it, else replicated) and replicated over "data"; the MoE routing
            record replicated. A chip holds 1 / tensor of the keys and values;
  rows      a call's host arrays split over "data" on their first axis when it divides (else
            replicated): "data" replicas decode disjoint rows from their own copy of the pool
            (each token's new keys reach every copy: one token per row per layer).

`engine_mesh` picks the mesh for a set of devices: "tensor" as wide as both the device count
and the KV heads allow (their greatest common divisor), "data" the rest; a sampler mesh
already of those axes is used as it is (`for_sampler`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tg_jax import sharding
from tg_jax.models.qwen3 import Transformer


def engine_mesh(devices: Sequence[Any], num_kv_heads: int) -> Mesh:
    """A ("data", "tensor") mesh over `devices`: tensor = gcd(len(devices), num_kv_heads)."""
    devices = list(devices)
    tensor = math.gcd(len(devices), int(num_kv_heads))
    grid = np.asarray(devices, dtype=object).reshape(len(devices) // tensor, tensor)
    return Mesh(grid, sharding.SAMPLER_AXES)


def for_sampler(mesh: Mesh | None, num_kv_heads: int) -> Mesh | None:
    """The engine's mesh on a sampler's devices: None for no mesh or one device; the sampler's
    own ("data", "tensor") mesh as it is; else (a trainer's mesh, colocated) `engine_mesh`
    over its devices."""
    if mesh is None or mesh.size == 1:
        return None
    if tuple(mesh.axis_names) == sharding.SAMPLER_AXES:
        return mesh
    return engine_mesh(list(mesh.devices.flat), num_kv_heads)


class Placement:
    """The shardings of one engine's arrays on `mesh` (module docstring)."""

    def __init__(self, model: Transformer, mesh: Mesh):
        if tuple(mesh.axis_names) != sharding.SAMPLER_AXES:
            raise ValueError(
                f"the engine's mesh must have axes {sharding.SAMPLER_AXES}, got {mesh.axis_names}"
            )
        self.mesh = mesh
        self.data = int(mesh.shape["data"])
        tensor = int(mesh.shape["tensor"])
        heads = "tensor" if model.config.num_kv_heads % tensor == 0 else None
        self.kv = NamedSharding(mesh, PartitionSpec(None, None, heads, None))
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self._params = sharding.param_partition_specs(model, mesh, sharding.SAMPLER_RULES)

    def params(self, params: Any) -> Any:
        """`params` on the mesh with the sampler's rules (no copy where already so)."""
        return jax.device_put(params, self._params)

    def host(self, tree: Any) -> Any:
        """A call's host (numpy) arrays placed: split over "data" on their first axis where it
        divides, else replicated; device arrays and scalars kept."""

        leaves, treedef = jax.tree.flatten(tree)
        host = [i for i, x in enumerate(leaves) if isinstance(x, np.ndarray) and x.ndim]
        shardings = [
            NamedSharding(self.mesh, PartitionSpec("data" if x.shape[0] % self.data == 0 else None))
            for x in (leaves[i] for i in host)
        ]
        for i, x in zip(host, jax.device_put([leaves[i] for i in host], shardings), strict=True):
            leaves[i] = x  # one transfer call for all of them
        return jax.tree.unflatten(treedef, leaves)


__all__ = ["Placement", "engine_mesh", "for_sampler"]
