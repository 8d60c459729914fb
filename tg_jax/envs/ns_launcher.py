"""The trusted launcher of the namespace sandbox (run by tg_jax.envs.ns_sandbox, stdlib only).

Started once per supervising process, as host root with `python -I -S ns_launcher.py
SOCK_FD` and an empty environment: a server that forks one launcher per request (see
`_serve`), so a run costs no interpreter start-up. Per run, three processes:

1. L (a child of the server, host PID namespace, its own session): writes "launcher <pid>"
   on the status pipe, reads the parameters (marshal), unshares the mount, PID, network,
   IPC, UTS and cgroup namespaces, forks I, writes "pid <I's host pid>", waits for I.
2. I (PID 1 of the new PID namespace, still host root, in a mount namespace owned by the
   host's initial user namespace): builds the new root on a size-limited tmpfs (read-only
   binds of the interpreter and system libraries, a private copy of the repository at /repo,
   private /tmp and /dev/shm, a fresh /proc, a few device nodes), pivots into it, drops to
   the unprivileged host uid `uid`, unshares a user namespace mapping uid 1000 -> `uid`,
   forks C, reaps everything, and when C exits writes "status <wait status>" and exits;
   the kernel then kills every process left in the PID namespace.
3. C: sets no_new_privs and the rlimits, then execs the command as uid 1000 in /repo.

Any failure before the exec is written as "setup <what failed>: <errno text>" on the
status pipe (exit 111); the command's own stdout/stderr are never written to by L or I.
"""

# `_signal`, not `signal`: the latter's enum import alone costs more than the rest of start-up.
import _signal
import ctypes
import marshal
import os
import resource
import sys

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x20000, 0x2000000, 0x4000000
CLONE_NEWIPC = 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE = 16384, 1 << 18
MNT_DETACH = 2
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 4, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
INNER_ID = 1000  # the command's uid/gid inside the user namespace
DEVICES = ("null", "zero", "full", "random", "urandom")
SETUP_RC = 111

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]


def _fail(status_fd, what):
    os.write(status_fd, f"setup {what}\n".encode())
    os._exit(SETUP_RC)


class Setup:
    """Checked system calls; every failure names the step and the errno."""

    def __init__(self, status_fd):
        self.status_fd = status_fd

    def check(self, ret, what):
        if ret != 0:
            _fail(self.status_fd, f"{what}: {os.strerror(ctypes.get_errno())}")

    def mount(self, src, dst, fstype, flags, data=None):
        enc = [None if s is None else s.encode() for s in (src, dst, fstype, data)]
        self.check(_libc.mount(enc[0], enc[1], enc[2], flags, enc[3]), f"mount {dst}")

    def bind(self, src, dst, readonly, recursive=False):
        self.mount(src, dst, None, MS_BIND | (MS_REC if recursive else 0))
        flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | (MS_RDONLY if readonly else 0)
        # Keep the source's noexec/atime flags: in a user namespace they are locked.
        have = os.statvfs(dst).f_flag
        for st_flag, ms_flag in ((8, MS_NOEXEC), (1024, MS_NOATIME), (2048, MS_NODIRATIME)):
            flags |= ms_flag if have & st_flag else 0
        self.mount(None, dst, None, flags)

    def write(self, path, text):
        try:
            with open(path, "w") as f:
                f.write(text)
        except OSError as e:
            _fail(self.status_fd, f"write {path}: {e.strerror}")


def _copy_tree(src, dst):
    """shutil.copytree(src, dst, symlinks=True) without importing shutil (start-up time)."""
    os.mkdir(dst)
    for entry in os.scandir(src):
        target = os.path.join(dst, entry.name)
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), target)
        elif entry.is_dir():
            _copy_tree(entry.path, target)
        elif entry.is_file():
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW)
            with open(fd, "rb") as fin, open(target, "wb") as fout:
                while chunk := fin.read(1 << 20):
                    fout.write(chunk)
            os.chmod(target, entry.stat().st_mode & 0o755)


def _populate(s, root, p):
    """The new root's tree under `root` (host view), before the pivot."""
    links = []
    for path in p["ro"]:
        if os.path.islink(path):
            links.append(path)
        elif os.path.isdir(path):
            os.makedirs(root + path, exist_ok=True)
            s.bind(path, root + path, readonly=True)
    for path in links:  # after the binds, so makedirs never walks through a new link
        if not os.path.lexists(root + path):
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            os.symlink(os.readlink(path), root + path)
    os.makedirs(root + "/etc", exist_ok=True)
    for path in p["etc"]:
        if os.path.isdir(path):
            os.makedirs(root + path)
        elif os.path.isfile(path):
            open(root + path, "w").close()
        else:
            continue
        s.bind(path, root + path, readonly=True)
    s.write(root + "/etc/passwd", f"sandbox:x:{INNER_ID}:{INNER_ID}::/tmp:/bin/sh\n")
    s.write(root + "/etc/group", f"sandbox:x:{INNER_ID}:\n")
    s.write(root + "/etc/hostname", "sandbox\n")
    os.makedirs(root + "/dev/shm")
    for name in DEVICES:
        open(f"{root}/dev/{name}", "w").close()
        s.mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0")):
        os.symlink(target, f"{root}/dev/{name}")
    os.symlink("/proc/self/fd/1", root + "/dev/stdout")
    os.symlink("/proc/self/fd/2", root + "/dev/stderr")
    work = root + "/repo"
    try:
        if p["repo"]:
            _copy_tree(p["repo"], work)
        os.makedirs(work, exist_ok=True)
    except OSError as e:
        _fail(s.status_fd, f"copy of the repository: {e}")
    uid = p["uid"]
    for top, dirs, names in os.walk(work) if uid is not None else ():
        for name in (top, *(os.path.join(top, n) for n in dirs + names)):
            os.lchown(name, uid, uid)
    os.makedirs(root + "/tmp", exist_ok=True)  # exists if an interpreter lives under /tmp
    os.chmod(root + "/tmp", 0o1777)
    os.chmod(root + "/dev/shm", 0o1777)
    for path in ("/repo", "/tmp", "/dev/shm"):  # stay writable when the root goes read-only
        s.bind(root + path, root + path, readonly=False, recursive=True)
    os.makedirs(root + "/proc")
    s.mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def _enter_root(s, p):
    """Private propagation, the tmpfs root, the pivot; runs as PID 1 of the new namespace."""
    s.mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = p["mountpoint"]
    opts = f"size={p['disk_mb']}m,nr_inodes={p['inodes']},mode=755"
    s.mount("tg_sandbox", root, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    _populate(s, root, p)
    s.mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    nr = SYS_PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        _fail(s.status_fd, f"pivot_root: unknown syscall number on {os.uname().machine}")
    s.check(_libc.syscall(nr, b".", b"."), "pivot_root")
    s.check(_libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")


def _drop_privileges(s, uid):
    """Host root -> host `uid` (no capabilities) -> a user namespace where it is uid 1000.

    Rootless (`uid` None): root of the outer user namespace -> a nested one, uid 1000."""
    outer = 0
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        s.check(_libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
        outer = uid
    s.check(_libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
    _map_ids(s, outer, outer, INNER_ID)
    # No user namespaces below this one: nested ones are the usual kernel attack surface.
    s.write("/proc/sys/user/max_user_namespaces", "0")
    s.check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")


def _write_files(s, files):
    """`files` into /repo, after the pivot and the drop: a symlink in the copy can lead a
    write only where the command itself could write."""
    try:
        for rel, text in files.items():
            os.makedirs(os.path.dirname(os.path.join("/repo", rel)), exist_ok=True)
            with open(os.path.join("/repo", rel), "w", encoding="utf-8", errors="replace") as f:
                f.write(text)
    except OSError as e:  # the caller's input, not the sandbox, is at fault: no "setup"
        os.write(s.status_fd, f"input cannot write the files into /repo: {e}\n".encode())
        os._exit(SETUP_RC)


def _map_ids(s, uid, gid, inner):
    """The calling process's own ids (in the parent user namespace) -> `inner` in its new one."""
    s.write("/proc/self/setgroups", "deny")
    s.write("/proc/self/uid_map", f"{inner} {uid} 1")
    s.write("/proc/self/gid_map", f"{inner} {gid} 1")


def _exec_command(p, status_fd):
    """C: limits, then exec. Never returns."""
    try:
        os.close(status_fd)
        _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        for sig in (_signal.SIGPIPE, _signal.SIGXFSZ, _signal.SIGINT):
            _signal.signal(sig, _signal.SIG_DFL)
        r = resource
        for lim, val in (
            (r.RLIMIT_CPU, p["cpu_s"]),  # SIGXCPU, then SIGKILL a second later
            (r.RLIMIT_AS, p["memory_mb"] << 20),
            (r.RLIMIT_FSIZE, p["max_file_mb"] << 20),
            (r.RLIMIT_NOFILE, p["max_open_files"]),
            (r.RLIMIT_NPROC, p["nproc"]),
            (r.RLIMIT_CORE, 0),
        ):
            r.setrlimit(lim, (val, val + (lim == r.RLIMIT_CPU)))
        os.chdir("/repo")
        os.closerange(3, 1 << 20)  # only stdin, stdout and stderr reach the command
        os.execvpe(p["argv"][0], p["argv"], p["env"])
    except BaseException as e:  # noqa: BLE001 - the child must never return into I's code
        os.write(2, f"sandbox: cannot run {p['argv'][0]!r}: {e}\n".encode())
        os._exit(127)


def _init(p, status_fd):
    """I: PID 1. Builds the sandbox, runs C, exits when C does."""
    s = Setup(status_fd)
    # PID 1 gets only the signals it handles from inside its namespace: handle none.
    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)
    _enter_root(s, p)
    _drop_privileges(s, p["uid"])
    _write_files(s, p["files"])
    child = os.fork()
    if child == 0:
        _exec_command(p, status_fd)
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            os.write(status_fd, f"status {status}\n".encode())
            os._exit(0)


def _launch(params_fd, status_fd):
    """L: reads the parameters, unshares, forks I, waits for it. Never returns."""
    chunks = []
    while chunk := os.read(params_fd, 1 << 16):
        chunks.append(chunk)
    os.close(params_fd)
    p = marshal.loads(b"".join(chunks))
    s = Setup(status_fd)
    if p["uid"] is None:  # rootless: first a user namespace in which this process is root
        uid, gid = os.geteuid(), os.getegid()
        s.check(_libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER) (rootless)")
        _map_ids(s, uid, gid, 0)
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if _libc.unshare(flags | CLONE_NEWCGROUP):
        err = os.strerror(ctypes.get_errno())
        _fail(status_fd, f"unshare(mount, pid, net, ipc, uts, cgroup namespaces): {err}")
    _libc.sethostname(b"sandbox", 7)
    pid = os.fork()
    if pid == 0:
        try:
            _init(p, status_fd)
        except BaseException as e:  # noqa: BLE001 - report, never fall through into L's code
            _fail(status_fd, f"{type(e).__name__}: {e}")
    os.write(status_fd, f"pid {pid}\n".encode())
    os.close(status_fd)
    # A backstop for a supervisor that died: I (and with it the namespace) dies at the limit.
    _signal.signal(_signal.SIGALRM, lambda signum, frame: os.kill(pid, _signal.SIGKILL))
    _signal.alarm(int(p["timeout_s"]) + 2)
    os.waitpid(pid, 0)
    os._exit(0)


def _serve(sock_fd):
    """The server: one L per request, forked from this warm interpreter (no start-up cost).

    A request is one message with four descriptors: the parameters pipe (read end), the
    status pipe, the command's stdout and stderr (write ends). EOF on the socket (the
    supervisor exited or closed it) ends the server. No reply: L answers on the pipes.
    """
    import socket  # noqa: PLC0415 - only the server needs it

    sock = socket.socket(fileno=sock_fd)
    _signal.signal(_signal.SIGCHLD, _signal.SIG_IGN)  # the kernel reaps finished launchers
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 16, 4)
        if not msg:
            os._exit(0)
        if len(fds) != 4:
            for fd in fds:
                os.close(fd)
            continue
        if os.fork() == 0:
            sock.close()  # nothing below may reach the server
            _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)
            os.setsid()
            params_fd, status_fd, out_fd, err_fd = fds
            null = os.open("/dev/null", os.O_RDONLY)
            for src, dst in ((null, 0), (out_fd, 1), (err_fd, 2)):
                os.dup2(src, dst)
                os.close(src)
            os.write(status_fd, f"launcher {os.getpid()}\n".encode())
            try:
                _launch(params_fd, status_fd)
            finally:
                os._exit(SETUP_RC)
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
