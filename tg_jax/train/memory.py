"""Peak memory of one RL run, not of the process (`PeakMemory`).

The process's lifetime peak (the host's max RSS, the device's `peak_bytes_in_use`) only
grows: in the main job, which runs every arm in one process, the second arm would report
the first arm's peak. A `PeakMemory` measures from its `start`:

* a daemon thread samples the memory in use now (device `bytes_in_use` where the backend
  reports memory stats, else the host's resident set from /proc/self/statm) every
  `interval_s` and keeps the largest value since `start`;
* the process's lifetime peak is read at `start` and at `peak()`: if it grew meanwhile,
  this run set a new process record, and that record (exact, no sampling gap) is the run's
  peak. Else the run stayed under an earlier run's peak and the sampled maximum is used (a
  spike shorter than the interval can then be missed: a lower bound).

So an arm's figure does not depend on which arms ran before it in the same process, except
for what those arms left allocated (host RSS keeps the compiled programs and freed-but-kept
heap of earlier runs): `baseline`, the bytes in use at `start`, says how much that is, and
peak - baseline is what the run itself added on top.
"""

from __future__ import annotations

import os
import resource
import threading
from collections.abc import Callable
from typing import Any

import jax

Reading = tuple[int, int]  # (bytes in use now, lifetime peak bytes)


def host_reading() -> Reading:
    """(resident set size now, max resident set size so far) of this process, in bytes."""
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    try:
        with open("/proc/self/statm") as f:
            now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux: only the lifetime peak is known
        now = peak
    return now, peak


def device_stats() -> dict[str, Any]:
    """The first local device's memory stats ({} where the backend has none)."""
    try:
        return jax.local_devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 (backends without memory stats raise various errors)
        return {}


def device_reading(stats: dict[str, Any]) -> Reading | None:
    if "bytes_in_use" not in stats:
        return None
    now = int(stats["bytes_in_use"])
    return now, int(stats.get("peak_bytes_in_use", now))


class PeakMemory:
    """Peak bytes in use since `start` (see the module docstring); a context manager.

    Args:
      interval_s: sampling interval of the thread.
      host_fn, device_fn: readings (tests pass fakes): `host_fn() -> (now, lifetime peak)`,
        `device_fn() -> memory stats dict`.
    """

    def __init__(
        self,
        interval_s: float = 0.05,
        host_fn: Callable[[], Reading] = host_reading,
        device_fn: Callable[[], dict[str, Any]] = device_stats,
    ):
        self.interval_s = interval_s
        self.host_fn, self.device_fn = host_fn, device_fn
        self.source = "device" if device_reading(device_fn()) is not None else "host_rss"
        self._max = 0
        self._peak0 = 0
        self.baseline = 0  # bytes in use at `start`
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _read(self) -> Reading:
        if self.source == "device":
            reading = device_reading(self.device_fn())
            if reading is not None:
                return reading
        return self.host_fn()

    def sample(self) -> None:
        """Takes one reading now (the thread calls this every interval)."""
        now, _ = self._read()
        with self._lock:
            self._max = max(self._max, now)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> PeakMemory:
        now, self._peak0 = self._read()
        self._max = self.baseline = now
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="peak-memory", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.sample()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def peak(self) -> tuple[int, str]:
        """(peak bytes since `start`, source: "device" or "host_rss")."""
        now, lifetime = self._read()
        with self._lock:
            self._max = max(self._max, now)
            sampled = self._max
        return (lifetime if lifetime > self._peak0 else sampled), self.source

    def __enter__(self) -> PeakMemory:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def peak_memory_bytes() -> tuple[int, str]:
    """(peak bytes, source): the first device's peak_bytes_in_use, else the host's max RSS."""
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 (backends without memory stats raise various errors)
        stats = {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "device"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "host_rss"
