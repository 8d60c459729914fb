"""Deliberate faults at named points, for the soak command and the fault tests.

    TG_JAX_FAULTS="env.step@3,sandbox.kill@5" python -m tg_jax.main ...

`POINT@N` makes the N-th call (1-based, counted per process from its start) of that point
fail as the real fault would; `POINT@N+` every call from the N-th on. Points:

  env.step        an environment's step raises RuntimeError (a broken tool or plug-in)
  sandbox.kill    the namespace sandbox's run is killed (SIGKILL of its PID 1) once it starts
  checkpoint.save the checkpoint write fails with OSError(ENOSPC) (a full disk)
  step.nan        an RL step's rewards are NaN, so its loss and gradient are (a numerically
                  broken step)

Unset (the default) nothing is counted and nothing fails. The counters are shared by the
threads (the environments' pool calls `hit` from several at once) under one lock.
"""

from __future__ import annotations

import os
import threading

ENV_VAR = "TG_JAX_FAULTS"
POINTS = ("env.step", "sandbox.kill", "checkpoint.save", "step.nan")

_lock = threading.Lock()
_counts: dict[str, int] = {}


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
    """Forgets every count (tests that inject faults in their own process)."""
    with _lock:
        _counts.clear()


def check(point: str) -> None:
    """Raises InjectedFault when this call of `point` is to fail."""
    if hit(point):
        raise InjectedFault(f"injected fault at {point} ({ENV_VAR})")
