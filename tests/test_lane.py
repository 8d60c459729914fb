"""The CI lanes (tests/conftest.py, launch/local.sh test-py312): in the py312 lane a test whose
import of torch, transformers or vLLM fails is skipped and counted, for that reason only; in
any other lane the reference stack must be there; a missing Python 3.12 is one error line."""

import importlib.util
import os
import shutil
import subprocess
import sys
import types

import pytest

from tests import conftest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def without_torch(monkeypatch):
    """find_spec as where torch is not installed and transformers and vllm are, in any lane."""
    real, installed = importlib.util.find_spec, importlib.util.find_spec("os")
    stack = {"torch": None, "transformers": installed, "vllm": installed}
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: stack[name] if name in stack else real(name, *a),
    )


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as e:  # the exception with its traceback
        return e


def _import_error_from(name: str) -> ImportError:
    """ImportError with the install line, raised from the failed import (vllm_engine's way)."""
    try:
        try:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        except ModuleNotFoundError as e:
            raise ImportError("pip install ...") from e
    except ImportError as e:
        return e


def _raised_in(path: str, name: str) -> ModuleNotFoundError:
    """ModuleNotFoundError for `name`, raised by code in the repository's file `path`."""
    code = compile(
        f"raise ModuleNotFoundError('...', name={name!r})", os.path.join(REPO, path), "exec"
    )
    try:
        exec(code, {})
    except ModuleNotFoundError as e:
        return e


def test_only_a_missing_reference_module_counts(without_torch):
    missing = conftest._missing_reference
    assert missing(_raised(ModuleNotFoundError("No module named 'torch'", name="torch"))) == "torch"
    assert missing(_raised(ModuleNotFoundError("...", name="torch.nn"))) == "torch"
    assert missing(_import_error_from("torch")) == "torch"  # through __cause__
    # Installed (transformers here), another module, another error: not the lane's reason.
    assert missing(_import_error_from("transformers")) is None
    assert missing(_raised(ModuleNotFoundError("No module named 'tqdm2'", name="tqdm2"))) is None
    assert missing(_raised(AssertionError("torch"))) is None
    assert missing(None) is None
    # Imported by tg_jax's modules of optional dependencies: counts; by the rest of tg_jax: not
    # the lane's reason (a pod without vLLM has no torch either).
    assert missing(_raised_in("tg_jax/bench/hf_reference.py", "torch")) == "torch"
    assert missing(_raised_in("tg_jax/train/rl.py", "torch")) is None


def _report(item, call, lane, monkeypatch):
    monkeypatch.setattr(conftest, "LANE", lane)
    hook = conftest.pytest_runtest_makereport(item, call)
    next(hook)
    report = types.SimpleNamespace(outcome="failed", longrepr="traceback")
    with pytest.raises(StopIteration) as stop:
        hook.send(report)
    return stop.value.value


def test_the_skip_is_the_py312_lanes_alone(without_torch, monkeypatch):
    item = types.SimpleNamespace(path="tests/test_x.py", location=("tests/test_x.py", 9, "t"))
    exc = _import_error_from("torch")
    call = types.SimpleNamespace(excinfo=types.SimpleNamespace(value=exc))
    skipped = _report(item, call, "py312", monkeypatch)
    assert skipped.outcome == "skipped"
    assert skipped.longrepr == ("tests/test_x.py", 10, "not in the py312 lane: torch")
    assert _report(item, call, "main", monkeypatch).outcome == "failed"
    other = types.SimpleNamespace(excinfo=types.SimpleNamespace(value=_raised(ValueError())))
    assert _report(item, other, "py312", monkeypatch).outcome == "failed"


def test_the_main_lane_refuses_to_run_without_the_reference_stack(without_torch, monkeypatch):
    monkeypatch.setattr(conftest, "LANE", "main")
    with pytest.raises(pytest.UsageError, match=r"^error: torch not installed"):
        conftest.pytest_configure(None)
    monkeypatch.setattr(conftest, "LANE", "py312")
    conftest.pytest_configure(None)


@pytest.mark.parametrize("where", ["not_3_12", "absent", "nowhere"])
def test_no_python_3_12_is_one_error_line_and_exit_2(tmp_path, where):
    """$TG_JAX_PY312 naming another interpreter or nothing, or none in pyenv or on PATH: one
    `error:` line, exit 2, before any venv is made."""
    env = {**os.environ, "TG_JAX_VENV312": str(tmp_path / "venv")}
    if where == "nowhere":  # a PATH with no pyenv and no python3.12: only what local.sh needs
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        for tool in ("dirname", "ls", "sort"):
            os.symlink(shutil.which(tool), bin_dir / tool)
        env["PATH"], env["HOME"] = str(bin_dir), str(tmp_path)  # no ~/.pyenv either
        env.pop("TG_JAX_PY312", None)
        env.pop("PYENV_ROOT", None)
    else:
        env["TG_JAX_PY312"] = sys.executable if where == "not_3_12" else str(tmp_path / "none")
    if where == "not_3_12" and sys.version_info[:2] == (3, 12):
        env["TG_JAX_PY312"] = "/bin/false"  # an executable that is not Python 3.12
    proc = subprocess.run(
        ["/bin/bash", os.path.join(REPO, "launch", "local.sh"), "test-py312"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    expected = "none in pyenv's versions" if where == "nowhere" else "is not a Python 3.12"
    assert expected in lines[0]
    assert not (tmp_path / "venv").exists()
