"""Adversarial tests of the sandbox: every attack is contained and leaves no process behind."""

import os
import socket
import textwrap

import pytest

from tg_jax.envs import ns_sandbox
from tg_jax.envs.sandbox import run_python, sandbox_info


def _live_processes_of(pid: int) -> list[str]:
    """Live processes in the process group/session `pid`, or children of this test process
    (but the namespace backend's launcher server, which outlives runs by design)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == ns_sandbox.server_pid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # Fields after the parenthesised command: state ppid pgrp session ...
        state, ppid, pgrp, session = stat.rsplit(")", 1)[1].split()[:4]
        if state == "Z":
            continue
        if int(pgrp) == pid or int(session) == pid or int(ppid) == os.getpid():
            found.append(stat[:80])
    return found


def _run(code: str, **kw):
    res = run_python(textwrap.dedent(code), **kw)
    assert res.pid > 0
    assert _live_processes_of(res.pid) == [], "a sandboxed process survived the run"
    return res


def test_normal_run_and_workdir_cleanup():
    res = _run("""
        import os, json, math
        open("out.txt", "w").write("hi")
        print(6 * 7, open("out.txt").read(), math.isqrt(49))
        print(os.getcwd())
    """)
    assert res.status == "ok" and res.returncode == 0 and res.message == "ok"
    first, workdir = res.stdout.splitlines()
    assert first == "42 hi 7"
    assert os.path.basename(workdir).startswith("tg_sandbox_")
    assert not os.path.exists(workdir), "the temporary working dir must be deleted"


def test_exception_is_an_error_with_user_traceback_only():
    res = _run("def f(x):\n    return 1 / x\nf(0)\n")
    assert res.status == "error" and res.returncode == 1
    assert res.message == "error: ZeroDivisionError: division by zero"
    assert 'File "main.py", line 2' in res.stderr and "<string>" not in res.stderr


def test_infinite_loop_times_out():
    res = _run("while True:\n    pass\n", timeout_s=0.5, cpu_s=5)
    assert res.status == "timeout"
    assert res.message == "timeout: wall-clock limit 0.5 s exceeded"
    assert 0.5 <= res.wall_s < 2.0


def test_cpu_limit_stops_a_spinning_child_before_the_wall_clock():
    res = _run("while True:\n    pass\n", timeout_s=20, cpu_s=1)
    assert res.status == "timeout" and "CPU time limit 1 s" in res.message
    assert res.wall_s < 10


@pytest.mark.parametrize(
    "code, blocked",
    [
        ("import os\nwhile True:\n    os.fork()\n", "os.fork is blocked"),
        ("import os\nos.system('echo pwned')\n", "os.system is blocked"),
        ("import subprocess\nsubprocess.run(['true'])\n", "_posixsubprocess is blocked"),
        ("import os\nos.execv('/bin/true', ['true'])\n", "os.exec is blocked"),
        ("import ctypes\n", "import of ctypes is blocked"),
        ("import multiprocessing as m\nm.Process(target=print).start()\n", "blocked"),
    ],
)
def test_process_creation_is_blocked(code, blocked):
    res = _run(code, timeout_s=2.0)
    assert res.status == "error" and blocked in res.message
    assert "pwned" not in res.stdout


def test_fork_bomb_without_audit_hook_is_reaped_by_group_kill():
    # The OS-level backstop: even if forks happen, the whole group dies at the deadline.
    res = _run(
        """
        import os, time
        for _ in range(4):
            try:
                os.fork()
            except OSError:
                pass
        time.sleep(60)
        """,
        timeout_s=1.0,
        audit=False,
    )
    assert res.status == "timeout"


@pytest.mark.parametrize(
    "code",
    ["x = bytearray(1 << 30)\n", "chunks = []\nwhile True:\n    chunks.append(b'x' * 10**7)\n"],
)
def test_memory_bomb_hits_the_memory_limit(code):
    res = _run(code, memory_mb=128, timeout_s=5.0)
    assert res.status == "memory"
    assert res.message == "memory: memory limit 128 MB exceeded"


def test_writes_outside_the_working_dir_are_blocked(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("intact")
    target = tmp_path / "new.txt"
    attempts = {
        "open_write": f"open({str(target)!r}, 'w').write('x')",
        "open_append": f"open({str(victim)!r}, 'a').write('x')",
        "relative_escape": "open('../escape.txt', 'w').write('x')",
        "os_open": f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
        "remove": f"import os\nos.remove({str(victim)!r})",
        "rename": f"import os\nos.rename({str(victim)!r}, 'stolen.txt')",
        "rmtree": f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
        "symlink": f"import os\nos.symlink({str(victim)!r}, 'link')",
        "chmod": f"import os\nos.chmod({str(victim)!r}, 0o777)",
    }
    for name, code in attempts.items():
        res = _run(code)
        assert res.status == "error", name
        assert "PermissionError: sandbox:" in res.message and "blocked" in res.message, name
    assert victim.read_text() == "intact"
    assert not target.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim.txt"]


def test_reads_outside_stdlib_and_workdir_are_blocked():
    res = _run("print(open('/etc/passwd').read())")
    assert res.status == "error" and "reading /etc/passwd is blocked" in res.message
    assert res.stdout == ""


def _listener():
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.2)
    return srv


def _assert_no_connection(srv):
    with pytest.raises(socket.timeout):
        srv.accept()
    srv.close()


def test_socket_connection_is_blocked():
    srv = _listener()
    port = srv.getsockname()[1]
    res = _run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n")
    assert res.status == "error" and res.message.endswith("network access is blocked")
    _assert_no_connection(srv)


def test_network_namespace_blocks_sockets_even_without_audit_hook():
    if not sandbox_info()["network_namespace"]:
        pytest.skip("unshare cannot create a network namespace on this machine")
    srv = _listener()
    port = srv.getsockname()[1]
    res = _run(
        f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n", audit=False
    )
    assert res.status == "error" and "OSError" in res.message  # ENETUNREACH / ECONNREFUSED
    _assert_no_connection(srv)


def test_parent_environment_is_not_visible(monkeypatch):
    secret = "tg-sandbox-secret-4711"
    monkeypatch.setenv("TG_SANDBOX_SECRET", secret)
    res = _run("""
        import os
        print(dict(os.environ))
        try:
            print(open('/proc/%d/environ' % os.getppid(), 'rb').read())
        except OSError as e:
            print('refused:', e)
        try:
            print(open('/proc/self/root/proc/%d/environ' % os.getppid(), 'rb').read())
        except OSError as e:
            print('refused:', e)
    """)
    assert res.status == "ok"
    assert secret not in res.stdout and secret not in res.stderr
    assert "TG_SANDBOX_SECRET" not in res.stdout
    assert res.stdout.count("refused: sandbox: reading /proc/") == 2


@pytest.mark.parametrize(
    "code",
    [
        "while True:\n    print('x' * 1000)\n",
        "import sys\nwhile True:\n    sys.stderr.write('y' * 1000)\n",
        "print('z' * 10**7)\n",
    ],
)
def test_output_flood_is_cut_off(code):
    res = _run(code, max_output_bytes=4096, timeout_s=5.0)
    assert res.status == "output_limit"
    assert res.message == "output_limit: output exceeded 4096 bytes"
    assert len(res.stdout) <= 4096 and len(res.stderr) <= 4096
    assert res.wall_s < 3.0


def test_closed_pipes_then_spin_does_not_deadlock():
    res = _run("import os\nos.close(1)\nos.close(2)\nwhile True:\n    pass\n", timeout_s=0.5)
    assert res.status == "timeout"


def test_limits_cannot_be_raised_from_inside():
    res = _run("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))\n")
    assert res.status == "error" and "resource.setrlimit is blocked" in res.message


def test_audit_hook_cannot_be_disarmed_from_inside(tmp_path):
    target = str(tmp_path / "escaped.txt")
    attacks = [
        # Rebind the path resolver reachable through the refused call's traceback.
        f"""
        try:
            open({target!r}, "w")
        except PermissionError as e:
            tb = e.__traceback__
            while tb.tb_next:
                tb = tb.tb_next
            loc = tb.tb_frame.f_locals
            d = list(loc["real"].__defaults__)
            d[2] = lambda p: loc["rroot"][0]
            loc["real"].__defaults__ = tuple(d)
        open({target!r}, "w")
        """,
        f"""
        try:
            open({target!r}, "w")
        except PermissionError as e:
            tb = e.__traceback__
            while tb.tb_next:
                tb = tb.tb_next
            tb.tb_frame.f_locals["under"].__code__ = (lambda p, q: True).__code__
        open({target!r}, "w")
        """,
        f"import builtins\nbuiltins.type = lambda x: int\nopen({target!r}, 'w')\n",
        "import sys\nsys.settrace(lambda *a: None)\n",
    ]
    for code in attacks:
        res = _run(code)
        assert res.status == "error" and res.stdout == ""
    assert not os.path.exists(target)
    # Ordinary library code that sets __defaults__ still works.
    res = _run("import collections\nprint(collections.namedtuple('P', 'a b', defaults=(1,))(0))")
    assert res.stdout == "P(a=0, b=1)\n"


def test_unaudited_root_primitives_are_removed():
    res = _run("""
        import os, signal
        names = ["mknod", "mkfifo", "chroot", "pidfd_open", "setuid", "setgroups"]
        print([n for n in names if hasattr(os, n)], hasattr(signal, "pidfd_send_signal"))
    """)
    assert res.stdout == "[] False\n"


def test_backends_agree_on_an_ordinary_script():
    with pytest.raises(ValueError, match="backend must be one of"):
        run_python("print(1)", backend="docker")
    try:
        ns_sandbox.check_available()
    except ns_sandbox.SandboxUnavailable as e:
        pytest.skip(str(e))
    code = "import math\nprint(math.isqrt(49))\nopen('x.txt', 'w').write('y')\n"
    audit, ns = (run_python(code, backend=b) for b in ("audit", "namespace"))
    assert audit.status == ns.status == "ok" and audit.stdout == ns.stdout == "7\n"
    assert _live_processes_of(ns.pid) == []
    res = run_python("import subprocess\nsubprocess.run(['true'])\n", backend="namespace")
    assert res.status == "error" and "_posixsubprocess is blocked" in res.message
