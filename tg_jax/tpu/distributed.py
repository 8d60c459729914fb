"""Multi-host start-up: one JAX process per TPU VM worker, joined by `jax.distributed`.

On a TPU pod slice every worker runs the same `python -m tg_jax.main ...` (launch/tpu.sh does
this with `--worker=all`). Before any other JAX call, each process must join the others:

    from tg_jax.tpu import distributed
    distributed.initialize_from_env()   # first line of tg_jax.main.main()

It calls `jax.distributed.initialize()` only when the environment asks for it, so single-host
runs, tests and notebooks are unaffected:

* TG_JAX_DISTRIBUTED=1 (set by launch/tpu.sh): on Cloud TPU, JAX discovers the coordinator,
  process count and process id from the TPU metadata server, so no arguments are needed.
* Elsewhere (e.g. a GPU cluster or a test of several local processes) also set
  TG_JAX_COORDINATOR=host:port, TG_JAX_NUM_PROCESSES and TG_JAX_PROCESS_ID. With
  JAX_PLATFORMS=cpu the processes' collectives go through gloo (tests/test_multihost.py).

After it, `jax.devices()` lists the devices of ALL hosts (the meshes in tg_jax span the whole
slice) and `jax.local_devices()` those of this host. Only process 0 writes metrics, summaries,
reports and exports; every process saves checkpoints (orbax coordinates them). What the
processes exchange is in tg_jax.multihost.
"""

from __future__ import annotations

import os

ENV_FLAG = "TG_JAX_DISTRIBUTED"
ENV_COORDINATOR = "TG_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "TG_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "TG_JAX_PROCESS_ID"

_initialized = False


def requested(environ: dict[str, str] | None = None) -> bool:
    """Whether the environment asks for a multi-process run."""
    env = os.environ if environ is None else environ
    return env.get(ENV_FLAG, "").strip().lower() in ("1", "true", "yes")


def initialize_kwargs(environ: dict[str, str] | None = None) -> dict[str, object]:
    """Arguments for `jax.distributed.initialize` (empty = auto-detect, as on Cloud TPU)."""
    env = os.environ if environ is None else environ
    kwargs: dict[str, object] = {}
    if env.get(ENV_COORDINATOR):
        kwargs["coordinator_address"] = env[ENV_COORDINATOR]
    if env.get(ENV_NUM_PROCESSES):
        kwargs["num_processes"] = int(env[ENV_NUM_PROCESSES])
    if env.get(ENV_PROCESS_ID):
        kwargs["process_id"] = int(env[ENV_PROCESS_ID])
    return kwargs


def initialize_from_env(environ: dict[str, str] | None = None) -> bool:
    """Joins the other processes when `TG_JAX_DISTRIBUTED=1`; returns whether it did.

    Idempotent. Must run before anything touches a JAX backend (no jax.devices() before it).
    """
    global _initialized
    env = os.environ if environ is None else environ
    platforms = env.get("JAX_PLATFORMS", "").strip().lower()
    if platforms in ("", "cpu"):  # one process with several CPU devices blocks the same way
        threads_for_blocking_collectives(env)
        devices = local_cpu_devices(env)
        if devices > 1:
            no_persistent_cache_on_cpu(f"{devices} CPU devices in one process")
    if _initialized or not requested(environ):
        return _initialized
    import jax  # noqa: PLC0415 (imported late so the environment check stays cheap)

    if platforms == "cpu":
        # CPU processes have no collectives of their own; gloo runs them over TCP.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        collective_timeout(env)
        no_persistent_cache_on_cpu()
    transfer_address(env)
    jax.distributed.initialize(**initialize_kwargs(environ))
    _barriers_off_the_devices()
    _initialized = True
    print(
        f"[tg_jax] process {jax.process_index()}/{jax.process_count()}: "
        f"{jax.local_device_count()} local of {jax.device_count()} devices",
        flush=True,
    )
    return True


# Intra-op threads per local CPU device when collectives go through gloo (see below).
THREADS_PER_CPU_DEVICE = 16


_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count="


def local_cpu_devices(env, default: int = 1) -> int:
    """The CPU devices of one process that `env` asks for: JAX_NUM_CPU_DEVICES or XLA_FLAGS'
    --xla_force_host_platform_device_count, the larger; `default` when neither is set."""
    asked = int(env.get("JAX_NUM_CPU_DEVICES", "0") or 0)  # either way of asking
    for part in env.get("XLA_FLAGS", "").split():
        if part.startswith(_DEVICE_COUNT_FLAG):
            asked = max(asked, int(part[len(_DEVICE_COUNT_FLAG) :]))
    return asked if asked > 0 else default


def cpu_devices_env(devices: int, env=None) -> dict[str, str]:
    """A copy of `env` (os.environ by default) that asks for `devices` CPU devices in one
    process: XLA_FLAGS' device count replaced, its other flags kept; JAX_NUM_CPU_DEVICES
    dropped. For a child process (a benchmark worker, a test's command)."""
    out = dict(os.environ if env is None else env)
    flags = [f for f in out.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
    out["XLA_FLAGS"] = " ".join([*flags, f"{_DEVICE_COUNT_FLAG}{devices}"])
    out.pop("JAX_NUM_CPU_DEVICES", None)
    return out


def threads_for_blocking_collectives(env) -> None:
    """Enough XLA:CPU intra-op threads that blocking collectives cannot starve them.

    XLA:CPU runs a program's independent operations concurrently on one intra-op pool per
    process (by default max(cores, local devices) threads). A gloo collective holds its pool
    thread until every process has entered it, and a collective inside a while loop (the
    scanned layers' FSDP all-gather) can start beside a top-level one. With 4 devices on 2
    cores the pool had 4 threads, all 4 blocked (3 devices in an all-reduce, 1 in the loop's
    all-gather) while the 4th device's all-reduce waited for a thread: the job hung in its
    first TG step. XLA sizes the pool from NPROC when set; it must be set before the CPU
    client exists, which is why this runs before `jax.distributed.initialize`.
    """
    if os.environ.get("NPROC"):
        return  # the user's choice stands
    devices = local_cpu_devices(env)
    os.environ["NPROC"] = str(max(os.cpu_count() or 1, THREADS_PER_CPU_DEVICE * devices))


# Seconds a gloo collective waits for the other processes before it fails (XLA's default: 30
# min). TG_JAX_COLLECTIVE_TIMEOUT_S overrides it; an --xla_cpu_collective_timeout_seconds in
# XLA_FLAGS stands.
COLLECTIVE_TIMEOUT_S = 600
ENV_COLLECTIVE_TIMEOUT = "TG_JAX_COLLECTIVE_TIMEOUT_S"
_TIMEOUT_FLAG = "--xla_cpu_collective_timeout_seconds"


def collective_timeout_s(env=None) -> float:
    """The seconds a CPU collective waits for the other processes: TG_JAX_COLLECTIVE_TIMEOUT_S,
    else COLLECTIVE_TIMEOUT_S."""
    env = os.environ if env is None else env
    return float(env.get(ENV_COLLECTIVE_TIMEOUT, "") or COLLECTIVE_TIMEOUT_S)


def collective_timeout(env) -> None:
    """A stuck gloo collective fails (JaxRuntimeError "Gloo ... Timed out waiting") instead of
    hanging: processes that stopped calling the same collectives in the same order (one
    raised before a barrier, or their executables differ, see below)
    then end with an error, and the launcher's other workers with them.

    The hangs seen on local pods came from executables loaded from the persistent
    compilation cache in one process only (`no_persistent_cache_on_cpu`). A residual
    risk stays: XLA:CPU's thunk executor hands a ready queue longer than 8 operations to
    further threads, so independent collectives of one device can run at once, and XLA's
    gloo communicator gives every collective the same tag (jaxlib 0.10.2).

    Set before the CPU client exists, like NPROC (XLA reads XLA_FLAGS when it is created).
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if _TIMEOUT_FLAG in flags:
        return  # the user's choice stands
    seconds = int(collective_timeout_s(env))
    os.environ["XLA_FLAGS"] = f"{flags} {_TIMEOUT_FLAG}={seconds}".strip()


ENV_TRANSFER_ADDRESS = "TG_JAX_TRANSFER_ADDRESS"


def transfer_address(env) -> None:
    """The socket (host:port) other processes reach this one's devices on, for `jax.device_put`
    between processes (the whole-host split's weight sync, `tg_jax.sampling.placement`): JAX
    refuses such a copy unless every process set `jax_cross_host_transfer_socket_address`.

    TG_JAX_TRANSFER_ADDRESS when set (on a pod: this host's address and a free port); else, on
    CPU (a local pod), 127.0.0.1 and a port free now (port 0 is not resolved for the peers).
    On TPU without the variable nothing is set (not verified on a TPU here).
    """
    import jax  # noqa: PLC0415

    address = env.get(ENV_TRANSFER_ADDRESS, "").strip()
    if not address and env.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        import socket  # noqa: PLC0415

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{s.getsockname()[1]}"
    if address:
        jax.config.update("jax_cross_host_transfer_socket_address", address)


def no_persistent_cache_on_cpu(why: str = "") -> None:
    """CPU runs with collectives (a CPU pod's processes, or several CPU devices in one
    process) compile every program themselves: no persistent compilation cache, whatever
    JAX_COMPILATION_CACHE_DIR or TG_JAX_COMPILATION_CACHE say. `why`, when given, is printed
    with the notice (a run with one CPU device, or on TPU, keeps its cache).

    An XLA:CPU executable loaded from the cache does not start its collectives in the order a
    fresh compile of the same HLO does (jaxlib 0.10.2): devices then wait in different
    collectives (some in the scanned layers' all-gathers, the others in a top-level
    all-reduce) until the collective timeout.
      * A CPU pod: JAX writes cache entries from process 0 only, so in a rerun process 0
        loaded the RL train step from the cache while the others compiled it. A local pod
        hung so in its first or second RL step in 3 of 3 runs where process 0 had a cache
        entry for the step, and finished in 4 of 4 where it had none (the dumped HLO of both
        was identical), with a local workdir as with a gs:// one.
      * One process with 8 CPU devices: `configs/swe.py:runlocal` with a warm cache aborted
        in its RL step (XLA's in-process rendezvous gives up after 60 s, "Termination
        timeout for all gather") in 6 of 10 runs beside a CPU-bound job, and finished in 6 of
        6 with an empty cache (the stacks of a stuck run: 7 devices in the layer loop's
        all-gather, 4 in the advantages' all-reduce; an optimization barrier between the two
        did not help, XLA:CPU drops it before it orders its operations).
    A CPU run's compiles are the tiny configs' (seconds); TPU runs keep their cache.
    """
    import jax  # noqa: PLC0415

    if why and jax.config.jax_compilation_cache_dir and jax.config.jax_enable_compilation_cache:
        print(
            f"[tg_jax] {why}: no persistent compilation cache (XLA:CPU executables loaded "
            "from it can deadlock their collectives; tg_jax.tpu.distributed)",
            flush=True,
        )
    jax.config.update("jax_enable_compilation_cache", False)


def _barriers_off_the_devices() -> None:
    """Orbax's barriers through the distributed client's key-value store, not a device
    collective: its async checkpoint thread would otherwise start a multi-device computation
    outside `tg_jax.tracing`'s lock, beside the trainer's and the sampler's."""
    from absl import flags  # noqa: PLC0415
    from orbax.checkpoint._src.multihost import multihost as ocp_multihost  # noqa: PLC0415

    flags.FLAGS[ocp_multihost.EXPERIMENTAL_ORBAX_USE_DISTRIBUTED_BARRIER.name].value = True


def is_primary() -> bool:
    """True on the process that writes reports and logs (process 0)."""
    import jax  # noqa: PLC0415

    return jax.process_index() == 0
