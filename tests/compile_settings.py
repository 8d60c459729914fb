"""How the tests compile: XLA:CPU's quick settings (no LLVM optimization), in the pytest
processes and in every command they run in a subprocess (conftest.py keeps them in XLA_FLAGS).

The tests' programs are tiny and run for moments, so compiling is most of their time, and a
command with several CPU devices compiles every program afresh (no persistent cache:
tg_jax.tpu.distributed.no_persistent_cache_on_cpu). Measured on a 2-vCPU AMD EPYC, empty
compilation cache: tests/test_train_step.py 212 s -> 97 s in-process; `python -m tg_jax.main
--config=configs/thinking.py` on test_hidden_thinking's tiny settings (one device) 65 s ->
47 s wall, 94 s -> 60 s CPU; configs/hf_tg.py:runlocal on 8 devices, 2 steps, 30 s -> 23 s CPU.
A user's run keeps XLA's defaults: it trains for minutes or hours, where optimized code pays.

JAX keys its persistent cache on XLA_FLAGS, so the subprocesses' entries never mix with a
user's; the pytest processes (8 devices) keep theirs in a directory of their own
(IN_PROCESS_CACHE, under the one the subprocesses use).
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
