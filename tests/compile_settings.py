"""How the tests compile: XLA:CPU's quick settings, in the pytest processes and in every
command they run in a subprocess (conftest.py keeps them in XLA_FLAGS).

The tests' programs are tiny and run for moments, so compiling is most of their time, and a
command with several CPU devices compiles every program afresh (no persistent cache:
tg_jax.tpu.distributed.no_persistent_cache_on_cpu). The settings:
  * no LLVM optimization (`--xla_backend_optimization_level=0`, no expensive passes).
    Measured on a 2-vCPU AMD EPYC, empty compilation cache: tests/test_train_step.py 212 s ->
    97 s in-process; `python -m tg_jax.main --config=configs/thinking.py` on
    test_hidden_thinking's tiny settings (one device) 65 s -> 47 s wall, 94 s -> 60 s CPU.
  * jaxlib 0.10: XLA:CPU's LLVM IR emitters, not its MLIR fusion emitters
    (`--xla_cpu_use_fusion_emitters=false`), and one codegen thread (the suite runs one test
    per core already). Measured on a 2-vCPU Intel Xeon, empty cache, before -> after:
    tests/test_teacher.py + tests/test_hidden_thinking.py 229 -> 116 CPU s (180 -> 114 s
    wall); tests/test_train_step.py 147 -> 64 CPU s; tests/test_shipped_base.py +
    tests/test_faults.py (commands in subprocesses) 285 -> 222 CPU s; the whole suite 27:56.
    jaxlib 0.11 (the py312 lane) has no such flag.
A user's run keeps XLA's defaults: it trains for minutes or hours, where optimized code pays.
Two different programs that compute the same sum may round differently under either
setting (fusion decides the order of a reduction): the two tests that compared such programs
bit for bit (the TG term compiled in or not) compare them to float32 rounding.

JAX keys its persistent cache on XLA_FLAGS, so the subprocesses' entries never mix with a
user's; the pytest processes (8 devices) keep theirs in a directory of their own
(IN_PROCESS_CACHE, under the one the subprocesses use).
"""

import importlib.metadata
import os

IN_PROCESS_CACHE = "pytest_processes"


def _jaxlib_version() -> tuple[int, int]:
    major, minor = importlib.metadata.version("jaxlib").split(".")[:2]
    return int(major), int(minor)


QUICK_XLA_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_parallel_codegen_split_count=1",
    *(("--xla_cpu_use_fusion_emitters=false",) if _jaxlib_version() < (0, 11) else ()),
)


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
