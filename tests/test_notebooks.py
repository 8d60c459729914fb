"""Every notebook in notebooks/ runs top to bottom on tiny settings, and is stored clean.

The notebooks run in a python3 kernel (ipykernel) of this interpreter, with
TG_NOTEBOOK_TINY=1 and no workdir: the quickstart and losses notebooks use a randomly
initialised tiny model, the results notebook a synthetic workdir (tg_jax.notebook.demo_workdir).
"""

import datetime
import os
import pathlib
import sys
import time

import nbformat
import pytest

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300


def _kernel_name() -> str:
    """The python3 kernelspec, installed into this interpreter's prefix if it is missing."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        from ipykernel.kernelspec import install

        install(prefix=sys.prefix)
    return "python3"


def test_notebooks_exist():
    names = {p.name for p in NOTEBOOKS}
    assert {"quickstart.ipynb", "losses.ipynb", "results.ipynb"} <= names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has outputs"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"


def _cell_seconds(nb) -> dict[int, float]:
    """Wall time of each code cell (nbclient's timing metadata), for slow-test diagnosis."""
    out = {}
    for i, cell in enumerate(nb.cells):
        timing = cell.get("metadata", {}).get("execution", {})
        start, end = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
        if start and end:
            delta = datetime.datetime.fromisoformat(end) - datetime.datetime.fromisoformat(start)
            out[i] = round(delta.total_seconds(), 1)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch, tmp_path):
    from nbclient import NotebookClient

    # The kernel inherits this environment: tiny settings, one CPU device (not the 8
    # simulated devices of conftest.py), and the persistent compilation cache of the tests.
    monkeypatch.setenv("TG_NOTEBOOK_TINY", "1")
    monkeypatch.delenv("TG_NOTEBOOK_WORKDIR", raising=False)
    monkeypatch.delenv("TG_NOTEBOOK_CONFIG", raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if "xla_force_host_platform_device_count" not in f]
    monkeypatch.setenv("XLA_FLAGS", " ".join(flags))
    default_cache = pathlib.Path(__file__).resolve().parents[1] / ".jax_cache"
    cache = os.environ.get("TG_JAX_COMPILATION_CACHE", str(default_cache))
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", os.path.abspath(cache))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    monkeypatch.setenv("TMPDIR", str(tmp_path))

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        kernel_name=_kernel_name(),
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    start = time.time()
    client.execute()  # raises CellExecutionError on the first failing cell
    print(f"{path.name}: {time.time() - start:.1f} s; cells: {_cell_seconds(nb)}")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]  # fmt: skip
    assert not errors, errors
