"""Timing helpers shared by the benchmarks: median wall time, the matmul peak, machine load.

Every figure of `tg_jax.bench` is a wall-clock median of `repeats` calls after `warmup` calls
(compilation, allocator growth and first-touch page faults land in the warm-up). The machine's
1-minute load average is read next to each figure: on a shared CPU it explains most noise.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per call of a benchmarked function.

    Attributes:
      median: median wall time over the timed calls (what every rate and ratio uses).
      best: fastest timed call (wall).
      times: wall time of every timed call.
      cpu: median CPU time of this process (all threads) per call. Other processes on a
        shared machine inflate wall time, much less CPU time, so ratios of CPU times are the
        steadier comparison under load (threads that spin while waiting count as CPU time).
      load: 1-minute load average when the timing ended.
    """

    median: float
    best: float
    times: tuple[float, ...]
    cpu: float
    load: float


def load_average() -> float:
    """The machine's 1-minute load average (NaN where the OS does not report it)."""
    try:
        return float(os.getloadavg()[0])
    except OSError:
        return float("nan")


def time_calls(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> Timing:
    """Times `fn()` (which must block until its result is ready) `repeats` times after warm-up."""
    for _ in range(warmup):
        fn()
    times, cpu = [], []
    for _ in range(max(1, repeats)):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return Timing(
        statistics.median(times), min(times), tuple(times), statistics.median(cpu), load_average()
    )


def matmul_peak(n: int = 2048, repeats: int = 5) -> tuple[float, Timing]:
    """The measured fp32 peak: FLOP/s of an [n, n] @ [n, n] jnp matmul (median call).

    XLA's side of the MFU denominator (`suites.measure_peak` takes the faster of it and torch's
    matmul): what XLA's own kernel reaches on this machine, under the same load, in the same
    process. 2 n^3 / timing.cpu is the same peak per CPU-second (for the CPU-time MFU).

    Returns:
      (FLOP/s, the timing).
    """
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((n, n)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((n, n)), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    timing = time_calls(lambda: matmul(a, b).block_until_ready(), repeats, warmup=2)
    return 2.0 * n**3 / timing.median, timing


def cpu_count() -> int:
    """CPUs this process may run on (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
