"""Running a repository's tests: the runner seam and the light in-sandbox pytest runner.

The seam: a runner is any callable

    run(repo_dir: str, command: str, timeout_s: float) -> TestRun

that runs `command` (a pytest command line, e.g. "pytest -rA tests/test_a.py") in a copy of
the repository at `repo_dir` and reports each test id's outcome. The environment writes the
repository it holds into a fresh temporary directory for every call, so a runner may modify
or discard `repo_dir` freely. Runners are chosen by name (`env.runner`) from `RUNNERS`;
`register_runner(name, factory)` adds one (e.g. a namespace sandbox that runs the real pytest
on a bind-mounted copy: it returns pytest's output, and `parse_pytest_summary` turns the
`-rA` summary lines into outcomes).

The built-in "sandbox" runner uses today's audit-hook sandbox (`tg_jax.envs.sandbox`), which
refuses subprocesses, so it cannot start pytest: the files travel inside the script, the
sandboxed child writes them into its own temporary directory and a light pytest-compatible
runner (below) imports each test module and calls its tests in-process. It supports test
functions and `Test*` classes' methods, `pytest.raises`, `pytest.approx` and
`pytest.mark.parametrize` (a shim module, since the child has no site-packages); fixtures are
not supported (a real-pytest runner is the answer for imported tasks that need them). Report
lines carry a per-run random marker, `main.py` is deleted before any repository code runs and
user prints are discarded, so repository code cannot easily forge outcomes; like the sandbox
itself this is a speed bump, not a boundary.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import shlex
from collections.abc import Callable

from tg_jax.envs.sandbox import run_python

OUTCOMES = ("passed", "failed", "error")
MAX_FILE_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class TestRun:
    """What a test run reports.

    Attributes:
      status: "ok" (the runner ran; tests may still fail), "timeout", "error" (the runner
        itself failed, e.g. an unsupported command) or another sandbox status.
      outcomes: test id -> "passed" | "failed" | "error", in report order.
      output: human-readable report (what run_tests shows, before truncation).
      wall_s: seconds the run took.
    """

    __test__ = False  # not a pytest test class

    status: str
    outcomes: dict[str, str]
    output: str
    wall_s: float = 0.0

    @property
    def passed(self) -> int:
        return sum(v == "passed" for v in self.outcomes.values())


Runner = Callable[[str, str, float], TestRun]

_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR) (\S+)(?: - (.*))?$", re.M)


def parse_pytest_summary(output: str) -> dict[str, str]:
    """Outcomes from pytest's `-rA` short summary lines ("PASSED tests/t.py::test_x")."""
    return {m.group(2): m.group(1).lower() for m in _SUMMARY.finditer(output)}


def parse_command(command: str) -> list[str] | None:
    """The pytest arguments of a command line ("pytest ..." or "python -m pytest ..."), or
    None when the command is not a pytest command."""
    try:
        argv = shlex.split(command)
    except ValueError:
        return None
    if argv[:1] in (["pytest"], ["py.test"]):
        return argv[1:]
    if len(argv) >= 3 and argv[0].startswith("python") and argv[1:3] == ["-m", "pytest"]:
        return argv[3:]
    return None


def read_repo(repo_dir: str) -> dict[str, str]:
    """Every text file under `repo_dir` as {relative path: text} (binary / huge files skipped)."""
    files = {}
    for root, dirs, names in os.walk(repo_dir):
        dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", ".git"))
        for name in sorted(names):
            path = os.path.join(root, name)
            if os.path.getsize(path) > MAX_FILE_BYTES:
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    files[os.path.relpath(path, repo_dir).replace(os.sep, "/")] = f.read()
            except (UnicodeDecodeError, OSError):
                continue
    return files


# The light runner, run as main.py in the sandboxed child. FILES, ARGS and MARK are
# substituted by the parent.
_LIGHT_RUNNER = r"""
import os, sys, types, time, traceback, importlib.util
_out = sys.stdout
try:
    os.remove("main.py")
except OSError:
    pass
class _Sink:
    def write(self, s):
        return len(s)
    def flush(self):
        pass
sys.stdout = sys.stderr = _Sink()
for _p, _s in FILES.items():
    if os.path.dirname(_p):
        os.makedirs(os.path.dirname(_p), exist_ok=True)
    with open(_p, "w", encoding="utf-8") as _f:
        _f.write(_s)
del FILES
sys.path.insert(0, os.getcwd())

def _shim():
    m = types.ModuleType("pytest")
    class _Raises:
        def __init__(self, exc, match=None):
            self.exc, self.match, self.value = exc, match, None
        def __enter__(self):
            return self
        def __exit__(self, et, ev, tb):
            if et is None:
                raise AssertionError("DID NOT RAISE " + getattr(self.exc, "__name__", "?"))
            if not issubclass(et, self.exc):
                return False
            if self.match is not None:
                import re
                assert re.search(self.match, str(ev)), "pattern not found: " + self.match
            self.value = ev
            return True
    def approx(v, rel=1e-6, abs=1e-12):
        class _A:
            def __eq__(self, o):
                return o == v or (o - v) ** 2 <= max(rel * (v if v > 0 else -v), abs) ** 2
            def __repr__(self):
                return "approx(%r)" % (v,)
        return _A()
    class _Mark:
        def parametrize(self, names, values, **kw):
            def deco(fn):
                fn.__dict__.setdefault("_tg_params", []).insert(0, (names, list(values)))
                return fn
            return deco
        def __getattr__(self, name):
            return lambda *a, **k: (a[0] if a and callable(a[0]) and not k else (lambda f: f))
    m.raises, m.approx, m.mark = _Raises, approx, _Mark()
    def fail(msg=""):
        raise AssertionError(msg)
    m.fail = fail
    return m
sys.modules["pytest"] = _shim()

def _msg(e, path):
    tb = [f for f in traceback.extract_tb(e.__traceback__)]
    where = [f for f in tb if f.filename.endswith(path)] or [
        f for f in tb if not f.filename.endswith("main.py") and "importlib" not in f.filename]
    text = type(e).__name__ + (": " + str(e).split("\n")[0] if str(e) else "")
    if isinstance(e, SyntaxError):
        text += " (%s, line %s)" % (e.filename, e.lineno)
    elif where:
        f = where[-1]
        text += " at %s:%s: %s" % (os.path.relpath(f.filename), f.lineno, (f.line or "").strip())
    return text[:300]

def _expand(fn):
    cases = [((), ())]
    for names, values in getattr(fn, "_tg_params", []):
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        new = []
        for ns, vs in cases:
            for v in values:
                v = v if len(names) > 1 else (v,)
                new.append((ns + tuple(names), vs + tuple(v)))
        cases = new
    if len(cases) == 1 and not cases[0][0]:
        return [("", {})]
    return [("[" + "-".join(str(x) for x in vs) + "]", dict(zip(ns, vs))) for ns, vs in cases]

def _collect(path):
    name = "_tg_test_" + path[:-3].replace("/", "_").replace(".", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    tests = []
    for key, obj in list(vars(mod).items()):
        if key.startswith("test") and callable(obj) and not isinstance(obj, type):
            tests.append((key, obj))
        elif key.startswith("Test") and isinstance(obj, type):
            for meth in sorted(k for k in vars(obj) if k.startswith("test")):
                run = (lambda c, m: lambda **kw: getattr(c(), m)(**kw))(obj, meth)
                tests.append((key + "::" + meth, run))
                tests[-1][1]._tg_params = getattr(vars(obj)[meth], "_tg_params", [])
    return tests

def _files(args):
    picks = [a for a in args if not a.startswith("-")] or ["."]
    out = []
    for a in picks:
        path, _, sel = a.partition("::")
        if os.path.isdir(path):
            for root, dirs, names in os.walk(path):
                dirs.sort()
                for n in sorted(names):
                    if n.endswith(".py") and (n.startswith("test_") or n.endswith("_test.py")):
                        out.append((os.path.relpath(os.path.join(root, n)), ""))
        else:
            out.append((os.path.normpath(path), sel))
    return out

def _run(args):
    lines, counts = [], {"passed": 0, "failed": 0, "error": 0}
    for path, sel in _files(args):
        try:
            if not os.path.isfile(path):
                raise FileNotFoundError("no such test file: " + path)
            tests = _collect(path)
        except BaseException as e:
            lines.append(("ERROR", path, _msg(e, path)))
            counts["error"] += 1
            continue
        for key, fn in tests:
            if sel and key != sel and not key.startswith(sel + "["):
                continue
            for suffix, kw in _expand(fn):
                try:
                    fn(**kw)
                    lines.append(("PASSED", path + "::" + key + suffix, ""))
                    counts["passed"] += 1
                except BaseException as e:
                    lines.append(("FAILED", path + "::" + key + suffix, _msg(e, path)))
                    counts["failed"] += 1
    return lines, counts

_t0 = time.time()
_lines, _counts = _run(ARGS)
for _k, _id, _m in _lines:
    _out.write(MARK + " " + _k + " " + _id + (" - " + _m if _m else "") + "\n")
_out.write(MARK + " = %d failed, %d passed, %d errors in %.2fs\n" % (
    _counts["failed"], _counts["passed"], _counts["error"], time.time() - _t0))
_out.flush()
os._exit(0)
"""


class SandboxRunner:
    """The "sandbox" runner: the light pytest runner in `tg_jax.envs.sandbox.run_python`."""

    def __init__(self, *, cpu_s: int = 2, memory_mb: int = 512, max_output_bytes: int = 65536):
        self.cpu_s, self.memory_mb, self.max_output_bytes = cpu_s, memory_mb, max_output_bytes

    def __call__(self, repo_dir: str, command: str, timeout_s: float) -> TestRun:
        args = parse_command(command)
        if args is None:
            return TestRun("error", {}, f"error: only pytest commands can run here: {command!r}")
        mark = "@@" + secrets.token_hex(8)
        script = (
            f"FILES = {read_repo(repo_dir)!r}\nARGS = {args!r}\nMARK = {mark!r}\n" + _LIGHT_RUNNER
        )
        res = run_python(
            script,
            timeout_s=timeout_s,
            cpu_s=self.cpu_s,
            memory_mb=self.memory_mb,
            max_output_bytes=self.max_output_bytes,
            max_file_mb=4,
            max_open_files=64,
        )
        lines = [ln[len(mark) + 1 :] for ln in res.stdout.splitlines() if ln.startswith(mark)]
        output = "\n".join(lines)
        if res.status != "ok" or not lines:
            reason = res.message if res.status != "ok" else "error: the test run reported nothing"
            return TestRun(res.status if res.status != "ok" else "error", {}, reason, res.wall_s)
        outcomes = parse_pytest_summary(output)
        return TestRun("ok", outcomes, output, res.wall_s)


class NamespaceRunner:
    """The "namespace" runner: the real pytest (plugin autoload off) over a copy of the
    repository in the kernel-enforced sandbox (`tg_jax.envs.ns_sandbox`: namespaces, no
    network, rlimits, wall-clock kill of the PID namespace); subprocesses are allowed, so
    fixtures, conftest.py and tests that spawn work. Needs pytest in the interpreter."""

    def __init__(self, *, cpu_s: int = 10, memory_mb: int = 1024):
        from tg_jax.envs import ns_sandbox  # noqa: PLC0415 (Linux namespaces only)

        ns_sandbox.check_available()
        self._ns, self.cpu_s, self.memory_mb = ns_sandbox, cpu_s, memory_mb

    def __call__(self, repo_dir: str, command: str, timeout_s: float) -> TestRun:
        args = parse_command(command)
        if args is None:
            return TestRun("error", {}, f"error: only pytest commands can run here: {command!r}")
        limits = self._ns.Limits(timeout_s=timeout_s, cpu_s=self.cpu_s, memory_mb=self.memory_mb)
        res = self._ns.run_command(
            ["python", "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *args],
            repo=repo_dir,
            env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
            limits=limits,
        )
        outcomes = parse_pytest_summary(res.stdout)
        if res.status not in ("ok", "error") or not outcomes:  # exit 1 = some tests failed
            return TestRun(
                res.status if res.status != "ok" else "error", {}, res.message, res.wall_s
            )
        return TestRun("ok", outcomes, res.stdout, res.wall_s)


RUNNERS: dict[str, Callable[..., Runner]] = {"sandbox": SandboxRunner, "namespace": NamespaceRunner}


def register_runner(name: str, factory: Callable[..., Runner]) -> None:
    """Makes `env.runner = name` construct runners with `factory(cpu_s=, memory_mb=)`."""
    RUNNERS[name] = factory


def make_runner(name: str, *, cpu_s: int, memory_mb: int) -> Runner:
    """The named runner (see RUNNERS)."""
    if name not in RUNNERS:
        raise ValueError(f"unknown test runner {name!r}; known: {sorted(RUNNERS)}")
    return RUNNERS[name](cpu_s=cpu_s, memory_mb=memory_mb)
