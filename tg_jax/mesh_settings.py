"""The `mesh` and `sampler_mesh` sections of a run config, declared once
(`tg_jax.config_schema`); `tg_jax.sharding` builds the meshes from them (the checks that need
the devices are there)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from tg_jax.config_schema import Section

# Logical axis -> mesh axes. Params: embed/vocab/heads/kv_heads/mlp/expert/head_dim/layers/
# norm. Activations: batch/length/act_embed plus heads/mlp/vocab.
DEFAULT_RULES = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("act_embed", None),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("expert", "expert"),
    ("moe_mlp", "tensor"),
    ("head_dim", None),
    ("layers", None),
    ("norm", None),
)


def check_sizes(section: str, shape: tuple[int, ...]) -> None:
    """A mesh shape's sizes: each >= 1, or one -1 (the devices left)."""
    if shape.count(-1) > 1 or any(s < 1 and s != -1 for s in shape):
        raise ValueError(f"{section}.shape {shape}: sizes >= 1, and at most one -1 (the rest)")


def _check_shape(section: str, axes: tuple[str, ...], shape: tuple[int, ...]) -> None:
    if len(axes) != len(shape):
        raise ValueError(f"{section}.axes {axes} and shape {shape} differ in length")
    check_sizes(section, shape)


@dataclasses.dataclass(frozen=True)
class MeshConfig(Section):
    """`mesh`: the trainer's mesh axes, their sizes and the logical rules."""

    section: ClassVar[str] = "mesh"

    axes: tuple[str, ...] = ("data", "fsdp", "tensor", "expert")
    """Mesh axis names."""
    shape: tuple[int, ...] = (1, -1, 1, 1)
    """Size per axis; one -1 takes the remaining devices."""
    rules: tuple[tuple[str, Any], ...] = DEFAULT_RULES
    """Logical axis name -> mesh axis (or a tuple of axes, or None)."""

    def __post_init__(self):
        _check_shape(self.section, self.axes, self.shape)


@dataclasses.dataclass(frozen=True)
class SamplerMeshConfig(Section):
    """`sampler_mesh`: the sampler's own devices and mesh (`tg_jax.sharding.split_devices`,
    `make_sampler_mesh`)."""

    section: ClassVar[str] = "sampler_mesh"

    num_devices: int = 0
    """0 = colocated: the sampler uses the trainer's devices and mesh. N > 0: the last N
    devices are the sampler's (with P processes, the last N / P of each), the trainer's mesh
    (`mesh`) is built over the others, and each train step's weights are copied onto the
    sampler's devices."""
    axes: tuple[str, ...] = ("data", "tensor")
    """Data-parallel replicas x tensor parallelism (heads, mlp)."""
    shape: tuple[int, ...] = (-1, 1)
    """Size per axis; one -1 takes the rest of the sampler's devices."""
    processes: int = 0
    """0 = as `num_devices` says. H > 0 (several processes): the whole-host split, the last H
    processes sample on all their devices and train on none, the others train and sample
    nothing; each publish copies the weights device to device across processes
    (`tg_jax.sampling.placement.HostTransfer`). Excludes num_devices > 0."""
    max_rows: int = 0
    """Most episodes in one sampler call (0 = all of a step's, or of an evaluation's): more
    are played in chunks of this many, with the same rollouts (`tg_jax.sampling.rollout`)."""

    def __post_init__(self):
        _check_shape(self.section, self.axes, self.shape)
        if self.max_rows < 0:
            raise ValueError(f"sampler_mesh.max_rows must be >= 0 (0 = all), got {self.max_rows}")
        if self.num_devices < 0:
            raise ValueError(f"sampler_mesh.num_devices must be >= 0, got {self.num_devices}")
        if self.processes < 0:
            raise ValueError(f"sampler_mesh.processes must be >= 0, got {self.processes}")
        if self.processes and self.num_devices:
            raise ValueError(
                f"sampler_mesh.processes={self.processes} (whole sampler processes) and "
                f"num_devices={self.num_devices} (a share of every process) are two layouts: "
                "set one of them"
            )


__all__ = ["DEFAULT_RULES", "MeshConfig", "SamplerMeshConfig", "check_sizes"]
