"""Sandboxed runs per second and their latency: the other half of a rollout's cost.

    python -m tg_jax.bench --suite quick --sections sandbox

Cases (each a batch of identical runs from a pool of `workers` threads; the first two runs
of a case are a warm-up and not timed):
  * audit/python, namespace/python: one coding-env tool call (tg_jax.envs.coding's test
    harness on 8 inputs) with tg_jax.envs.sandbox.run_python, backend "audit" or "namespace";
  * namespace/light, namespace/pytest, namespace/pytest_noplugins: the tests of a 5-file
    repository (two modules, two test files, pytest.ini) as a command in
    tg_jax.envs.ns_sandbox, run by the light runner, by `python -m pytest -q`, or by the
    same with PYTEST_DISABLE_PLUGIN_AUTOLOAD=1.

Figures per case: runs_per_s (runs / wall time of the batch), p50_ms and p95_ms (latency of
one run, spawn to reap), n, workers, load (the 1-minute load average after the batch).
"""

from __future__ import annotations

import concurrent.futures
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from tg_jax.bench import measure
from tg_jax.envs import coding, ns_sandbox, sandbox

_FILES = {
    "mathx.py": "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
    "textx.py": "def shout(s):\n    return s.upper() + '!'\n",
    "pytest.ini": "[pytest]\naddopts = -p no:cacheprovider\n",
    "tests/test_mathx.py": (
        "from mathx import gcd\n\n\ndef test_gcd():\n    assert gcd(12, 18) == 6\n\n\n"
        "def test_gcd_zero():\n    assert gcd(5, 0) == 5\n"
    ),
    "tests/test_textx.py": (
        "from textx import shout\n\n\ndef test_shout():\n    assert shout('hi') == 'HI!'\n"
    ),
}
_SOLUTION = "def f(x):\n    return 3 * x + 1\n"


def write_repo(root: str) -> str:
    """The benchmark's 5-file repository under `root`; returns its path."""
    for rel, text in _FILES.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return root


def _case(run: Callable[[], sandbox.SandboxResult], n: int, workers: int) -> dict[str, Any]:
    for _ in range(2):
        res = run()
        if res.status != "ok":
            raise RuntimeError(f"benchmark run failed: {res.message}\n{res.stdout[-500:]}")
    latencies: list[float] = []

    def timed(_):
        t = time.perf_counter()
        res = run()
        latencies.append(time.perf_counter() - t)
        return res.status

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        statuses = list(pool.map(timed, range(n)))
    wall = time.perf_counter() - start
    cuts = statistics.quantiles(latencies, n=20, method="inclusive")
    return {
        "runs_per_s": n / wall,
        "p50_ms": 1e3 * statistics.median(latencies),
        "p95_ms": 1e3 * cuts[18],
        "ok_share": statuses.count("ok") / n,
        "n": n,
        "workers": workers,
        "load": measure.load_average(),
    }


def sandbox_bench(n: int = 40, n_pytest: int = 12, workers: int = 2) -> dict[str, Any]:
    """All cases; {"status": ...} when the namespace sandbox is unavailable here."""
    try:
        ns_sandbox.check_available()
    except ns_sandbox.SandboxUnavailable as e:
        return {"status": f"unavailable: {e}"}
    xs = list(range(8))
    out: dict[str, Any] = {}
    for backend in sandbox.BACKENDS:
        call = lambda b=backend: coding.run_candidate(_SOLUTION, xs, sandbox=b)  # noqa: E731
        run = lambda c=call: _as_result(c())  # noqa: E731
        for w in sorted({1, workers}):
            out[f"{backend}/python/w{w}"] = _case(run, n, w)
    with tempfile.TemporaryDirectory(prefix="tg_bench_repo_") as root:
        repo = write_repo(root)
        pytest = [sys.executable, "-m", "pytest", "-q"]
        commands = {
            "light": (ns_sandbox.light_runner_argv("tests"), {}, n),
            "pytest": (pytest, {}, n_pytest),
            # Without the venv's pytest plugins (entry-point scan, anyio): half the start-up.
            "pytest_noplugins": (pytest, {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}, n_pytest),
        }
        for name, (argv, env, count) in commands.items():
            run = lambda a=argv, e=env: ns_sandbox.run_command(a, repo=repo, env=e)  # noqa: E731
            for w in sorted({1, workers}):
                out[f"namespace/{name}/w{w}"] = _case(run, count, w)
    return out


def _as_result(outcome: coding.ExecOutcome) -> sandbox.SandboxResult:
    ok = outcome.values is not None and outcome.values[1] == "4"
    return sandbox.SandboxResult("ok" if ok else "error", "", str(outcome.error), 0, 0.0, "")
