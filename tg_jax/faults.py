"""Deliberate faults at named points, for the soak command and the fault tests.

    TG_JAX_FAULTS="env.step@3,sandbox.kill@5" python -m tg_jax.main ...

`POINT@N` makes the N-th call (1-based, counted per process from its start) of that point
fail as the real fault would; `POINT@N+` every call from the N-th on. Points:

  env.step        an environment's step raises RuntimeError (a broken tool or plug-in)
  env.slow        an environment's step (the turn's tool calls) first sleeps a heavy-tailed
                  time: SLOW_SCALE_S x Pareto(SLOW_ALPHA) seconds, at most SLOW_MAX_S, drawn
                  from a generator seeded by the process index, so every host's tools return
                  at other times and in another order (`pause`; the pod rehearsal's)
  sandbox.kill    the namespace sandbox's run is killed (SIGKILL of its PID 1) once it starts
  checkpoint.save the checkpoint write fails with OSError(ENOSPC) (a full disk)
  step.nan        an RL step's rewards are NaN, so its loss and gradient are (a numerically
                  broken step)

Unset (the default) nothing is counted and nothing fails. The counters (and the slow
point's generator) are shared by the threads (the environments' pool calls `hit` from several
at once) under one lock.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time

ENV_VAR = "TG_JAX_FAULTS"
POINTS = ("env.step", "env.slow", "sandbox.kill", "checkpoint.save", "step.nan")
# env.slow: seconds = SLOW_SCALE_S x Pareto(SLOW_ALPHA) (mean 0.15 s, 1 in 100 over 1.1 s), cut
# at SLOW_MAX_S.
SLOW_SCALE_S, SLOW_ALPHA, SLOW_MAX_S = 0.05, 1.5, 5.0

_lock = threading.Lock()
_counts: dict[str, int] = {}
_slow: dict[str, random.Random] = {}  # point -> this process's generator of its sleeps


class InjectedFault(RuntimeError):
    """A fault raised on purpose (TG_JAX_FAULTS)."""


def _plan() -> dict[str, tuple[int, bool]]:
    """point -> (N, from N on) of TG_JAX_FAULTS; a malformed entry is a ValueError."""
    plan = {}
    for entry in filter(None, (e.strip() for e in os.environ.get(ENV_VAR, "").split(","))):
        point, _, when = entry.partition("@")
        every = when.endswith("+")
        n = when.rstrip("+")
        if point not in POINTS or not n.isdigit() or int(n) < 1:
            raise ValueError(
                f"{ENV_VAR}: bad entry {entry!r} (want POINT@N or POINT@N+, N >= 1, POINT one "
                f"of {', '.join(POINTS)})"
            )
        plan[point] = (int(n), every)
    return plan


def validate() -> None:
    """Raises ValueError (naming the entry) unless TG_JAX_FAULTS is unset or well formed."""
    _plan()


def hit(point: str) -> bool:
    """Counts one call of `point`; True when TG_JAX_FAULTS says this call fails."""
    if not os.environ.get(ENV_VAR):
        return False
    want = _plan().get(point)
    if want is None:
        return False
    with _lock:
        _counts[point] = n = _counts.get(point, 0) + 1
    return n == want[0] or (want[1] and n >= want[0])


def reset() -> None:
    """Forgets every count and generator (tests that inject faults in their own process)."""
    with _lock:
        _counts.clear()
        _slow.clear()


def _process_index() -> int:
    """This process's index under `jax.distributed` (0 alone, or before jax is imported)."""
    import sys  # noqa: PLC0415

    jax = sys.modules.get("jax")
    return int(jax.process_index()) if jax is not None else 0


def slow_seconds(point: str, process: int, n: int) -> list[float]:
    """The first `n` sleeps of `point` on process `process` (what `pause` draws, in order)."""
    gen = random.Random(f"{point}-{process}")
    return [min(SLOW_SCALE_S * gen.paretovariate(SLOW_ALPHA), SLOW_MAX_S) for _ in range(n)]


def pause(point: str) -> float:
    """Sleeps when TG_JAX_FAULTS says this call of `point` is slow: the next of this process's
    heavy-tailed draws (`slow_seconds`); returns the seconds slept (0 when not)."""
    if not hit(point):
        return 0.0
    with _lock:
        if point not in _slow:
            process = _process_index()
            _slow[point] = random.Random(f"{point}-{process}")
            logging.warning("%s: %s on process %d (tool calls sleep)", ENV_VAR, point, process)
        seconds = min(SLOW_SCALE_S * _slow[point].paretovariate(SLOW_ALPHA), SLOW_MAX_S)
    time.sleep(seconds)
    return seconds


def check(point: str) -> None:
    """Raises InjectedFault when this call of `point` is to fail."""
    if hit(point):
        raise InjectedFault(f"injected fault at {point} ({ENV_VAR})")
