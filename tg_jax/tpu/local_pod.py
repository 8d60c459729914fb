"""A local pod: rehearses a pod run of `tg_jax.tpu.launch` on one machine.

A local pod (`--local --processes=P --devices-per-process=D`) rehearses a pod run on one
machine: the same per-worker command and environment (`worker_args`, `local_worker_env`:
TG_JAX_DISTRIBUTED=1, a localhost transfer port per worker) as P local processes joined by
`jax.distributed` on localhost, each with D CPU devices (JAX_PLATFORMS=cpu, collectives over
gloo) and its own copy of the checkpoint, staged as the pod's set-up stages it. It runs the
working tree and the local venv (no install). A SIGTERM (or Ctrl-C) to the launcher reaches
every worker; the exit status is the first failing worker's (0 when all finish), and the
first worker to fail stops the others at once. Each line a worker prints carries its number
("[w1] ..."), on the stream it was printed to. Rerunning the command resumes.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any


def local_worker_env(
    base: dict[str, str],
    i: int,
    processes: int,
    devices_per_process: int,
    coordinator_port: int,
    transfer_port: int,
) -> dict[str, str]:
    """Worker i's environment in a local pod: `base` (the launcher's) plus the pod's
    variables, on localhost, and `devices_per_process` CPU devices."""
    flags = [
        base.get("XLA_FLAGS", ""),
        f"--xla_force_host_platform_device_count={devices_per_process}",
    ]
    return {
        **base,
        "TG_JAX_DISTRIBUTED": "1",
        "TG_JAX_COORDINATOR": f"localhost:{coordinator_port}",
        "TG_JAX_NUM_PROCESSES": str(processes),
        "TG_JAX_PROCESS_ID": str(i),
        "TG_JAX_TRANSFER_ADDRESS": f"127.0.0.1:{transfer_port}",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": " ".join(flags).strip(),
        "PYTHONUNBUFFERED": "1",  # lines reach the launcher as they are printed
    }


def _free_ports(n: int) -> list[int]:
    """n distinct ports free now (all bound at once, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("localhost", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _stage_checkpoint(src: str, dst: str) -> None:
    """A worker's copy of the checkpoint, as the pod set-up copies it (`gcloud storage cp -r`);
    gs:// sources go through tg_jax's own staging (etils), local ones are copied."""
    if os.path.exists(os.path.join(dst, "config.json")):
        return  # staged by an earlier run of this local pod
    if "://" in src:
        from tg_jax.models.hf_dir import stage_locally  # noqa: PLC0415 (needs tg_jax)

        src = stage_locally(src)
    tmp = dst + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    os.replace(tmp, dst)


def run(
    job: Any,
    processes: int,
    devices_per_process: int,
    *,
    args_of: Callable[[str | None], list[str]],
    stage_dir: str | None = None,
    module: str = "tg_jax.main",
) -> int:
    """Runs `job` (a `pod_slice.Job`) as `processes` local workers of `devices_per_process` CPU
    devices each (see the module docstring); returns the exit status. `module` is what each
    worker runs (`python -m`), with `args_of(its checkpoint copy)` (`pod_commands.worker_args`)."""
    if processes < 1 or devices_per_process < 1:
        raise ValueError("--processes and --devices-per-process must be >= 1")
    port, *transfer_ports = _free_ports(processes + 1)
    root = stage_dir or os.path.join(
        os.path.expanduser("~"), ".cache", "tg_jax", "local_pod", job.name
    )
    workers = []
    for i in range(processes):
        ckpt = None
        if job.hf_checkpoint:
            ckpt = os.path.join(root, f"worker{i}", "hf_checkpoint")
            os.makedirs(os.path.dirname(ckpt), exist_ok=True)
            _stage_checkpoint(job.hf_checkpoint, ckpt)
        env = local_worker_env(
            dict(os.environ), i, processes, devices_per_process, port, transfer_ports[i]
        )
        cmd = [sys.executable, "-m", module, *args_of(ckpt)]
        print(f"[local pod] worker {i}: {shlex.join(cmd)}", flush=True)
        workers.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        )
    copiers = [
        threading.Thread(target=_copy_lines, args=(pipe, stream, f"[w{i}] ".encode()), daemon=True)
        for i, w in enumerate(workers)
        for pipe, stream in ((w.stdout, sys.stdout), (w.stderr, sys.stderr))
    ]
    for t in copiers:
        t.start()

    def forward(signum, frame):
        del frame
        for w in workers:
            if w.poll() is None:
                w.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        failed_first = None  # one worker failed: the others cannot go on alone
        while any(w.poll() is None for w in workers):
            if failed_first is None:
                failed_first = next((i for i, w in enumerate(workers) if w.poll()), None)
                if failed_first is not None:
                    forward(signal.SIGTERM, None)
            time.sleep(0.2)
        codes = [w.wait() for w in workers]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for t in copiers:
            t.join(timeout=10)
    for i, c in enumerate(codes):
        if c:
            print(f"[local pod] worker {i} exited with {c}", flush=True)
    if failed_first is None:  # none had failed at a poll: all ended between two
        failed_first = next((i for i, c in enumerate(codes) if c), None)
    return 0 if failed_first is None else codes[failed_first]


_OUTPUT_LOCK = threading.Lock()  # the workers' copier threads share the launcher's streams


def _copy_lines(pipe, stream, prefix: bytes) -> None:
    """Copies a worker's output to `stream` line by line (carriage returns kept, so progress
    bars stay one line), each line behind `prefix`."""
    out = getattr(stream, "buffer", None)
    for line in iter(pipe.readline, b""):
        with _OUTPUT_LOCK:
            if out is None:  # a text stream without a buffer (a test's capture)
                stream.write((prefix + line).decode(errors="replace"))
            else:
                stream.flush()
                out.write(prefix + line)
            stream.flush()
    pipe.close()
