"""Kernel-enforced sandbox for commands: namespaces, a private root, rlimits, a wall clock.

    python -m tg_jax.envs.sandbox --repo DIR [--timeout S] -- CMD ARGS...

runs CMD over a throwaway copy of DIR and prints one JSON object (status, returncode, stdout
and stderr tails, wall_s, message). `run_command` is the library form, `run_python` runs one
script with the audit hook of tg_jax.envs.sandbox as an inner layer, `run_many` runs jobs
from a thread pool (the waits release the GIL; the work is in the children).

Mechanism: the first run starts a launcher server (tg_jax/envs/ns_launcher.py, host root,
empty environment, stdlib only) that forks one launcher per run from a warm interpreter; a
run's pipes reach it over a socketpair. The launcher makes the unshare/mount/pivot_root
calls itself through ctypes: neither util-linux `unshare` nor bubblewrap is needed (no exec
per step, and the steps can be ordered as below, which `unshare` cannot: mounts first, the
user namespace last). The server exits when this process does (EOF on its socket).

Isolation:

* Namespaces: new mount, PID, network, IPC, UTS and cgroup namespaces, then a user one.
  The mount and network namespaces are owned by the host's initial user namespace, because
  the user namespace is created only after the mounts and after the drop to an unprivileged
  host uid: the command has no capability over its mounts (it cannot remount the read-only
  binds, mount over them or unmount them) nor over its network namespace (no interfaces to
  bring up; its loopback is down, so every connect fails). Root inside a user namespace
  could do exactly that with namespaces its user namespace owns (remount binds rw, mount
  tmpfs, configure its net namespace) but never touch host resources; here the command is
  not even that: it runs as uid 1000 in its user namespace (host uid `HOST_UID`), with no
  capabilities anywhere, no_new_privs set, nested user namespaces disabled.
  Rootless (the supervisor is not root): the launcher first enters a user namespace where
  it is root (its own uid mapped to 0), which then owns the other namespaces; the command
  runs in a nested user namespace as uid 1000 (= the caller's uid on the host), with no
  capability in the one owning its mounts, so the same holds.
* Files: the root is a tmpfs of `disk_mb` MiB (it also holds /repo, /tmp and /dev/shm, so
  one cap bounds a disk filler; RLIMIT_FSIZE caps single files), read-only after set-up.
  Visible: read-only binds of /usr, /bin, /lib*, /sbin, the interpreter's prefixes (the
  venv and its base), /etc/ld.so.cache and /etc/alternatives, a synthetic /etc/passwd,
  null/zero/full/random/urandom, a fresh /proc of the new PID namespace. Not visible: the
  rest of the host (/etc/shadow, /root, /home, /work, other sandboxes' copies, host /tmp,
  the host's processes and their environments). The working copy /repo is a copy of the
  repository made by the launcher into the tmpfs, so no host file changes and nothing is
  left to clean up: it vanishes with the mount namespace.
* Processes: subprocesses are allowed. RLIMIT_NPROC (`nproc`) is counted per user
  namespace and uid (so per sandbox), and enforced because the host uid is not root: a
  fork bomb gets EAGAIN. The launcher is PID 1 of the namespace; when the command exits it
  exits, and the kernel kills everything left (daemons that setsid included). The
  wall-clock deadline kills PID 1, which kills the namespace. Nothing inside can signal a
  host process (none is visible) or its PID 1 (which handles no signal).
* Limits: RLIMIT_CPU, RLIMIT_AS (per process; nproc x memory_mb bounds the total),
  RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE = 0; stdout/stderr are read as they arrive and
  the run is killed when either exceeds `max_output_bytes` (the result keeps the tails).
* Environment: the command gets only PATH, HOME, TMPDIR, LANG and what `env` adds.

Not contained: kernel bugs (the command makes arbitrary system calls: no seccomp filter);
CPU time and memory bandwidth are shared with the host, and total memory is bounded only by
nproc x memory_mb plus the tmpfs (no cgroup); /proc and the read-only system directories
are readable (kernel and distribution facts, no host secrets). Where namespaces cannot be
created (user namespaces disabled, a seccomp-confined container) `check_available`
and every run raise SandboxUnavailable naming the step that failed; nothing falls back.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import functools
import json
import marshal
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from tg_jax import faults
from tg_jax.envs import sandbox_prelude

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ns_launcher.py")
HOST_UID = 2_000_000  # host uid of every sandboxed process (unprivileged, in no /etc/passwd)
MOUNTPOINT = "/tmp/tg_ns_sandbox_root"  # empty host dir the private tmpfs root covers (+"-UID")
WORKDIR = "/repo"  # the working copy inside the sandbox
_SYSTEM_RO = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC = ("/etc/ld.so.cache", "/etc/localtime", "/etc/nsswitch.conf", "/etc/alternatives")
_READ_CHUNK = 65536


class SandboxUnavailable(RuntimeError):
    """The namespace sandbox cannot be set up here; the message names the missing piece."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-run limits.

    Attributes:
      timeout_s: wall-clock limit; at the deadline the whole PID namespace is killed.
      cpu_s: RLIMIT_CPU of each process.
      memory_mb: RLIMIT_AS of each process.
      nproc: RLIMIT_NPROC: processes (and threads) of the sandbox, the launcher included.
      disk_mb: size of the tmpfs holding /repo, /tmp and /dev/shm.
      inodes: inode count of that tmpfs (bounds a filler of empty files).
      max_file_mb: RLIMIT_FSIZE.
      max_open_files: RLIMIT_NOFILE.
      max_output_bytes: cap on each of stdout and stderr; exceeding it kills the run.
    """

    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    nproc: int = 64
    disk_mb: int = 64
    inodes: int = 4096
    max_file_mb: int = 16
    max_open_files: int = 256
    max_output_bytes: int = 1 << 20


def ro_paths() -> tuple[str, ...]:
    """Host paths bound read-only: system directories and this interpreter's prefixes."""
    prefixes = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(sys.executable))}
    prefixes |= {os.path.realpath(p) for p in prefixes}
    paths = [p for p in _SYSTEM_RO if os.path.lexists(p)]
    for prefix in sorted(prefixes):
        if not any(prefix == q or prefix.startswith(q.rstrip("/") + "/") for q in paths):
            paths.append(prefix)
    return tuple(paths)


def _mountpoint() -> str:
    return MOUNTPOINT if os.geteuid() == 0 else f"{MOUNTPOINT}-{os.geteuid()}"


def _default_env() -> dict[str, str]:
    bindir = os.path.dirname(sys.executable)
    return {
        "PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin",
        "HOME": "/tmp",
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
    }


def _params(argv, repo, files, env, limits: Limits) -> dict[str, Any]:
    for rel in files:
        parts = rel.split("/")
        if rel.startswith("/") or ".." in parts or "" in parts:
            raise ValueError(f"file names must be relative paths inside the copy: {rel!r}")
    if repo is not None and not os.path.isdir(repo):
        raise ValueError(f"repository {repo!r} is not a directory")
    return {
        "argv": list(argv),
        "repo": None if repo is None else os.path.realpath(repo),
        "files": dict(files),
        "env": {**_default_env(), **dict(env)},
        "ro": list(ro_paths()),
        "etc": list(_ETC),
        "mountpoint": _mountpoint(),
        "uid": HOST_UID if os.geteuid() == 0 else None,  # None: rootless
        "timeout_s": limits.timeout_s,
        "cpu_s": max(1, int(limits.cpu_s)),
        "memory_mb": int(limits.memory_mb),
        "nproc": int(limits.nproc),
        "disk_mb": int(limits.disk_mb),
        "inodes": int(limits.inodes),
        "max_file_mb": int(limits.max_file_mb),
        "max_open_files": int(limits.max_open_files),
    }


def run_command(
    argv: Sequence[str],
    *,
    repo: str | None = None,
    files: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
    limits: Limits = Limits(),
) -> sandbox_prelude.SandboxResult:
    """Runs `argv` in /repo of a fresh sandbox holding a copy of `repo` plus `files`.

    Args:
      argv: the command; argv[0] is looked up on the sandbox's PATH (the venv's bin first).
      repo: host directory copied into the sandbox's /repo (symlinks are copied as links).
      files: {relative path: text} written into /repo after the copy.
      env: extra environment variables of the command.
      limits: see Limits.

    Returns:
      A SandboxResult: status "ok" (exit 0), "error" (other exit), "timeout" (wall clock or
      RLIMIT_CPU), "output_limit", or "killed" (a signal); pid is the launcher's host pid.

    Raises:
      SandboxUnavailable: the namespaces or the private root could not be set up.
    """
    if not argv:
        raise ValueError("argv must not be empty")
    os.makedirs(_mountpoint(), mode=0o700, exist_ok=True)
    params = _params(argv, repo, files or {}, env or {}, limits)
    return _supervise(marshal.dumps(params), limits)


class _Server:
    """This process's launcher server (ns_launcher.py): one warm root interpreter that forks
    a launcher per run, so a run costs a fork instead of an interpreter start-up."""

    def __init__(self):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", LAUNCHER, str(theirs.fileno())],
                env={},
                cwd="/",
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=(theirs.fileno(),),
            )
        finally:
            theirs.close()
        self.sock, self.owner = mine, os.getpid()

    def alive(self) -> bool:
        return self.owner == os.getpid() and self.proc.poll() is None

    def close(self) -> None:
        self.sock.close()  # EOF: the server exits
        try:
            self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_server: _Server | None = None
_server_lock = threading.Lock()


def server_pid() -> int | None:
    """Host pid of this process's launcher server, None before the first run."""
    server = _server
    return server.proc.pid if server is not None and server.alive() else None


@atexit.register
def _close_server() -> None:
    global _server
    with _server_lock:
        if _server is not None and _server.owner == os.getpid():
            _server.close()
        _server = None


def _request(fds: list[int]) -> None:
    global _server
    with _server_lock:
        for _ in range(2):  # a server that died (or belongs to the parent of a fork) is replaced
            if _server is None or not _server.alive():
                _server = _Server()
            try:
                socket.send_fds(_server.sock, [b"run"], fds)
                return
            except OSError:
                _server = None
    raise SandboxUnavailable("namespace sandbox: the launcher server accepts no requests")


def _spawn(payload: bytes) -> tuple[int, int, int]:
    """Starts one run; returns the read ends (status, stdout, stderr)."""
    p_read, p_write = os.pipe()
    s_read, s_write = os.pipe()
    o_read, o_write = os.pipe()
    e_read, e_write = os.pipe()
    try:
        _request([p_read, s_write, o_write, e_write])
    except BaseException:
        for fd in (p_write, s_read, o_read, e_read):
            os.close(fd)
        raise
    finally:
        for fd in (p_read, s_write, o_write, e_write):
            os.close(fd)
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(p_write, view) :]
    except BrokenPipeError:
        pass  # the launcher died before reading: its status says why
    finally:
        os.close(p_write)
    return s_read, o_read, e_read


class _Pump:
    """Reads stdout, stderr (keeping tails of `cap` bytes) and the status pipe."""

    def __init__(self, status_fd: int, out_fd: int, err_fd: int, cap: int):
        self.cap, self.status_fd = cap, status_fd
        self.bufs = {out_fd: bytearray(), err_fd: bytearray()}
        self.total = dict.fromkeys(self.bufs, 0)
        self.status = bytearray()
        self.sel = selectors.DefaultSelector()
        for fd in (status_fd, out_fd, err_fd):
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ)

    def outputs_open(self) -> bool:
        return any(fd in self.sel.get_map() for fd in self.bufs)

    def run(self, deadline: float, capped: bool = True) -> str:
        """Until both outputs close (the launcher exited): "", "timeout" or (if `capped`)
        "output_limit"."""
        while self.outputs_open():
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            for key, _ in self.sel.select(timeout=left):
                try:
                    chunk = os.read(key.fd, _READ_CHUNK)
                except BlockingIOError:
                    continue
                if not chunk:
                    self.sel.unregister(key.fd)
                    os.close(key.fd)
                elif key.fd == self.status_fd:
                    self.status += chunk
                else:
                    buf = self.bufs[key.fd]
                    buf += chunk
                    del buf[: max(0, len(buf) - self.cap)]  # keep the tail
                    self.total[key.fd] += len(chunk)
                    if capped and self.total[key.fd] > self.cap:
                        return "output_limit"
        return ""

    def drain_status(self) -> None:
        """The rest of the status pipe; its writers (the launcher, I) are gone by now."""
        while self.status_fd in self.sel.get_map():
            try:
                chunk = os.read(self.status_fd, _READ_CHUNK)
            except BlockingIOError:
                return
            if not chunk:
                self.sel.unregister(self.status_fd)
                os.close(self.status_fd)
            self.status += chunk

    def fields(self) -> dict[str, str]:
        out = {}
        for line in self.status.decode("utf-8", "replace").splitlines():
            key, _, value = line.partition(" ")
            out[key] = value
        return out

    def close(self) -> None:
        for key in list(self.sel.get_map().values()):
            os.close(key.fd)
        self.sel.close()


def _kill(fields: dict[str, str]) -> None:
    """Kills PID 1 of the namespace (which kills the rest), else the launcher's group.

    Called only while the launcher holds the output pipes open, so it is alive and I, its
    child, is unreaped: neither pid can have been reused."""
    for key, kill in (("pid", os.kill), ("launcher", os.killpg)):
        if fields.get(key, "").isdigit():
            try:
                kill(int(fields[key]), signal.SIGKILL)
                return
            except ProcessLookupError:
                continue


def _await_exit(pid: int, timeout_s: float = 2.0) -> None:
    """Waits out the launcher's last microseconds: its pipes close before it is gone."""
    if pid <= 0:
        return
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        select.select([fd], [], [], timeout_s)
    finally:
        os.close(fd)


def _kill_when_started(pump: _Pump, timeout_s: float = 5.0) -> None:
    """The `sandbox.kill` fault (tg_jax.faults): SIGKILL the run's PID 1 once it has one, as
    an outside kill mid-call would."""
    deadline = time.monotonic() + timeout_s
    while "pid" not in pump.fields() and time.monotonic() < deadline:
        select.select([pump.status_fd], [], [], 0.05)
        try:
            chunk = os.read(pump.status_fd, _READ_CHUNK)
        except BlockingIOError:
            continue
        if not chunk:  # the launcher already exited
            return
        pump.status += chunk
    _kill(pump.fields())


def _supervise(payload: bytes, limits: Limits) -> sandbox_prelude.SandboxResult:
    start = time.monotonic()
    pump = _Pump(*_spawn(payload), limits.max_output_bytes)
    try:
        if faults.hit("sandbox.kill"):
            _kill_when_started(pump)
        reason = pump.run(start + limits.timeout_s)
        if reason:
            pump.drain_status()  # "launcher" is its first line, "pid" follows I's fork
            _kill(pump.fields())
            pump.run(time.monotonic() + 5.0, capped=False)  # until the launcher reaped PID 1
            if pump.outputs_open():
                _kill({"launcher": pump.fields().get("launcher", "")})
        pump.drain_status()
        fields = pump.fields()
        out, err = (bytes(b).decode("utf-8", "replace") for b in pump.bufs.values())
    finally:
        pump.close()
    pid = int(fields["launcher"]) if fields.get("launcher", "").isdigit() else -1
    _await_exit(pid)
    if "setup" in fields:
        raise SandboxUnavailable(f"namespace sandbox set-up failed: {fields['setup']}")
    if "input" in fields:
        msg = f"error: {fields['input']}"
        return sandbox_prelude.SandboxResult(
            "error", out, err, None, time.monotonic() - start, msg, pid
        )
    return _result(reason, fields, out, err, time.monotonic() - start, limits, pid)


def _result(reason, fields, out, err, wall, limits: Limits, pid) -> sandbox_prelude.SandboxResult:
    rc = None
    if "status" in fields:
        rc = os.waitstatus_to_exitcode(int(fields["status"]))
    if reason == "output_limit":
        status, msg = reason, f"output_limit: output exceeded {limits.max_output_bytes} bytes"
    elif reason == "timeout":
        status, msg = "timeout", f"timeout: wall-clock limit {limits.timeout_s:g} s exceeded"
    elif rc is None:
        status, msg = "killed", "killed: the sandbox's PID 1 died without a status"
    elif rc == -signal.SIGXCPU:
        status, msg = "timeout", f"timeout: CPU time limit {limits.cpu_s} s exceeded"
    else:
        status, msg = sandbox_prelude.exit_status(rc, err)
    return sandbox_prelude.SandboxResult(status, out, err, rc, wall, msg, pid)


@functools.cache
def check_available() -> None:
    """Raises SandboxUnavailable (naming what is missing) unless a trivial run works here."""
    res = run_command(["true"], limits=Limits(timeout_s=10.0))
    if res.status != "ok":
        raise SandboxUnavailable(f"namespace sandbox probe failed: {res.message}")


def run_python(
    code: str,
    *,
    timeout_s: float = 2.0,
    cpu_s: int = 2,
    memory_mb: int = 256,
    max_output_bytes: int = 4096,
    max_file_mb: int = 1,
    max_open_files: int = 32,
    audit: bool = True,
) -> sandbox_prelude.SandboxResult:
    """tg_jax.envs.sandbox.run_python's contract, in the namespace sandbox.

    The script runs as /repo/main.py under the audit hook's prelude (an inner layer: it
    refuses subprocesses, sockets and writes outside /repo before the kernel has to), in a
    sandbox of 16 MiB disk and 16 processes (the prelude sets RLIMIT_NPROC to 0 anyway).
    """
    limits = Limits(
        timeout_s=timeout_s,
        cpu_s=cpu_s,
        memory_mb=memory_mb,
        nproc=16,
        disk_mb=16,
        max_file_mb=max_file_mb,
        max_open_files=max_open_files,
        max_output_bytes=max_output_bytes,
    )
    prelude = sandbox_prelude.prelude(WORKDIR, cpu_s, memory_mb, max_file_mb, max_open_files, audit)
    argv = [sys.executable, "-I", "-S", "-B", "-X", "utf8", "-c", prelude]
    res = run_command(argv, files={"main.py": code}, limits=limits)
    if res.status == "error" and res.returncode == sandbox_prelude.MEMORY_RC:  # the prelude's code
        msg = f"memory: memory limit {memory_mb} MB exceeded"
        res = dataclasses.replace(res, status="memory", message=msg)
    return res


def run_many(
    jobs: Sequence[Mapping[str, Any]], workers: int | None = None
) -> list[sandbox_prelude.SandboxResult]:
    """run_command(**job) for every job, `workers` at a time (default: the CPU count)."""
    workers = workers or os.cpu_count() or 1
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda job: run_command(**job), jobs))


def light_runner_argv(*paths: str) -> list[str]:
    """A test command that imports test_*.py under `paths` (default: the whole copy) and
    calls their argument-free test_* functions: pytest's protocol minus its start-up cost."""
    with open(os.path.join(os.path.dirname(LAUNCHER), "light_runner.py")) as f:
        source = f.read()
    return [sys.executable, "-B", "-c", source, *paths]


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI (see the module docstring); returns the process exit status."""
    import argparse  # noqa: PLC0415

    parser = argparse.ArgumentParser(
        prog="python -m tg_jax.envs.sandbox",
        description="Run CMD over a throwaway copy of DIR in the namespace sandbox.",
    )
    parser.add_argument("--repo", required=True, help="directory copied to the sandbox's /repo")
    parser.add_argument("--timeout", type=float, default=Limits.timeout_s, help="seconds")
    parser.add_argument("--memory_mb", type=int, default=Limits.memory_mb)
    parser.add_argument("--disk_mb", type=int, default=Limits.disk_mb, help="copy + /tmp size")
    parser.add_argument("--tail", type=int, default=4000, help="characters of output kept")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command given (usage: --repo DIR -- CMD ARGS...)")
    limits = Limits(
        timeout_s=args.timeout,
        cpu_s=int(args.timeout) + 1,
        memory_mb=args.memory_mb,
        disk_mb=args.disk_mb,
    )
    try:
        res = run_command(cmd, repo=args.repo, limits=limits)
    except SandboxUnavailable as e:
        print(json.dumps({"status": "unavailable", "message": str(e)}))
        return 2
    out = {
        "status": res.status,
        "returncode": res.returncode,
        "stdout": res.stdout[-args.tail :],
        "stderr": res.stderr[-args.tail :],
        "wall_s": round(res.wall_s, 4),
        "message": res.message,
    }
    print(json.dumps(out))
    return 0
