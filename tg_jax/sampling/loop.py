"""The sampling loop: rollouts in a background thread, apart from the trainer (or inline).

    trainer                                   sampling thread
    -------                                   ---------------
    loop.publish(params, version=v)  ------>  before each batch: newest (params, v)
    group = loop.get(max_staleness=s) <-----  queue.put(RolloutGroup(v, trajectories))
                                              (bounded: sampling runs at most `queue_size`
                                              groups ahead of the trainer)

One thread is enough: JAX releases the GIL while compiled code runs, and the environments'
sandboxed subprocesses release it while they wait. `get` drops (and counts) groups sampled by a
policy older than `current_version - max_staleness`; the importance ratios of the groups it
keeps use their recorded behaviour log-probs, so staleness is corrected, not ignored.

Failure and shutdown: an exception in the loop is stored and re-raised by the next `get` (which
polls, so it surfaces within `poll_s` seconds, never a hang); `close()` stops the loop and joins
the thread (a batch already running finishes first; the thread is a daemon so a stuck
environment cannot keep the process alive).

The rollout function gets what the loop has: (params, batch index, tasks, policy version).
Batch indices count from `first_index` (a resumed run passes its task iterator's position), so
a rollout function that derives its randomness from the index (its sampling key
fold_in(base_key, index)) samples batch i the same way in every session and in both loops.

`InlineLoop` is the synchronous twin (the deterministic mode): the same interface, and each
`get` samples the next batch in the caller's thread with the newest published params
(staleness 0). Both sample a batch with the same `sample_group`.

Devices: with `place`, published params are `place(params)`; with `devices`, they are copied
there (replicated); build the rollout function's sampler on the same devices with
`data_parallel_mesh(devices)` (rows split over them). With neither, the loop shares the
trainer's devices and still copies the params (`may_alias=False`), so a train step that
donates its params can never free the buffers a rollout is reading (`place` must return new
buffers too). A two-step `place` (`stage` and `copy` methods, e.g.
`tg_jax.sampling.placement.WeightPublisher`: the sampler on its own mesh) stages in `publish`,
in the trainer's thread, and the loop's thread makes the copy between batches, once the staged
arrays are computed: until then it samples with the policy it has (the first batch waits).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from tg_jax.sampling.trajectory import Trajectory

# (params, batch index, tasks, policy version) -> trajectories
RolloutFn = Callable[[Any, int, Sequence[Any], int], list[Trajectory]]


@dataclasses.dataclass
class RolloutGroup:
    """One batch of rollouts as it travels from the sampling loop to the trainer.

    Attributes:
      trajectories: the rollouts (G per task, grouped by task).
      policy_version: version of the params that sampled them.
      batch_index: absolute position of the task batch in the task order (first_index, ...).
      seconds: wall time of the rollouts.
      staleness: trainer version at `get` time minus `policy_version` (set by `get`).
    """

    trajectories: list[Trajectory]
    policy_version: int
    batch_index: int
    seconds: float
    staleness: int = 0

    @property
    def sampled_tokens(self) -> int:
        return int(sum(np.sum(t.turn_ids >= 0) for t in self.trajectories))


SAMPLER_AXIS = "sampler"


def data_parallel_mesh(devices: Sequence[jax.Device]) -> tuple[jax.sharding.Mesh, tuple]:
    """(mesh, logical rules) of a sampler on `devices`: rows split over them, params replicated.

    Pass both to `Sampler(..., mesh=mesh, rules=rules, batch_divisor=len(devices))`; the
    loop's published params are replicated over the same devices.
    """
    mesh = jax.sharding.Mesh(np.asarray(list(devices)), (SAMPLER_AXIS,))
    return mesh, (("batch", SAMPLER_AXIS),)


def sample_group(
    rollout_fn: RolloutFn, params: Any, version: int, index: int, tasks: Sequence[Any]
) -> RolloutGroup:
    """Samples task batch `index` with the policy `params` of version `version`, timed."""
    start = time.perf_counter()
    trajectories = rollout_fn(params, index, tasks, version)
    return RolloutGroup(list(trajectories), version, index, time.perf_counter() - start)


def _two_steps(place: Any) -> tuple[Callable[[Any], Any] | None, Callable[[Any], Any] | None]:
    """(stage, copy) of a `place`: its methods if it has both, else (place, None)."""
    if place is None:
        return None, None
    if callable(getattr(place, "stage", None)) and callable(getattr(place, "copy", None)):
        return place.stage, place.copy
    return place, None


def _ready(tree: Any) -> bool:
    """Whether every array of `tree` is computed (reading it would not wait)."""
    return all(x.is_ready() for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


class _Done:
    """Queue sentinel: the task iterator is exhausted."""


class SamplingLoop:
    """Runs `rollout_fn` on task batches in a thread, with the newest published params."""

    def __init__(
        self,
        rollout_fn: RolloutFn,
        task_batches: Iterable[Sequence[Any]],
        *,
        first_index: int = 0,
        queue_size: int = 2,
        devices: Sequence[jax.Device] | None = None,
        place: Callable[[Any], Any] | None = None,
        poll_s: float = 0.1,
    ):
        """Args:
        rollout_fn: (params, batch_index, tasks, policy_version) -> trajectories, e.g.
          `tg_jax.train.rl_rollouts.BatchRollout`.
        task_batches: iterable of task batches (one batch -> one RolloutGroup).
        first_index: batch index of the first batch (the next ones count up from it).
        queue_size: rollout groups held ahead of the trainer.
        devices: devices of the sampler (params are copied there); None = default placement.
        place: params -> the sampler's copy of them (new buffers), instead of `devices`; or
          a two-step one (see the module docstring).
        poll_s: how often blocked calls check for errors and shutdown.
        """
        self._rollout_fn = rollout_fn
        self._batches = enumerate(task_batches, start=int(first_index))
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self._poll_s = poll_s
        self._target = None
        self._stage, self._copy = _two_steps(place)
        self._pending: tuple[Any, int] | None = None  # staged, not yet copied (two-step place)
        if devices and place is None:
            devices = list(devices)
            if len(devices) == 1:
                self._target = jax.sharding.SingleDeviceSharding(devices[0])
            else:
                mesh, _ = data_parallel_mesh(devices)
                self._target = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self._lock = threading.Lock()
        self._params: Any = None
        self._version = -1
        self._used = -1  # two-step place: the version of self._params
        self._has_params = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._exhausted = False
        self._dropped = 0
        self._stale: list[dict[str, Any]] = []  # dropped as stale since the last delivery
        self._delivered = 0
        self._staleness: list[int] = []
        self._thread = threading.Thread(target=self._run, name="tg_jax-sampling-loop", daemon=True)
        self._thread.start()

    # Trainer side.

    def publish(self, params: Any, version: int) -> None:
        """Makes `params` (policy version `version`) the weights of the next rollout batch
        (two-step place: of the first batch that starts once they are staged)."""
        if self._stage is not None:
            copy = self._stage(params)
        else:
            copy = jax.device_put(params, self._target, may_alias=False)
        with self._lock:
            if version < self._version:
                raise ValueError(f"policy version went back from {self._version} to {version}")
            if self._copy is not None:
                self._pending = (copy, int(version))
            else:
                self._params = copy
            self._version = int(version)
        self._has_params.set()

    @property
    def version(self) -> int:
        """The newest published policy version (-1 before the first publish)."""
        with self._lock:
            return self._version

    def get(self, max_staleness: int, timeout: float | None = None) -> RolloutGroup | None:
        """The next rollout group no older than `version - max_staleness`.

        Args:
          max_staleness: oldest accepted policy version lag (0 = on-policy only).
          timeout: seconds to wait; None = forever.
        Returns:
          A RolloutGroup with `staleness` set, or None once the task iterator is exhausted and
          every group has been delivered.
        Raises:
          RuntimeError: the sampling loop failed (the loop's exception is its __cause__);
            raised as soon as the failure is seen, even if earlier groups are still queued.
          TimeoutError: nothing arrived within `timeout`.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._raise_if_failed()
            try:
                item = self._queue.get(timeout=self._poll_s)
            except queue.Empty:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"no rollout group within {timeout} s") from None
                continue
            if isinstance(item, _Done):
                self._exhausted = True
                self._queue.put(item)  # later calls see it too
                self._raise_if_failed()
                return None
            staleness = self.version - item.policy_version
            if staleness > max_staleness:
                self._dropped += 1
                self._stale.append(stale_entry(item, staleness, max_staleness))
                logging.info(
                    "dropped rollout group %d of version %d (staleness %d > %d)",
                    item.batch_index,
                    item.policy_version,
                    staleness,
                    max_staleness,
                )
                continue
            item.staleness = staleness
            self._delivered += 1
            self._staleness.append(staleness)
            if self._stale and item.trajectories:  # lineage: listed with the next step's dump
                info = item.trajectories[0].info
                info["dropped_groups"] = [*info.get("dropped_groups", ()), *self._stale]
                self._stale = []
            return item

    def stats(self) -> dict[str, float]:
        """Counters for logging: delivered / dropped groups, staleness of delivered groups."""
        st = np.asarray(self._staleness or [0])
        return {
            "groups_delivered": float(self._delivered),
            "groups_dropped_stale": float(self._dropped),
            "staleness_mean": float(st.mean()),
            "staleness_max": float(st.max()),
            "queue_size": float(self._queue.qsize()),
        }

    def close(self, timeout: float = 60.0) -> None:
        """Stops the loop and joins its thread (waits for a running batch up to `timeout`)."""
        self._stop.set()
        self._has_params.set()  # wakes a loop still waiting for its first params
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline:
            self._drain()  # unblocks a pending put
            self._thread.join(self._poll_s)
        if self._thread.is_alive():
            logging.warning("sampling loop still running after %.0f s; left as daemon", timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> SamplingLoop:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # Loop side.

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"sampling loop failed: {self._error!r}") from self._error

    def _drain(self) -> None:
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass

    def _put(self, item: Any) -> bool:
        """Blocks until there is room; False if the loop is stopping."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=self._poll_s)
                return True
            except queue.Full:
                continue
        return False

    def _newest(self) -> tuple[Any, int]:
        """(params, version) of the next batch. Two-step place: a staged policy is copied once
        it is computed (or at once, when there are no params yet), else the current ones."""
        with self._lock:
            if self._copy is None:
                return self._params, self._version
            pending = self._pending
            if pending is None:
                return self._params, self._used
        staged, version = pending
        if self._params is not None and not _ready(staged):
            return self._params, self._used
        params = self._copy(staged)
        with self._lock:
            if self._pending is pending:
                self._pending = None
            self._params, self._used = params, version
        return params, version

    def _run(self) -> None:
        try:
            self._has_params.wait()
            while not self._stop.is_set():
                try:
                    index, tasks = next(self._batches)
                except StopIteration:
                    self._put(_Done())
                    return
                params, version = self._newest()
                if not self._put(sample_group(self._rollout_fn, params, version, index, tasks)):
                    return
        except BaseException as e:  # noqa: BLE001 (handed to the trainer by get())
            logging.exception("sampling loop failed")
            self._error = e


def stale_entry(group: RolloutGroup, staleness: int, max_staleness: int) -> dict[str, Any]:
    """The lineage entry of a rollout batch dropped as stale (`Trajectory.info`'s
    "dropped_groups", written to step_<N>.dropped.json with the step that follows)."""
    return {
        "batch_index": int(group.batch_index),
        "group_ids": sorted({int(t.group_id) for t in group.trajectories}),
        "task_ids": sorted({str(t.task_id) for t in group.trajectories}),
        "why": (
            f"stale: sampled by policy version {group.policy_version}, {staleness} behind the "
            f"trainer (rl.max_staleness {max_staleness})"
        ),
    }


class InlineLoop:
    """The synchronous `SamplingLoop`: each `get` samples the next batch now, in this thread."""

    def __init__(
        self,
        rollout_fn: RolloutFn,
        task_batches: Iterable[Sequence[Any]],
        *,
        first_index: int = 0,
        place: Callable[[Any], Any] | None = None,
    ):
        """Args: as `SamplingLoop`'s (no queue, no devices: it samples in the caller's thread,
        on the trainer's devices unless `place` puts the params elsewhere)."""
        self._place = place
        self._rollout_fn = rollout_fn
        self._batches = enumerate(task_batches, start=int(first_index))
        self._params: Any = None
        self._version = -1
        self._delivered = 0

    def publish(self, params: Any, version: int) -> None:
        """As `SamplingLoop.publish`, without the copy (but `place`'s): sampling ends before
        the next (donating) train step is dispatched."""
        if version < self._version:
            raise ValueError(f"policy version went back from {self._version} to {version}")
        params = self._place(params) if self._place is not None else params
        self._params, self._version = params, int(version)

    @property
    def version(self) -> int:
        return self._version

    def get(self, max_staleness: int, timeout: float | None = None) -> RolloutGroup | None:
        """The next batch, sampled now by the newest params (staleness 0); None when the task
        iterator is exhausted."""
        del max_staleness, timeout  # always on-policy; it returns when the sampling is done
        try:
            index, tasks = next(self._batches)
        except StopIteration:
            return None
        self._delivered += 1
        return sample_group(self._rollout_fn, self._params, self._version, index, tasks)

    def stats(self) -> dict[str, float]:
        """`SamplingLoop.stats`'s counters: nothing is ever dropped or queued."""
        return {
            "groups_delivered": float(self._delivered),
            "groups_dropped_stale": 0.0,
            "staleness_mean": 0.0,
            "staleness_max": 0.0,
            "queue_size": 0.0,
        }

    def close(self) -> None:
        pass

    def __enter__(self) -> InlineLoop:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["InlineLoop", "RolloutFn", "RolloutGroup", "SamplingLoop", "data_parallel_mesh"]
