"""What several JAX processes (hosts) exchange, and how host data becomes global arrays.

Under `jax.distributed` (tg_jax.tpu.distributed) every process runs the same program over a
mesh that spans all hosts, but each process only holds the devices it addresses. Three things
therefore differ from a single process:

* host numpy data cannot go into a jit over the global mesh as is: `host_to_global` makes a
  global array of it (`jax.make_array_from_process_local_data`; every process holds the same
  whole array and places only its own devices' rows);
* a global array cannot be fetched by one process (`jax.device_get` of rows on other hosts
  fails): the sampler's copy of the params is made by one jitted copy over the global mesh
  (a collective) and re-wrapped as arrays on the process's own mesh
  (`tg_jax.sampling.placement.HostReplicas`);
* Python objects (rollout trajectories, the final evaluation's episodes) travel with
  `allgather_objects`, in process order, at most `GATHER_CHUNK_BYTES` per process at a time;
* a file every process needs is written once: `primary_first(name, fn)` runs `fn` (which
  writes the file or reuses it) on process 0, waits for it (`barrier`), then runs it on the
  others, which find the file and read it.

With one process every function here is the identity (or a plain device_put), so single-host
code paths run unchanged.
"""

from __future__ import annotations

import itertools
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from tg_jax import tracing


def process_count() -> int:
    return jax.process_count()


def is_primary() -> bool:
    """True on the process that writes metrics, summaries, reports and exports (process 0)."""
    return jax.process_index() == 0


class BarrierError(RuntimeError):
    """A barrier that not every process reached in time (one died, or took another branch)."""


_barriers = itertools.count()
BARRIER_TIMEOUT_S = 3600  # what process 0 may take to write a file the others wait for


def barrier_timeout_s() -> float:
    """A barrier's default timeout: TG_JAX_BARRIER_TIMEOUT_S, else BARRIER_TIMEOUT_S."""
    return float(os.environ.get("TG_JAX_BARRIER_TIMEOUT_S", "") or BARRIER_TIMEOUT_S)


def barrier(name: str, timeout_s: float | None = None) -> None:
    """Every process waits here until all have reached it (no-op with one process).

    Through the `jax.distributed` coordination service's key-value store, not a device
    collective: it holds no device and no tracing lock, and it fails after `timeout_s`
    (default TG_JAX_BARRIER_TIMEOUT_S, else BARRIER_TIMEOUT_S: an hour, as process 0 may be
    writing a task set or a base model the others wait for) saying how many arrived, where a
    device collective whose peer hung would wait without end. Every process calls the
    barriers in the same order; each call's id is its name and its position in that order.

    Raises:
      BarrierError: not every process arrived within the timeout.
    """
    if jax.process_count() == 1:
        return
    from jax._src import distributed  # noqa: PLC0415 (the client jax.distributed made)

    seconds = barrier_timeout_s() if timeout_s is None else float(timeout_s)
    client = distributed.global_state.client
    barrier_id = f"tg_jax/{next(_barriers)}/{name}"
    try:
        client.wait_at_barrier(barrier_id, int(seconds * 1000))
    except Exception as e:  # JaxRuntimeError DEADLINE_EXCEEDED, or the service gone
        reached = [ln.strip() for ln in str(e).splitlines() if "reached the barrier" in ln]
        raise BarrierError(
            f"process {jax.process_index()}: barrier {name!r} not reached by every one of "
            f"{jax.process_count()} processes within {seconds:.0f} s"
            + (f" ({reached[0]})" if reached else f": {str(e).splitlines()[0] if str(e) else e!r}")
        ) from e


def agreed(value: Any) -> Any:
    """Process 0's `value`, on every process (e.g. whether a shared file exists: decided once,
    before any process writes it, so that all take the same branch of a collective)."""
    return allgather_objects(value)[0] if jax.process_count() > 1 else value


def primary_first(name: str, fn: Callable[[], Any]) -> Any:
    """`fn()` on process 0, then, after a barrier, on the others: `fn` writes a shared file
    or reuses it, so process 0 writes it once and the others read what it wrote."""
    if jax.process_count() == 1:
        return fn()
    out = fn() if is_primary() else None
    barrier(f"{name}: written by process 0")
    return out if is_primary() else fn()


def process_slice(n: int, index: int | None = None, count: int | None = None) -> slice:
    """Process `index`'s contiguous, non-overlapping share of `n` items (n % count == 0).

    Raises:
      ValueError: `n` is not a multiple of the process count (shares would be unequal).
    """
    index = jax.process_index() if index is None else int(index)
    count = jax.process_count() if count is None else int(count)
    if n % count:
        raise ValueError(f"{n} items cannot be split evenly over {count} processes")
    per = n // count
    return slice(index * per, (index + 1) * per)


def process_share(n: int, index: int, count: int) -> slice:
    """Process `index`'s contiguous share of `n` items over `count` processes where `n` need
    not divide (the held-out tasks): the first n % count shares one item longer, a share
    empty when n < count; in index order the shares are 0..n-1 once each."""
    if not 0 <= index < count:
        raise ValueError(f"process {index} is not one of {count}")
    per, extra = divmod(int(n), int(count))
    start = index * per + min(index, extra)
    return slice(start, start + per + (index < extra))


# Bytes of one process's slice of a gather: each chip holds processes x this while it runs.
GATHER_CHUNK_BYTES = 64 << 20


def gather_buffer(nbytes: int, chunk_bytes: int = GATHER_CHUNK_BYTES) -> int:
    """The bytes of one process's slice of `allgather_objects`' device buffer when the
    longest pickle is `nbytes`: a power of two from 4 KiB up to `chunk_bytes` (few compiled
    shapes for small objects), never more (a large one goes in several gathers)."""
    return min(int(chunk_bytes), 1 << max(12, (max(int(nbytes), 1) - 1).bit_length()))


def allgather_objects(obj: Any, chunk_bytes: int = GATHER_CHUNK_BYTES) -> list[Any]:
    """Every process's `obj` (picklable), in process order; [obj] with one process.

    The pickles cross in gathers of [processes, `gather_buffer`] bytes on every chip (a step's
    trajectories with their routing records can be GiBs a process: they go `chunk_bytes` at a
    time, so a chip holds processes x chunk_bytes at most, 1 GiB for 16 processes).
    A collective: every process must call it at the same point of the program.
    """
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils  # noqa: PLC0415 (multi-process only)

    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    with tracing.TRACE_LOCK:  # collectives: one multi-device computation at a time
        sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int64)))
        sizes = sizes.reshape(-1)
        width = gather_buffer(int(sizes.max()), chunk_bytes)  # the same on every process
        parts: list[list[np.ndarray]] = [[] for _ in sizes]
        for start in range(0, int(sizes.max()), width):
            buf = np.zeros(width, np.uint8)
            piece = data[start : start + width]
            buf[: piece.size] = piece
            rows = np.asarray(multihost_utils.process_allgather(buf))
            for i, size in enumerate(sizes):
                parts[i].append(rows[i, : max(0, min(width, int(size) - start))])
    return [pickle.loads(np.concatenate(p).tobytes()) for p in parts]


def host_to_global(tree: Any, sharding: NamedSharding) -> Any:
    """Host numpy leaves (the same whole arrays on every process) as global arrays.

    Each leaf is split along dim 0 by `sharding`'s spec (its first entry; trailing dims
    unsharded); each process transfers only the rows of its own devices.
    """
    spec = tuple(sharding.spec)[:1]
    leaf_sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec))
    return jax.tree.map(lambda x: from_host(leaf_sharding, x), tree)


def from_host(sharding: NamedSharding, x: Any) -> jax.Array:
    """Host data `x` (the same whole array on every process) as a global array on `sharding`;
    a process that holds none of its devices (a sampler process of the whole-host split)
    makes the array without data, as jit and device_put accept it there."""
    x = np.asarray(x)
    if not sharding.addressable_devices:
        return jax.make_array_from_single_device_arrays(x.shape, sharding, [], dtype=x.dtype)
    return jax.make_array_from_process_local_data(sharding, x, x.shape)


def same_on_all(values: Sequence[Any]) -> bool:
    """Whether every process reported the same value (`allgather_objects`' result)."""
    return all(v == values[0] for v in values)
