"""One thread traces at a time: the process-wide tracing lock and the `jit` that takes it.

A run has up to three threads that call jitted functions: the trainer (train step, the
held-out evaluation), the sampling loop (`tg_jax.sampling.loop`) and the environments' thread
pool (no JAX, but Python state: `ast`, regexes, jinja). Tracing runs Python: Flax builds and
binds module classes, and building a Flax module class briefly removes fields from its base
classes' `__dataclass_fields__` (flax.linen.kw_only_dataclasses), so two threads tracing the
same model at once can crash ("dictionary changed size during iteration") or read a class
half built. The rule that makes the class of bug impossible:

  * every function tg_jax jits is jitted with `tracing.jit` (tests/test_tracing.py fails on a
    bare `jax.jit` in the package): calling it holds `TRACE_LOCK` for the call, so tracing,
    compiling and dispatching happen in one thread at a time. Execution is not under the lock:
    JAX dispatches asynchronously (on CPU too), so the call returns once the computation is
    enqueued, and a compiled, cached call holds the lock for microseconds; the threads' device
    work still overlaps;
  * module classes are built once, at first use, under `build_lock` (`models.qwen3`'s scanned
    layer stack), never per call;
  * the lock is re-entrant (a jitted function that calls another while tracing takes it
    again), and code that holds it never waits on another thread (no queue, no join), so it
    cannot deadlock;
  * on CPU with several devices, a call also waits under the lock until its computation has
    run (`serial_execution`): XLA:CPU starts each device's part of a computation when that
    device's inputs are ready, not in dispatch order, so the trainer's step and the sampling
    thread's call, both with collectives over the same devices, could start in different
    orders on different devices and wait for each other forever (in one process XLA aborts
    after its rendezvous timeout; across processes, gloo waits for good). One multi-device
    computation runs at a time there; a computation only waits on devices (and, across
    processes, on the same call in the other processes' trainer threads), never on a thread
    that wants the lock. TPUs and GPUs order each device's work by launch: nothing waits.

docs/design.md (section "Threads") lists every object the threads share and how it is kept.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable
from typing import Any

import jax

TRACE_LOCK = threading.RLock()
_serial: bool | None = None


def serial_execution() -> bool:
    """Whether a call waits for its computation under the lock (CPU, several devices)."""
    global _serial
    if _serial is None:
        _serial = jax.default_backend() == "cpu" and jax.device_count() > 1
    return _serial


# Traces per jitted function's name, since the process started (every trace holds
# TRACE_LOCK): a test asserts that a loop of steps traced (so compiled) its step as often as
# its inputs' shapes changed, and no more.
TRACES: collections.Counter[str] = collections.Counter()


def trace_count(name: str) -> int:
    """How many times functions named `name` were traced by `jit` in this process."""
    with TRACE_LOCK:
        return TRACES[name]


class Jitted:
    """`jax.jit(fn, **kwargs)` whose calls (and `lower`, `trace`, `eval_shape`) hold
    TRACE_LOCK; every other attribute is the jitted function's (e.g. `_cache_size`). Each
    trace of `fn` counts in `TRACES` under its name."""

    def __init__(self, fn: Callable[..., Any], **jit_kwargs: Any):
        name = getattr(fn, "__name__", repr(fn))

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            TRACES[name] += 1
            return fn(*args, **kwargs)

        self._jitted = jax.jit(counted, **jit_kwargs)
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with TRACE_LOCK:
            out = self._jitted(*args, **kwargs)
            if serial_execution():  # see the module docstring
                jax.block_until_ready(out)
            return out

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        with TRACE_LOCK:
            return self._jitted.lower(*args, **kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        with TRACE_LOCK:
            return self._jitted.trace(*args, **kwargs)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        with TRACE_LOCK:
            return self._jitted.eval_shape(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_jitted"], name)


def jit(fn: Callable[..., Any] | None = None, **jit_kwargs: Any) -> Any:
    """`jax.jit` under TRACE_LOCK: `jit(fn, static_argnames=...)`, or as a decorator,
    `@jit` / `@functools.partial(jit, static_argnums=0)`."""
    if fn is None:
        return functools.partial(jit, **jit_kwargs)
    return Jitted(fn, **jit_kwargs)


# Building a Flax module class (nn.scan, nn.remat, any Module subclass made at run time)
# mutates its bases' dataclass fields while it runs: one thread at a time, and once per class.
build_lock = threading.Lock()


def eval_shape(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`jax.eval_shape` under TRACE_LOCK (it traces `fn`, e.g. a model's init)."""
    with TRACE_LOCK:
        return jax.eval_shape(fn, *args, **kwargs)
