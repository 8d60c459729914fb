"""What runs inside every sandbox: the trusted prelude (limits, the audit hook, then the user's
main.py) and how a run's exit reads as a `SandboxResult`.

Shared by both backends: tg_jax.envs.sandbox (a subprocess under the audit hook; its module
docstring lists what is contained and how) and tg_jax.envs.ns_sandbox (the same prelude inside
kernel namespaces). It imports neither.
"""

from __future__ import annotations

import dataclasses
import signal

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed")
MEMORY_RC = 90  # exit code the prelude uses for an uncaught MemoryError

# Modules whose import would let code bypass the audit hook (raw memory, raw fork/exec,
# object graph walking) or is never needed by a function-writing task.
_BLOCKED_IMPORTS = (
    "ctypes",
    "_ctypes",
    "_posixsubprocess",
    "gc",
    "_xxsubinterpreters",
    "_testcapi",
    "_testinternalcapi",
    "_testbuffer",
    "_testmultiphase",
)

# The trusted prelude, run with `-c` in the child's working dir. It sets rlimits, installs
# the audit hook, then executes main.py. Parameters are substituted with repr() by the parent.
_PRELUDE = r"""
import posix as _p, sys as _s, _signal as _g, resource as _r
def _setup(root, cpu_s, mem_b, fsize_b, nofile, blocked, audit):
    R = _r
    for lim, val in ((R.RLIMIT_CPU, (cpu_s, cpu_s + 1)), (R.RLIMIT_AS, (mem_b, mem_b)),
                     (R.RLIMIT_FSIZE, (fsize_b, fsize_b)), (R.RLIMIT_NOFILE, (nofile, nofile)),
                     (R.RLIMIT_NPROC, (0, 0)), (R.RLIMIT_CORE, (0, 0))):
        try:
            R.setrlimit(lim, val)
        except (ValueError, OSError):
            pass
    _g.signal(_g.SIGXFSZ, _g.SIG_IGN)  # oversized writes raise OSError instead of killing
    # Calls that raise no audit event but matter when the child is root: device nodes,
    # chroot, uid changes, signalling other processes through pidfds.
    for mod, names in ((_p, ("mknod", "mkfifo", "chroot", "pidfd_open", "setuid", "setgid",
                             "seteuid", "setegid", "setreuid", "setregid", "setresuid",
                             "setresgid", "setgroups")), (_g, ("pidfd_send_signal",))):
        for name in names:
            if hasattr(mod, name):
                delattr(mod, name)
    if not audit:
        return
    # No closures and no mutable state: everything the hook uses is an immutable default
    # argument (the helpers' __defaults__ and any __code__ cannot be rebound, see below), and
    # builtins are bound here so that patching the builtins module cannot change the hook.

    def real(path, getcwd=_p.getcwd, lstat=_p.lstat, readlink=_p.readlink, type_=type,
             str_=str, bytes_=bytes, oserror=OSError):
        # realpath from captured primitives; None for non-str paths (refused by callers).
        if type_(path) is bytes_:
            path = path.decode("utf-8", "surrogateescape")
        if type_(path) is not str_:
            return None
        todo = (path if path.startswith("/") else getcwd() + "/" + path).split("/")
        todo.reverse()
        parts, hops = [], 0
        while todo:
            c = todo.pop()
            if c == "" or c == ".":
                continue
            if c == "..":
                if parts:
                    parts.pop()
                continue
            cand = "/" + "/".join(parts) + ("/" if parts else "") + c
            try:
                is_link = (lstat(cand).st_mode & 0o170000) == 0o120000
            except oserror:
                is_link = False
            if is_link and hops < 40:
                hops += 1
                target = readlink(cand)
                if target.startswith("/"):
                    parts = []
                rest = target.split("/")
                rest.reverse()
                todo.extend(rest)
            else:
                parts.append(c)
        return "/" + "/".join(parts)

    def under(p, prefixes):
        if p is None:
            return False
        p = p + "/"
        for q in prefixes:
            if p.startswith(q):
                return True
        return False

    rroot = (real(root) + "/",)
    readable = rroot + tuple(real(x) + "/" for x in _s.path if x) + (
        "/dev/null/", "/dev/urandom/", "/dev/random/", "/dev/zero/")
    proc_events = ("os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork",
                   "os.forkpty", "os.kill", "os.killpg", "subprocess.Popen", "os.startfile",
                   "signal.pthread_kill", "os.link", "os.symlink", "resource.setrlimit",
                   "resource.prlimit", "sys.settrace", "sys.setprofile")
    # Mutating events -> positions of their dir_fd arguments.
    path_events = (("os.remove", (1,)), ("os.rmdir", (1,)), ("os.rename", (2, 3)),
                   ("os.mkdir", (2,)), ("os.chmod", (2,)), ("os.chown", (3,)),
                   ("os.utime", (3,)), ("os.truncate", ()), ("os.chflags", ()),
                   ("os.lchflags", ()), ("os.setxattr", ()), ("os.removexattr", ()),
                   ("shutil.rmtree", ()), ("shutil.copyfile", ()), ("shutil.copytree", ()),
                   ("shutil.move", ()), ("shutil.chown", ()), ("shutil.copymode", ()),
                   ("shutil.copystat", ()), ("shutil.make_archive", ()),
                   ("shutil.unpack_archive", ()))
    protected = (real, under)  # reachable from tracebacks through the hook's frame
    w_flags = _p.O_WRONLY | _p.O_RDWR | _p.O_APPEND | _p.O_CREAT | _p.O_TRUNC

    def hook(event, args, real=real, under=under, rroot=rroot, readable=readable,
             blocked=tuple(blocked), proc_events=proc_events, path_events=path_events,
             protected=protected, w_flags=w_flags, perm=PermissionError, type_=type,
             int_=int, str_=str, bytes_=bytes, tuple_=tuple, len_=len, lstat=_p.lstat,
             oserror=OSError):
        if event == "open":
            path, mode, flags = args
            if type_(path) is int_:
                return
            rp = real(path)
            if rp is None:
                raise perm("sandbox: open() needs a str path")
            if under(rp, rroot):
                try:
                    kind = lstat(rp).st_mode & 0o170000
                except oserror:
                    kind = 0o100000  # about to be created: a regular file
                if kind != 0o100000 and kind != 0o040000:
                    raise perm("sandbox: opening device nodes or fifos is blocked")
            if mode is None or flags & w_flags:  # os.open (dir_fd unseen) or a write
                if not under(rp, rroot):
                    raise perm("sandbox: writing outside the working directory is blocked")
            elif not under(rp, readable):
                raise perm("sandbox: reading " + rp + " is blocked")
        elif event == "import":
            if args[0] in blocked or args[0].split(".")[0] in blocked:
                raise perm("sandbox: import of " + args[0] + " is blocked")
        elif event.startswith("socket.") or event.startswith("ctypes."):
            raise perm("sandbox: network access is blocked")
        elif event in proc_events:
            raise perm("sandbox: " + event + " is blocked")
        elif event == "object.__setattr__":
            if args[1] == "__code__" or (args[0] is protected[0] or args[0] is protected[1]):
                raise perm("sandbox: replacing function internals is blocked")
        else:
            for name, fd_pos in path_events:
                if name != event:
                    continue
                for i in fd_pos:
                    if i < len_(args) and args[i] is not None and args[i] != -1:
                        raise perm("sandbox: dir_fd arguments are blocked")
                for a in args:
                    if type_(a) is str_ or type_(a) is bytes_:
                        if not under(real(a), rroot):
                            raise perm("sandbox: changing files outside the working dir is "
                                       "blocked")
                    elif not (a is None or type_(a) is int_ or type_(a) is tuple_):
                        raise perm("sandbox: " + event + " needs str paths")

    _s.addaudithook(hook)

def _report(e):
    import traceback
    tb = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == "main.py"]
    text = ("Traceback (most recent call last):\n" + "".join(traceback.format_list(tb))
            if tb else "")
    _s.stderr.write(text + "".join(traceback.format_exception_only(type(e), e)))

with open("main.py", "rb") as _f:
    _src = _f.read()
_setup(*PARAMS)
try:
    exec(compile(_src, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except MemoryError:
    _s.stderr.write("MemoryError: memory limit exceeded\n")
    _s.stdout.flush(); _s.stderr.flush()
    _p._exit(MEMORY_RC)
except SystemExit:
    raise
except BaseException as _e:
    _report(_e)
    _s.stdout.flush(); _s.stderr.flush()
    _p._exit(1)
"""


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run.

    Attributes:
      status: one of STATUSES.
      stdout: captured stdout (at most max_output_bytes, utf-8 with replacement).
      stderr: captured stderr (same cap).
      returncode: the child's exit status (negative = signal), None if never started.
      wall_s: wall-clock seconds from spawn to reap.
      message: one line saying what happened, e.g. "timeout: wall-clock limit 2.0 s".
      pid: pid (= process group id) of the child, for leak checks.
    """

    status: str
    stdout: str
    stderr: str
    returncode: int | None
    wall_s: float
    message: str
    pid: int = -1

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def prelude(
    root: str, cpu_s: int, memory_mb: int, max_file_mb: int, max_open_files: int, audit: bool
) -> str:
    """The `-c` program that sets the limits, installs the audit hook and runs root/main.py."""
    params = (
        root,
        max(1, int(cpu_s)),
        int(memory_mb) << 20,
        int(max_file_mb) << 20,
        int(max_open_files),
        _BLOCKED_IMPORTS,
        audit,
    )
    return _PRELUDE.replace("PARAMS", repr(params)).replace("MEMORY_RC", str(MEMORY_RC))


def exit_status(rc: int | None, stderr: str) -> tuple[str, str]:
    """(status, message) of a process that exited with `rc` (no limit hit): "killed" by a
    signal, "ok", or "error" with the last line of stderr."""
    if rc is not None and rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = str(-rc)
        return "killed", f"killed: signal {name}"
    if rc == 0:
        return "ok", "ok"
    last = [ln for ln in stderr.splitlines() if ln.strip()]
    return "error", "error: " + (last[-1].strip() if last else f"exit status {rc}")
