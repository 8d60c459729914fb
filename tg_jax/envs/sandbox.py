"""Run untrusted, model-written Python in a throwaway subprocess.

One call = one short-lived interpreter (`python -I -S -B`, started in a new session) in a
fresh temporary working directory that is deleted afterwards, with an empty environment.

What is contained, and how:

* Time: a wall-clock deadline enforced by the parent (kill of the whole process group) and
  RLIMIT_CPU in the child.
* Memory: RLIMIT_AS (a memory bomb raises MemoryError or dies; reported as "memory").
* Output: stdout and stderr are read in chunks as they arrive; the child is killed as soon as
  either exceeds `max_output_bytes` ("output_limit"). No deadlock on full pipes.
* Processes: an audit hook refuses fork/exec/spawn/system/subprocess/kill, and RLIMIT_NPROC is
  0 (the kernel ignores it for uid 0). The process group is always SIGKILLed at the end.
* Files: the audit hook refuses writes, deletes, renames, chmods, links outside the working
  directory, `dir_fd` tricks, opens of non-str paths, device nodes and fifos, and reads of
  anything but the working dir, the interpreter's stdlib and a few /dev files (so neither
  /proc/<parent>/environ nor home directories can be read). RLIMIT_FSIZE caps file sizes.
  Calls that raise no audit event (mknod, mkfifo, chroot, set*id, pidfd_open,
  pidfd_send_signal) are deleted from `posix`/`_signal` before user code runs.
* The hook itself: no closures or mutable state, builtins bound at install time, `__code__`
  and its helpers' `__defaults__` cannot be rebound, settrace/setprofile and imports of gc,
  ctypes, _posixsubprocess etc. are refused, so it cannot be disarmed from user code.
* Network: sockets are refused by the audit hook; when `unshare` can create a network
  namespace, the child also has no network interfaces at all.
* Environment: the child gets an empty environment (`env={}`), so parent variables are absent.
* Privileges: when the parent runs as root and the interpreter is reachable by `nobody`, the
  child runs as uid/gid 65534.

What is NOT contained: the audit hook is in-process Python, a speed bump for model-written
code, not a security boundary against a determined attacker (e.g. one who rebuilds `posix`
through `_imp`, or exploits an interpreter bug). That matters most when the child runs as root
(no uid drop possible, e.g. the interpreter lives under a 0700 home): then the kernel does not
enforce RLIMIT_NPROC, and code that escapes the hook could write anywhere or fork and setsid
to outlive the run. Directory listings outside the working dir are readable. For adversarial
workloads use `backend="namespace"` (tg_jax.envs.ns_sandbox: the same prelude inside kernel
namespaces as an unprivileged uid), which is also what `python -m tg_jax.envs.sandbox` runs.

No `preexec_fn` is used: it is unsafe in a threaded parent (JAX runs many threads), so limits
are set by a trusted prelude in the child before any user code runs.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from tg_jax.envs import ns_sandbox
from tg_jax.envs.sandbox_prelude import (
    MEMORY_RC,
    SandboxResult,
    exit_status,
    prelude,
)

BACKENDS = ("audit", "namespace")
_NOBODY = 65534
_READ_CHUNK = 65536


@dataclasses.dataclass(frozen=True)
class _Launcher:
    prefix: tuple[str, ...]  # e.g. ("unshare", "--net", "--")
    drop_uid: bool  # child runs as uid/gid 65534
    popen_user: bool  # drop via Popen(user=...) rather than unshare --setuid
    network_namespace: bool


def _candidates(isolate_network: bool, drop_privileges: bool) -> list[_Launcher]:
    root = os.geteuid() == 0
    have_unshare = isolate_network and shutil.which("unshare") is not None
    out = []
    if root:
        if have_unshare and drop_privileges:
            ids = ("--setgid", str(_NOBODY), "--setuid", str(_NOBODY))
            out.append(_Launcher(("unshare", "--net", *ids, "--"), True, False, True))
        if drop_privileges:
            out.append(_Launcher((), True, True, False))
        if have_unshare:
            out.append(_Launcher(("unshare", "--net", "--"), False, False, True))
    elif have_unshare:
        out.append(_Launcher(("unshare", "--user", "--map-root-user", "--net", "--"), 0, 0, 1))
    out.append(_Launcher((), False, False, False))
    return out


@functools.cache
def _launcher(isolate_network: bool, drop_privileges: bool) -> _Launcher:
    """Strongest launcher that can actually run the interpreter here (probed once)."""
    for cand in _candidates(isolate_network, drop_privileges):
        res = _run("print(6 * 7)", cand, 5.0, 2, 256, 4096, 1, 32, True)
        if res.status == "ok" and res.stdout == "42\n":
            return cand
    return _Launcher((), False, False, False)


def sandbox_info(isolate_network: bool = True, drop_privileges: bool = True) -> dict[str, bool]:
    """Which OS-level isolation is in effect on this machine.

    Returns:
      {"network_namespace": bool, "uid_drop": bool}.
    """
    lau = _launcher(isolate_network, drop_privileges)
    return {"network_namespace": bool(lau.network_namespace), "uid_drop": bool(lau.drop_uid)}


def run_python(
    code: str,
    *,
    timeout_s: float = 2.0,
    cpu_s: int = 2,
    memory_mb: int = 256,
    max_output_bytes: int = 4096,
    max_file_mb: int = 1,
    max_open_files: int = 32,
    isolate_network: bool = True,
    drop_privileges: bool = True,
    audit: bool = True,
    backend: str = "audit",
) -> SandboxResult:
    """Runs `code` as a script in a sandboxed interpreter and returns what happened.

    Args:
      code: Python source, run as `__main__` from a file "main.py" in a fresh temp dir.
      timeout_s: wall-clock limit in seconds (the process group is killed at the deadline).
      cpu_s: RLIMIT_CPU in seconds.
      memory_mb: RLIMIT_AS in MiB (includes the interpreter itself, ~20 MiB).
      max_output_bytes: cap on each of stdout and stderr; exceeding it kills the child.
      max_file_mb: RLIMIT_FSIZE in MiB.
      max_open_files: RLIMIT_NOFILE.
      isolate_network: also run in a fresh network namespace when `unshare` allows it.
      drop_privileges: when running as root, run the child as uid 65534 if that works here.
      audit: install the audit hook (only tests of the OS-level backstops turn it off).
      backend: "audit" (this module: a subprocess under the audit hook) or "namespace"
        (tg_jax.envs.ns_sandbox: the same hook inside kernel namespaces; isolate_network and
        drop_privileges are implied there).

    Returns:
      A SandboxResult; this function never raises for anything the code does (the
      namespace backend raises SandboxUnavailable where it cannot be set up).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "namespace":
        return ns_sandbox.run_python(
            code,
            timeout_s=timeout_s,
            cpu_s=cpu_s,
            memory_mb=memory_mb,
            max_output_bytes=max_output_bytes,
            max_file_mb=max_file_mb,
            max_open_files=max_open_files,
            audit=audit,
        )
    lau = _launcher(isolate_network, drop_privileges)
    return _run(
        code, lau, timeout_s, cpu_s, memory_mb, max_output_bytes, max_file_mb, max_open_files, audit
    )


def _run(
    code: str,
    lau: _Launcher,
    timeout_s: float,
    cpu_s: int,
    memory_mb: int,
    max_output_bytes: int,
    max_file_mb: int,
    max_open_files: int,
    audit: bool,
) -> SandboxResult:
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="tg_sandbox_"))
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8", errors="replace") as f:
            f.write(code)
        if lau.drop_uid:
            os.chown(workdir, _NOBODY, _NOBODY)
            os.chown(os.path.join(workdir, "main.py"), _NOBODY, _NOBODY)
        code = prelude(workdir, cpu_s, memory_mb, max_file_mb, max_open_files, audit)
        argv = [*lau.prefix, sys.executable, "-I", "-S", "-B", "-X", "utf8", "-c", code]
        extra = dict(user=_NOBODY, group=_NOBODY, extra_groups=[]) if lau.popen_user else {}
        return _supervise(argv, workdir, extra, timeout_s, cpu_s, memory_mb, max_output_bytes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _live_group_members(pgid: int) -> bool:
    """Whether a non-zombie process is still in group `pgid` (zombies hold no resources)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != b"Z" and int(fields[2]) == pgid:
                return True
    return False


def _await_group_exit(pgid: int, timeout_s: float = 2.0) -> None:
    """Blocks until every process of the group is gone, so callers may rely on it.

    Forked members are not our children, so SIGKILL reaches them asynchronously; one
    `killpg(pgid, 0)` answers in the common case (no member ever forked)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        if not os.path.isdir("/proc") or not _live_group_members(pgid):
            return
        _kill_group(pgid)
        time.sleep(0.002)


def _supervise(
    argv: list[str],
    workdir: str,
    extra: dict,
    timeout_s: float,
    cpu_s: int,
    memory_mb: int,
    cap: int,
) -> SandboxResult:
    start = time.monotonic()
    deadline = start + timeout_s
    try:
        proc = subprocess.Popen(
            argv,
            cwd=workdir,
            env={},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
            **extra,
        )
    except OSError as e:
        return SandboxResult("killed", "", str(e), None, 0.0, f"killed: could not start ({e})")
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    timed_out = flooded = False
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(timeout=left):
                try:
                    chunk = os.read(key.fd, _READ_CHUNK)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = bufs[key.fd]
                buf += chunk[: cap + 1 - len(buf)]
                if len(buf) > cap:
                    flooded = True
            if flooded:
                break
        if not (timed_out or flooded):
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        sel.close()
        # The group is killed before the final reap, on every path: nothing may survive.
        _kill_group(proc.pid)
        proc.wait()
        _await_group_exit(proc.pid)
        proc.stdout.close()
        proc.stderr.close()
    wall = time.monotonic() - start
    rc = proc.returncode
    stdout = bytes(bufs[out_fd][:cap]).decode("utf-8", "replace")
    stderr = bytes(bufs[err_fd][:cap]).decode("utf-8", "replace")
    if flooded:
        status, msg = "output_limit", f"output_limit: output exceeded {cap} bytes"
    elif timed_out:
        status, msg = "timeout", f"timeout: wall-clock limit {timeout_s:g} s exceeded"
    elif rc == -signal.SIGXCPU:
        status, msg = "timeout", f"timeout: CPU time limit {cpu_s} s exceeded"
    elif rc == MEMORY_RC:
        status, msg = "memory", f"memory: memory limit {memory_mb} MB exceeded"
    else:
        status, msg = exit_status(rc, stderr)
    return SandboxResult(status, stdout, stderr, rc, wall, msg, proc.pid)


if __name__ == "__main__":
    # The CLI of the namespace sandbox: python -m tg_jax.envs.sandbox --repo DIR -- CMD ...
    sys.exit(ns_sandbox.main())
