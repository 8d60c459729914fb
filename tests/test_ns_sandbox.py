"""Adversarial tests of the namespace sandbox: each attack is a repository's test command.

Every run must be contained (the test's own failure or a limit), bounded in wall time, leave
no process on the host (a scan of /proc after each test) and no file changed outside the
sandbox's copy, and the next run must still work.
"""

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading

import pytest

from tg_jax.envs import ns_sandbox
from tg_jax.envs.coding import ExecOutcome, run_candidate, run_trusted
from tg_jax.envs.ns_sandbox import Limits, SandboxUnavailable, run_command

PY = sys.executable
FAST = Limits(timeout_s=3.0, cpu_s=3, memory_mb=256, nproc=16, disk_mb=8, max_file_mb=4)

if os.geteuid() != 0:  # the scans below look for HOST_UID, the uid of root's sandboxes
    pytest.skip("these tests run the sandbox as root", allow_module_level=True)


def _processes() -> dict[int, dict[str, str]]:
    procs = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                fields["cmdline"] = f.read().decode(errors="replace")
        except OSError:
            continue
        procs[int(entry)] = fields
    return procs


def _host_leftovers() -> list[str]:
    """Live host processes running as the sandbox's uid, children of this test process other
    than the launcher server, or children of the server (launchers). Sandboxes that another
    test process runs at the same time (pytest-xdist workers), i.e. processes below another
    process's launcher server, are not this test's."""
    server = ns_sandbox.server_pid()
    procs = _processes()

    def parent(pid: int) -> int:
        return int(procs.get(pid, {}).get("PPid", 0) or 0)

    # Launcher servers and launchers (same command line) not started from this process.
    name = os.path.basename(ns_sandbox.LAUNCHER)
    foreign = {
        pid for pid, f in procs.items()
        if name in f["cmdline"] and os.getpid() not in (parent(pid), parent(parent(pid)))
    }  # fmt: skip

    def below_foreign(pid: int) -> bool:
        seen = set()
        while pid > 1 and pid not in seen:
            seen.add(pid)
            if pid in foreign:
                return True
            pid = parent(pid)
        return False

    found = []
    for pid, fields in procs.items():
        if fields.get("State", "").strip().startswith("Z") or pid == server:
            continue
        uid = int(fields["Uid"].split()[0])
        ppid = int(fields["PPid"])
        mine = ppid == os.getpid() or ppid == server
        if mine or (uid == ns_sandbox.HOST_UID and not below_foreign(pid)):
            found.append(f"{pid} {fields['Name'].strip()} uid={uid} ppid={ppid} server={server}")
    return found


@pytest.fixture(autouse=True)
def no_leftovers():
    yield
    assert _host_leftovers() == [], "a sandboxed process survived its run"
    mountpoint = ns_sandbox.MOUNTPOINT  # made by the first root-mode run
    assert not os.path.exists(mountpoint) or os.listdir(mountpoint) == [], (
        "the host mountpoint must stay empty"
    )


def _repo(tmp_path, test_source: str) -> str:
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True, exist_ok=True)
    (repo / "lib.py").write_text("def add(a, b):\n    return a + b\n")
    (repo / "tests" / "test_attack.py").write_text(textwrap.dedent(test_source))
    return str(repo)


def _attack(tmp_path, test_source: str, limits: Limits = FAST, **kw):
    """Runs the repository's test file with the light runner (subprocesses allowed)."""
    repo = _repo(tmp_path, test_source)
    return run_command(ns_sandbox.light_runner_argv("tests"), repo=repo, limits=limits, **kw)


def test_normal_test_run_in_a_throwaway_copy(tmp_path):
    res = _attack(
        tmp_path,
        """
        import os, subprocess
        from lib import add
        def test_add():
            assert add(2, 3) == 5
        def test_subprocess_and_identity():
            out = subprocess.run(["id", "-u"], capture_output=True, text=True).stdout
            assert out.strip() == "1000" and os.getcwd() == "/repo"
            open("written.txt", "w").write("inside")
        """,
    )
    assert res.status == "ok" and res.returncode == 0, res.stdout + res.stderr
    assert "2 passed, 0 failed" in res.stdout
    assert not (tmp_path / "repo" / "written.txt").exists(), "the copy is throwaway"
    res = _attack(tmp_path, "def test_fails():\n    assert 1 == 2\n")
    assert res.status == "error" and res.returncode == 1 and "0 passed, 1 failed" in res.stdout


def test_pytest_runs_inside(tmp_path):
    repo = _repo(tmp_path, "from lib import add\ndef test_add():\n    assert add(1, 1) == 2\n")
    res = run_command([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider"], repo=repo)
    assert res.status == "ok", res.stdout + res.stderr
    assert "1 passed" in res.stdout


@pytest.mark.parametrize(
    "body, timeout",
    [
        ("while True:\n        pass", 1.0),
        ("import time\n    time.sleep(60)", 0.5),
        ("import subprocess\n    subprocess.run(['sleep', '60'])", 0.5),
    ],
)
def test_infinite_loop_and_sleep_time_out(tmp_path, body, timeout):
    limits = dataclasses.replace(FAST, timeout_s=timeout)
    res = _attack(tmp_path, f"def test_hang():\n    {body}\n", limits)
    assert res.status == "timeout" and res.returncode is None
    assert timeout <= res.wall_s < timeout + 2.0


def test_cpu_limit_stops_a_spinner_before_the_wall_clock(tmp_path):
    limits = Limits(timeout_s=20.0, cpu_s=1)
    res = run_command([PY, "-c", "while True: pass"], limits=limits)
    assert res.status == "timeout" and "CPU time limit 1 s" in res.message
    assert res.wall_s < 10


def test_fork_bomb_hits_the_process_limit(tmp_path):
    res = _attack(
        tmp_path,
        """
        import os, time
        def test_bomb():
            n = 0
            try:
                while True:
                    if os.fork() == 0:
                        time.sleep(60)
                        os._exit(0)
                    n += 1
            except BlockingIOError:
                print("fork refused after", n)
            assert False
        """,
    )
    assert res.status == "error" and "fork refused after" in res.stdout
    refused_after = int(res.stdout.split("fork refused after")[1].split()[0])
    assert refused_after < FAST.nproc
    assert res.wall_s < 3.0


def test_process_limit_is_counted_per_sandbox(tmp_path):
    # RLIMIT_NPROC counts per (user namespace, uid): two bombs of the same host uid running
    # at once each get their own nproc processes, not a shared pool.
    bomb = """
        import os, time
        def test_bomb():
            n = 0
            try:
                while n < 100:
                    if os.fork() == 0:
                        time.sleep(60)
                        os._exit(0)
                    n += 1
            except BlockingIOError:
                pass
            print("forks", n, flush=True)
            time.sleep(1.0)
        """
    repo = _repo(tmp_path, bomb)
    job = dict(argv=ns_sandbox.light_runner_argv("tests"), repo=repo, limits=FAST)
    results = ns_sandbox.run_many([job, job], workers=2)
    for res in results:
        assert res.status == "ok", res.stdout + res.stderr
        forks = int(res.stdout.split("forks ")[1].split()[0])
        assert FAST.nproc - 4 <= forks < FAST.nproc


def test_shell_fork_bomb_is_killed_at_the_deadline(tmp_path):
    bomb = "import subprocess, time\n    subprocess.run(['sh', '-c', 'b() { b | b & }; b'])\n"
    bomb += "    time.sleep(60)"
    limits = dataclasses.replace(FAST, timeout_s=1.5)
    res = _attack(tmp_path, f"def test_bomb():\n    {bomb}\n", limits)
    assert res.status == "timeout" and "Cannot fork" in res.stderr
    assert res.wall_s < 3.5


@pytest.mark.parametrize(
    "body",
    [
        "x = bytearray(1 << 30)",
        "chunks = []\n    while True:\n        chunks.append(b'x' * 10**7)",
        "import subprocess\n    subprocess.run(['python', '-c', 'bytearray(1 << 30)'], check=True)",
    ],
)
def test_memory_bomb_hits_the_memory_limit(tmp_path, body):
    res = _attack(tmp_path, f"def test_mem():\n    {body}\n")
    assert res.status == "error" and "MemoryError" in res.stdout + res.stderr
    assert res.wall_s < 3.0


def test_disk_filler_hits_the_caps(tmp_path):
    res = _attack(
        tmp_path,
        """
        import errno, os
        def test_fill():
            seen = set()
            for target in ("/repo/big", "/tmp/big", "/dev/shm/big"):
                try:
                    with open(target, "wb") as f:
                        while True:
                            f.write(b"x" * (1 << 20))
                            f.flush()
                except OSError as e:
                    seen.add(errno.errorcode[e.errno])
            try:
                for i in range(100):
                    with open(f"/repo/f{i}", "wb") as f:
                        f.write(b"y" * (1 << 20))
            except OSError as e:
                seen.add(errno.errorcode[e.errno])
            try:
                for i in range(10000):
                    open(f"/tmp/empty{i}", "w").close()
            except OSError as e:
                seen.add(errno.errorcode[e.errno])
            print("SEEN", sorted(seen))
        """,
    )
    assert res.status == "ok", res.stdout + res.stderr
    assert "EFBIG" in res.stdout and "ENOSPC" in res.stdout


def test_writes_outside_the_copy_change_nothing(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("intact")
    prefix_file = os.path.join(sys.prefix, "sandbox_escape.txt")
    repo = _repo(
        tmp_path,
        f"""
        import os, subprocess
        VICTIM, PREFIX = {str(victim)!r}, {prefix_file!r}
        def attempt(path, mode="a"):
            try:
                with open(path, mode) as f:
                    f.write("pwned")
                return "wrote " + path
            except OSError as e:
                return "refused " + path + " " + type(e).__name__
        def test_escape():
            os.makedirs(os.path.dirname(VICTIM), exist_ok=True)  # the private /tmp
            for p in (VICTIM, PREFIX, "/usr/pwned", "../pwned", "/repo/../pwned",
                      "/proc/self/cwd/../pwned", "/proc/1/root/pwned",
                      "/proc/self/root/etc/passwd", "link_to_victim", "/etc/pwned"):
                print(attempt(p))
            os.symlink("/usr/lib", "lib_link")
            print(attempt("lib_link/pwned"))
            print(subprocess.run(["mount", "-o", "remount,rw", "/usr"],
                                 capture_output=True, text=True).stderr.strip())
            print(subprocess.run(["sh", "-c", "echo pwned > /pwned"],
                                 capture_output=True, text=True).stderr.strip())
        """,
    )
    os.symlink(str(victim), os.path.join(repo, "link_to_victim"))
    res = run_command(ns_sandbox.light_runner_argv("tests"), repo=repo, limits=FAST)
    assert res.status == "ok", res.stdout + res.stderr
    assert "refused /usr/pwned" in res.stdout and "refused ../pwned" in res.stdout
    assert f"refused {prefix_file}" in res.stdout and "refused lib_link/pwned" in res.stdout
    assert "refused /proc/self/root/etc/passwd" in res.stdout
    assert victim.read_text() == "intact"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo", "victim.txt"]
    assert not os.path.exists(prefix_file) and not os.path.exists("/usr/pwned")
    assert not os.path.exists("/pwned") and not os.path.exists("/etc/pwned")
    assert not os.path.exists(os.path.join(repo, "lib_link")), "the copy is throwaway"


def test_symlinks_in_the_repository_do_not_lead_writes_or_copies_out(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("host secret")
    repo = _repo(tmp_path, "def test_nothing():\n    pass\n")
    os.symlink(str(outside), os.path.join(repo, "dir_link"))
    os.symlink(str(outside / "secret.txt"), os.path.join(repo, "file_link"))
    files = {"dir_link/planted.txt": "x", "dir_link/sub/planted.txt": "x"}
    res = run_command(["true"], repo=repo, files=files, limits=FAST)
    assert res.status == "error" and "cannot write the files into /repo" in res.message
    res = run_command(["sh", "-c", "cat file_link; ls -l"], repo=repo, limits=FAST)
    assert res.status == "ok" and "host secret" not in res.stdout
    assert "file_link -> " + str(outside / "secret.txt") in res.stdout, "copied as a link"
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]


def test_host_files_and_environment_are_not_readable(tmp_path, monkeypatch):
    secret = "tg-ns-sandbox-secret-4711"
    monkeypatch.setenv("TG_NS_SECRET", secret)
    res = _attack(
        tmp_path,
        """
        import glob, os
        def test_read():
            print("ENV", dict(os.environ))
            for path in ("/etc/shadow", "/root/.bashrc", "/work/main/tg_jax", "/home", "/var"):
                print(path, os.path.exists(path))
            print("ROOT", os.listdir("/root"))
            print("WORK", [d for d, _, _ in os.walk("/work")])
            for path in glob.glob("/proc/[0-9]*/environ"):
                try:
                    print("PROC", path, open(path, "rb").read())
                except PermissionError:
                    print("PROC", path, "refused")
            print("PIDS", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
        """,
    )
    assert res.status == "ok", res.stdout + res.stderr
    assert secret not in res.stdout and "TG_NS_SECRET" not in res.stdout
    for path in ("/etc/shadow", "/root/.bashrc", "/work/main/tg_jax", "/home", "/var"):
        assert f"{path} False" in res.stdout
    # /root and /work hold only the mount points of the interpreter's prefixes.
    assert "ROOT ['.pyenv']" in res.stdout or "ROOT []" in res.stdout
    work = res.stdout.split("WORK ")[1].splitlines()[0]
    venv = os.path.realpath(sys.prefix)
    assert all(venv.startswith(d) or d.startswith(venv) for d in json.loads(work.replace("'", '"')))
    pids = json.loads(res.stdout.split("PIDS ")[1].splitlines()[0])
    assert max(pids) < 20, "only the sandbox's own processes are visible"


@pytest.mark.slow
def test_other_sandboxes_copies_are_invisible(tmp_path):
    """A spy sandbox sees none of a live sandbox's files or processes (the victim is checked
    to outlive the spy; both get time to start on a loaded machine)."""
    token = "tg-other-task-7f3a"
    a_repo = tmp_path / "a"
    a_repo.mkdir()
    (a_repo / f"{token}.txt").write_text(token)
    results = {}
    slow = dataclasses.replace(FAST, timeout_s=20.0)

    def victim():
        results["a"] = run_command(
            [PY, "-c", f"import time; open('/tmp/{token}', 'w').write('x'); time.sleep(12)"],
            repo=str(a_repo), limits=slow,
        )  # fmt: skip

    thread = threading.Thread(target=victim)
    thread.start()
    spy = f"""
        import os, time
        def test_spy():
            time.sleep(0.5)
            hits = []
            for top in ("/repo", "/tmp", "/dev/shm", "/proc"):
                for dirpath, dirs, names in os.walk(top):
                    if dirpath.startswith("/proc/") and dirpath.count("/") > 2:
                        dirs[:] = []
                    hits += [n for n in names + dirs if {token!r} in n]
            for pid in (p for p in os.listdir("/proc") if p.isdigit()):
                if {token!r}.encode() in open(f"/proc/{{pid}}/cmdline", "rb").read():
                    hits.append(pid)
            print("HITS", hits)
        """
    res = _attack(tmp_path, spy, limits=dataclasses.replace(FAST, timeout_s=10.0))
    assert thread.is_alive(), "the victim ended before the spy looked"
    thread.join()
    assert res.status == "ok", res.stdout + res.stderr
    assert "HITS []" in res.stdout
    assert results["a"].status == "ok"


def test_network_is_unreachable(tmp_path):
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.2)
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind(f"\0tg-ns-sandbox-{os.getpid()}")
    abstract.listen(1)
    port = srv.getsockname()[1]
    res = _attack(
        tmp_path,
        f"""
        import socket, subprocess
        def test_net():
            for target in (("127.0.0.1", {port}), ("1.1.1.1", 80), ("localhost", {port})):
                try:
                    socket.create_connection(target, timeout=1)
                    print("CONNECTED", target)
                except OSError as e:
                    print("refused", type(e).__name__)
            u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                u.connect("\\0tg-ns-sandbox-{os.getpid()}")
                print("CONNECTED unix")
            except OSError as e:
                print("refused unix", type(e).__name__)
            print(subprocess.run(["ip", "link", "set", "lo", "up"],
                                 capture_output=True, text=True).returncode)
        """,
    )
    assert res.status == "ok", res.stdout + res.stderr
    assert "CONNECTED" not in res.stdout and res.stdout.count("refused") == 4
    for listener in (srv, abstract):
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()
        listener.close()


def test_orphaned_setsid_daemon_dies_with_the_run(tmp_path):
    res = _attack(
        tmp_path,
        """
        import os, subprocess
        def test_daemon():
            code = "import os, time; os.setsid(); os.closerange(0, 3); time.sleep(60)"
            subprocess.Popen(["python", "-c", code], start_new_session=True)
            subprocess.Popen(["sh", "-c", "nohup sleep 60 >/dev/null 2>&1 &"])
        """,
    )
    assert res.status == "ok", res.stdout + res.stderr
    assert res.wall_s < 2.5
    # no_leftovers scans the host for the daemons.


def test_killing_the_parent_is_contained(tmp_path):
    host_pid = os.getpid()
    res = _attack(
        tmp_path,
        f"""
        import os, signal
        def test_kill():
            for pid in (os.getppid(), 1, {host_pid}):
                try:
                    os.kill(pid, signal.SIGKILL)
                    print("sent", pid)
                except OSError as e:
                    print("refused", pid, type(e).__name__)
            try:
                os.kill(-1, signal.SIGKILL)  # every process it may signal but PID 1 and itself
            except ProcessLookupError:
                pass
            print("still alive: PID 1 ignores signals it does not handle", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        """,
    )
    assert res.status == "killed" and res.message == "killed: signal SIGKILL", res.stdout
    assert "still alive" in res.stdout  # os.getppid() is 1: "sent", and dropped by the kernel
    assert f"refused {host_pid} ProcessLookupError" in res.stdout
    assert res.wall_s < 3.0
    again = run_command(["true"], limits=FAST)
    assert again.status == "ok", "the next run still works"


@pytest.mark.parametrize(
    "body",
    [
        "while True:\n        print('x' * 1000)",
        "import sys\n    while True:\n        sys.stderr.write('y' * 1000)",
        "import subprocess\n    subprocess.run(['yes'])",
    ],
)
def test_output_flood_is_cut_off(tmp_path, body):
    limits = dataclasses.replace(FAST, timeout_s=5.0, max_output_bytes=4096)
    res = _attack(tmp_path, f"def test_flood():\n    {body}\n", limits)
    assert res.status == "output_limit"
    assert res.message == "output_limit: output exceeded 4096 bytes"
    assert len(res.stdout) <= 4096 and len(res.stderr) <= 4096
    assert res.wall_s < 3.0


def test_set_up_failures_raise_a_clear_error():
    with pytest.raises(SandboxUnavailable, match=r"mount /tmp/tg_ns_sandbox_root: Invalid"):
        run_command(["true"], limits=Limits(inodes=-1))
    assert run_command(["true"]).status == "ok", "a failed set-up leaves the next run intact"


def test_bad_file_names_and_missing_commands():
    with pytest.raises(ValueError, match="relative paths"):
        run_command(["true"], files={"../x": ""})
    res = run_command(["no-such-command-4711"], limits=FAST)
    assert res.status == "error" and res.returncode == 127
    assert "cannot run 'no-such-command-4711'" in res.stderr


def test_python_backend_keeps_the_audit_hook_and_the_kernel_limits():
    res = ns_sandbox.run_python("import os\nos.system('true')\n")
    assert res.status == "error" and "os.system is blocked" in res.message
    res = ns_sandbox.run_python("import os\nprint(os.getcwd(), os.getuid())\n")
    assert res.status == "ok" and res.stdout == "/repo 1000\n"
    # Without the hook, the kernel still refuses forks (RLIMIT_NPROC 0 for a non-root uid).
    res = ns_sandbox.run_python("import os\nos.fork()\n", audit=False)
    assert res.status == "error" and "BlockingIOError" in res.message
    res = ns_sandbox.run_python("x = bytearray(1 << 30)\n", memory_mb=128)
    assert res.status == "memory"


def test_run_many_runs_concurrently():
    jobs = [dict(argv=[PY, "-c", f"print({i})"], limits=FAST) for i in range(6)]
    results = ns_sandbox.run_many(jobs, workers=3)
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(6)]


def test_cli_prints_one_json_object(tmp_path):
    repo = _repo(tmp_path, "from lib import add\ndef test_add():\n    assert add(1, 1) == 3\n")
    cmd = [PY, "-m", "tg_jax.envs.sandbox", "--repo", repo, "--timeout", "5", "--"]
    cmd += ns_sandbox.light_runner_argv()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=os.getcwd())
    out = json.loads(proc.stdout)
    assert proc.returncode == 0
    assert set(out) == {"status", "returncode", "stdout", "stderr", "wall_s", "message"}
    assert out["status"] == "error" and out["returncode"] == 1
    assert "0 passed, 1 failed" in out["stdout"] and out["wall_s"] > 0


@pytest.mark.parametrize(
    "code, values, error",
    [
        ("def f(x): return 2*x+3", ("3", "5", "11"), None),
        ("def f(x) return x", None, "SyntaxError line 1"),
        ("def f(x):\n    while True: pass", None, "timeout"),
        ("import os\nos.write(1, b'x' * 10**6)\ndef f(x): return x", None, "too much output"),
        ("x = bytearray(1 << 30)", None, "MemoryError"),
        ("import socket\nsocket.socket()", None, "PermissionError: sandbox: network access"),
    ],
)
def test_coding_env_on_the_namespace_backend(code, values, error):
    # 0.5 s for the loop that must time out; the others get room to start on a loaded machine
    # (a 1 GiB allocation was once still starting after 0.5 s beside the test suite).
    timeout_s = 0.5 if error == "timeout" else 5.0
    out = run_candidate(code, [0, 1, 4], timeout_s=timeout_s, sandbox="namespace")
    assert out == ExecOutcome(values, out.error if error else None)
    if error:
        assert out.error.startswith(error)
    else:
        assert out == run_trusted(code, [0, 1, 4])


_ROOTLESS_SCRIPT = """
import json, sys
sys.path.insert(0, REPO_ROOT)
from tg_jax.envs import ns_sandbox as n
limits = n.Limits(timeout_s=3, cpu_s=3, memory_mb=256, nproc=16, disk_mb=8, max_file_mb=4)
bomb = "import os, time\\nn = 0\\ntry:\\n    while True:\\n        if os.fork() == 0:\\n"
bomb += "            time.sleep(60)\\n            os._exit(0)\\n        n += 1\\n"
bomb += "except BlockingIOError:\\n    print('forks', n)\\n"
escape = "echo x > /usr/pwned; echo x > /pwned; mount -o remount,rw /usr; echo done"
jobs = {
    "id": (["sh", "-c", "id -u; cat /repo/a.txt"], {"files": {"a.txt": "hello"}}),
    "escape": (["sh", "-c", escape], {}),
    "bomb": ([sys.executable, "-c", bomb], {}),
    "sleep": (["sleep", "60"], {"limits": n.Limits(timeout_s=0.5)}),
}
out = {}
for name, (argv, kw) in jobs.items():
    kw.setdefault("limits", limits)
    r = n.run_command(argv, **kw)
    out[name] = [r.status, r.stdout, r.stderr]
print(json.dumps(out))
"""


@pytest.fixture
def world_readable_package():
    """A copy of the tg_jax package in a directory every user can read: the checkout may live
    where uid 65534 cannot (a mode-700 `mktemp -d`, /root), which must not decide the test."""
    staged = tempfile.mkdtemp(prefix="tg_jax_rootless_")
    package = os.path.dirname(os.path.dirname(ns_sandbox.__file__))
    shutil.copytree(
        package, os.path.join(staged, "tg_jax"), ignore=shutil.ignore_patterns("__pycache__")
    )
    for root, dirs, files in os.walk(staged):
        for name in [*dirs, *files]:
            path = os.path.join(root, name)
            os.chmod(path, 0o755 if os.path.isdir(path) else 0o644)
    os.chmod(staged, 0o755)
    yield staged
    shutil.rmtree(staged, ignore_errors=True)


def test_rootless_mode_as_an_unprivileged_user(world_readable_package):
    """The supervisor as uid 65534 (the system interpreter: the venv's lives under /root), on
    a world-readable copy of the package."""
    python, setpriv = "/usr/bin/python3", "/usr/bin/setpriv"
    if not (os.path.exists(python) and os.path.exists(setpriv)):
        pytest.skip("needs /usr/bin/python3 and setpriv")
    script = _ROOTLESS_SCRIPT.replace("REPO_ROOT", repr(world_readable_package))
    cmd = [setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups", python, "-c"]
    proc = subprocess.run([*cmd, script], capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["id"][:2] == ["ok", "1000\nhello"]
    assert out["escape"][0] == "ok" and out["escape"][1] == "done\n"
    assert out["escape"][2].count("Read-only file system") == 2
    assert "must be superuser" in out["escape"][2]
    assert out["bomb"][0] == "ok" and int(out["bomb"][1].split()[1]) < 16
    assert out["sleep"][0] == "timeout"
    left = subprocess.run(["ps", "-o", "pid=,comm=", "-u", "65534"], capture_output=True, text=True)
    assert left.stdout.strip() == ""
