"""`rl_loop.profile_steps`: a JAX profiler trace of chosen RL steps.

    with StepProfile(config.rl_loop, run_dir) as profile:
        for done in steps:
            with profile.step(done):
                ...  # the step, its device work finished inside

Every step runs under a `jax.profiler.StepTraceAnnotation("rl_step", step_num=N)` (free when
no trace is on); from step `first` to step `last` (`profile_steps = (first, last)`) the
profiler writes <run>/profile/plugins/profile/<time>/<host>.xplane.pb, which TensorBoard's
profile plugin (`tensorboard --logdir <run>/profile`) and Perfetto open. A run stopped or
resumed inside the range keeps what was traced (the trace ends with the loop).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import jax

PROFILE_DIR = "profile"


class StepProfile(contextlib.AbstractContextManager):
    """The trace of `rl_loop.profile_steps` (module docstring)."""

    def __init__(self, loop_config: Any, run_dir: str):
        steps = tuple(loop_config.get("profile_steps", ()))
        self.first, self.last = (int(steps[0]), int(steps[1])) if steps else (0, -1)
        self.directory = os.path.join(os.fspath(run_dir), PROFILE_DIR)
        self.tracing = False

    @contextlib.contextmanager
    def step(self, done: int) -> Iterator[None]:
        """Step `done` (1-based); the trace starts before the first and stops after the last."""
        if self.first <= done <= self.last and not self.tracing:
            jax.profiler.start_trace(self.directory)
            self.tracing = True
        with jax.profiler.StepTraceAnnotation("rl_step", step_num=done):
            yield
        if done >= self.last:
            self.stop()

    def stop(self) -> None:
        if self.tracing:
            self.tracing = False
            jax.profiler.stop_trace()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
