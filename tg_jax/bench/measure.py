"""Timing helpers shared by the benchmarks: median wall time, the matmul peak, machine load,
and paired timing of two implementations in worker processes.

Every figure of `tg_jax.bench` is a wall-clock median of `repeats` calls after `warmup` calls
(compilation, allocator growth and first-touch page faults land in the warm-up). The machine's
1-minute load average is read next to each figure: on a shared CPU it explains most noise.

Paired timing (`CallWorker`, `paired_timings`): on a shared machine the speed of the same code
drifts by tens of percent within minutes, so timing one implementation and then the other
turns drift into a bias of their ratio. Instead each side is prepared (loaded, compiled,
warmed up) in its own worker process, and the calls alternate, one per side per round; the
ratio of each round compares calls made seconds apart. A worker is kept stopped (SIGSTOP)
while the other side runs, so that its idle threads (e.g. OpenMP threads spinning under
OMP_WAIT_POLICY=ACTIVE) cannot take CPU from the call being timed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import jax.numpy as jnp
import numpy as np

from tg_jax import tracing


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
    return timing_of(times, cpu)


def timing_of(walls: list[float], cpus: list[float]) -> Timing:
    """The Timing of calls' wall and CPU seconds (the load average read now)."""
    return Timing(
        statistics.median(walls), min(walls), tuple(walls), statistics.median(cpus), load_average()
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
    matmul = tracing.jit(jnp.matmul)
    timing = time_calls(lambda: matmul(a, b).block_until_ready(), repeats, warmup=2)
    return 2.0 * n**3 / timing.median, timing


def cpu_count() -> int:
    """CPUs this process may run on (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def serve_calls(
    fn: Callable[[], Any],
    warmup: int = 1,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
) -> None:
    """The worker side of `CallWorker`: warms `fn` up, says it is ready, then times one call of
    `fn` per "run" line on stdin (one JSON line {"wall", "cpu"} each) until stdin closes."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    for _ in range(warmup):
        fn()
    print(json.dumps({"ready": True}), file=stdout, flush=True)
    for line in stdin:
        if line.strip() != "run":
            raise ValueError(f"expected 'run', got {line.strip()!r}")
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        print(json.dumps({"wall": wall, "cpu": cpu}), file=stdout, flush=True)


class CallWorker:
    """A worker process (`command`, e.g. [python, "-m", module]) that times one call of a
    prepared function per request (`serve_calls`); it is kept stopped (SIGSTOP) whenever it is
    not serving a request.

    The worker reads one JSON job line on stdin, prepares and warms up, prints {"ready": true},
    then serves "run" lines. A worker that exits, prints something else or takes longer than
    `timeout_s` for a step raises RuntimeError with the tail of its stderr; `close` (or leaving
    the `with` block) ends it and its process group.
    """

    def __init__(
        self,
        command: Sequence[str],
        job: dict[str, Any],
        *,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 1800.0,
        name: str = "",
    ):
        self.name = name or " ".join(command)
        self.timeout_s = timeout_s
        self._stderr = tempfile.TemporaryFile()
        self._buffer = b""
        self._proc = subprocess.Popen(
            list(command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=None if env is None else dict(env),
            start_new_session=True,
        )
        try:
            self._send(json.dumps(job))
            self._read_json("ready")
            self._stop()
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self._proc.pid

    def call(self) -> tuple[float, float]:
        """(wall seconds, CPU seconds of the worker) of one call, timed inside the worker."""
        self._signal(signal.SIGCONT)
        try:
            self._send("run")
            reply = self._read_json("wall")
        finally:
            self._stop()
        return float(reply["wall"]), float(reply["cpu"])

    def close(self) -> None:
        if self._proc.poll() is None:
            self._signal(signal.SIGCONT)
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._signal(signal.SIGKILL)
                self._proc.wait()
        self._stderr.close()

    def __enter__(self) -> CallWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _stop(self, timeout_s: float = 2.0) -> None:
        """SIGSTOP, then waits (where /proc tells, up to `timeout_s`) until the worker is
        stopped: the signal is delivered asynchronously, and the other side's call must not
        start while this worker still runs."""
        self._signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = process_state(self._proc.pid)
            if state is None or state in "TtZX":  # no /proc, gone, stopped or exited
                return
            time.sleep(0.001)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:
            pass

    def _send(self, line: str) -> None:
        try:
            self._proc.stdin.write((line + "\n").encode())
            self._proc.stdin.flush()
        except OSError as e:
            raise self._failure(f"could not write to it ({e})") from None

    def _read_json(self, key: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout_s
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._failure(f"no reply within {self.timeout_s:.0f} s")
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise self._failure(f"exited with code {self._proc.wait()}")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            reply = None
        if not isinstance(reply, dict) or key not in reply:
            raise self._failure(f"unexpected output {line[:200]!r}")
        return reply

    def _failure(self, what: str) -> RuntimeError:
        self._signal(signal.SIGKILL)
        self._stderr.seek(0)
        tail = self._stderr.read()[-4000:].decode(errors="replace")
        return RuntimeError(f"benchmark worker {self.name} {what}; its stderr:\n{tail}")


def process_state(pid: int) -> str | None:
    """The state letter of a process from /proc/<pid>/stat (R running, S sleeping, T stopped,
    Z zombie, ...), or None where /proc does not tell (another OS, or no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def paired_timings(workers: Mapping[str, CallWorker], rounds: int) -> dict[str, Timing]:
    """Alternating calls: each round times one call of every worker, in turn, the order
    reversed every other round (so that neither side always runs first after the other).

    Returns:
      {name: Timing}; `times[r]` of every worker is from round r, so per-round ratios compare
      calls made seconds apart.
    """
    names = list(workers)
    walls: dict[str, list[float]] = {n: [] for n in names}
    cpus: dict[str, list[float]] = {n: [] for n in names}
    for r in range(max(1, rounds)):
        for name in names if r % 2 == 0 else names[::-1]:
            wall, cpu = workers[name].call()
            walls[name].append(wall)
            cpus[name].append(cpu)
    return {n: timing_of(walls[n], cpus[n]) for n in names}


def round_ratios(numerator: Timing, denominator: Timing) -> list[float]:
    """Per-round wall-time ratios of two `paired_timings` results."""
    return [a / b for a, b in zip(numerator.times, denominator.times, strict=True)]
