"""How the pytest processes compile, and the environment of a child that must compute as they do.

The pytest processes compile with XLA:CPU's quick settings (no LLVM optimization): their
programs are tiny and run for moments, so compiling is most of their time. Measured on a
2-vCPU AMD EPYC, empty compilation cache, `pytest -n 2`: tests/test_train_step.py 212 s ->
97 s; test_teacher, test_sampler, test_rollout and test_ppo_updates together 560 s -> 312 s.
The commands the tests run in subprocesses keep XLA's defaults, as a user's run has: they
train for minutes, where the optimized code pays (test_pipeline and test_gcs with the quick
settings: 352 s -> 375 s).

JAX keys its persistent cache on the XLA_FLAGS of the environment when it compiles, and the
pytest processes give the quick flags to XLA only while their CPU client is made: so they keep
their executables in a directory of their own (IN_PROCESS_CACHE, under the cache the
subprocesses use), where a subprocess with the defaults never finds them.
"""

import os

QUICK_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
IN_PROCESS_CACHE = "pytest_processes"


def with_quick_flags(env) -> dict[str, str]:
    """A copy of `env` whose XLA_FLAGS carry QUICK_XLA_FLAGS (its other flags kept): for a child
    process whose results must equal, bit for bit, a computation of the pytest process."""
    out = dict(env)
    flags = [f for f in out.get("XLA_FLAGS", "").split() if f not in QUICK_XLA_FLAGS]
    out["XLA_FLAGS"] = " ".join([*flags, *QUICK_XLA_FLAGS])
    return out


def cache_root() -> str:
    """The compilation cache of the tests' subprocesses: TG_JAX_COMPILATION_CACHE, else
    ./.jax_cache in the checkout."""
    default = os.path.join(os.path.dirname(__file__), "..", ".jax_cache")
    return os.path.abspath(os.environ.get("TG_JAX_COMPILATION_CACHE", default))
