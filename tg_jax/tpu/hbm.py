"""Per-chip memory of compiled TPU programs: HBM per device and XLA's memory analysis.

`tg_jax.tpu.aot` compiles a config's steps for a TPU topology on a CPU host; this module turns
an executable's `memory_analysis()` into what one device needs (`MemoryReport`), beside the
buffers that stay on its chips outside the program (`resident`), against its HBM.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

HBM_GIB_PER_CHIP = {"v4": 32.0, "v5e": 16.0, "v5litepod": 16.0, "v5p": 95.0, "v6e": 32.0}
GIB = 2**30


def hbm_bytes_per_device(topology: str, num_devices: int) -> float:
    """HBM of one JAX device: a chip's HBM, halved where devices are single TensorCores (v4)."""
    kind, _, dims = topology.partition(":")
    chips = math.prod(int(d) for d in dims.split("x"))
    if kind not in HBM_GIB_PER_CHIP:
        raise ValueError(f"Unknown TPU kind {kind!r}; known: {sorted(HBM_GIB_PER_CHIP)}")
    return HBM_GIB_PER_CHIP[kind] * GIB * chips / num_devices


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Per-device bytes of one compiled program (XLA's memory analysis)."""

    name: str
    arguments: int
    outputs: int
    aliased: int  # outputs written in place of donated arguments (counted once)
    temps: int
    code: int
    hbm: float
    resident: int = 0  # buffers the program does not see that stay on its devices meanwhile
    estimated: bool = False  # sized from shapes, not compiled (vLLM, the trajectory gather)

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temps + self.code + self.resident

    def format(self) -> str:
        def g(x):
            return f"{x / GIB:7.2f} GiB"

        fits = "fits" if self.total <= self.hbm else "DOES NOT FIT"
        head = (
            f"{self.name}: per device {g(self.total)} of {g(self.hbm)} HBM ({fits}; "
            f"{100 * self.total / self.hbm:.0f}%)\n"
        )
        resident = f"  + resident {g(self.resident)}" if self.resident else ""
        if self.estimated:
            return f"{head}  estimated from shapes {g(self.arguments)}{resident}"
        return (
            f"{head}  arguments {g(self.arguments)}  outputs {g(self.outputs)}  "
            f"aliased {g(self.aliased)}  temps {g(self.temps)}  code {g(self.code)}{resident}"
        )


def memory_report(compiled: Any, name: str, hbm: float, resident: int = 0) -> MemoryReport:
    m = compiled.memory_analysis()
    return MemoryReport(
        name=name,
        arguments=int(m.argument_size_in_bytes),
        outputs=int(m.output_size_in_bytes),
        aliased=int(m.alias_size_in_bytes),
        temps=int(m.temp_size_in_bytes),
        code=int(m.generated_code_size_in_bytes),
        hbm=hbm,
        resident=resident,
    )


def estimate(name: str, nbytes: int, hbm: float, resident: int = 0) -> MemoryReport:
    """The report of buffers sized from shapes (`nbytes` per device), not of a program."""
    return MemoryReport(name, int(nbytes), 0, 0, 0, 0, hbm, resident, estimated=True)


def bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded abstract arrays (its shard of each)."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(tree)
    )


__all__ = [
    "GIB",
    "HBM_GIB_PER_CHIP",
    "MemoryReport",
    "bytes_per_device",
    "estimate",
    "hbm_bytes_per_device",
    "memory_report",
]
