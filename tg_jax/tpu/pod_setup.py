"""What a pod's workers run before the job: the code the launcher ships, and the install.

The code: a clean git tree ships its HEAD commit (resolved once, so a reinstall after a
preemption ships the same code). A dirty tree is refused: `git archive HEAD` would leave the
uncommitted edits (a config changed for this run) behind without a word. With
`--allow-dirty` the working tree ships as it is: a tree object of every tracked and
untracked, not ignored, file (`git add -A` into a temporary index; the repository's own
index, HEAD and files are not touched), and the launcher lists the uncommitted paths.

The install (`install_script`, run by bash on every worker): the VM images' python3 is the
image's (Ubuntu 22.04: Python 3.10), too old for the pins (jax 0.11.2 and tpu-inference need
Python >= 3.11 / 3.12). So each worker installs its own interpreter, CPython `PYTHON`, with
uv `UV` (pinned: uv's release fixes the exact interpreter build it downloads). uv comes from
PyPI through the image's own `python3 -m pip --user` (PyPI is needed for everything else
anyway; no root, no apt, no PPA: deadsnakes would need sudo, the launchpad PPA reachable and
the dpkg lock that a fresh VM's unattended-upgrades often holds); the interpreter is
python-build-standalone's, downloaded by uv from GitHub into ~/.tg_jax/python. Then a venv
of that interpreter gets the code with the `tpu` extra and the pins of constraints-tpu.txt:
`jax[tpu]==0.11.2`, flax 0.12.10 (the versions tpu-inference 0.32.0 pins), and
`vllm-tpu==0.32.0` with `--vllm`. `--python=PATH` uses an interpreter already on the workers
instead (a custom image), checked the same way. A step that fails prints one
`error: ...` line; a missing or wrong interpreter exits 2 (the launcher stops at once), a
download or pip failure 1 (retried, up to the launcher's limit on quick failures).

Only the standard library: the launcher runs without JAX.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

PYTHON = "3.12.16"  # CPython of the pods' venv (uv 0.13.10's newest 3.12 build)
UV = "0.13.10"  # installs PYTHON (its release fixes the interpreter build)
PIP = "26.3"  # the venv's pip (the one constraints-tpu.txt was resolved with)
TPU_PINS = ("jax[tpu]==0.11.2", "flax==0.12.10")  # tpu-inference 0.32.0's
VLLM_PIN = "vllm-tpu==0.32.0"  # --vllm: rollout_engine="vllm" on TPU
CONSTRAINTS = "constraints-tpu.txt"
PYTHON_DIR = "$HOME/.tg_jax/python"  # uv's interpreters on a worker


def dirty_paths(porcelain: str) -> list[str]:
    """The paths `git status --porcelain` lists (modified, staged, deleted, untracked)."""
    return [line[3:] for line in porcelain.splitlines() if line.strip()]


def dirty_refusal(porcelain: str, allow_dirty: bool) -> str | None:
    """The error line for a dirty tree without --allow-dirty, else None."""
    paths = dirty_paths(porcelain)
    if not paths or allow_dirty:
        return None
    shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
    return (
        f"the git tree has uncommitted changes ({shown}): a pod runs committed code only. "
        "Commit them, or pass --allow-dirty to ship the working tree as it is"
    )


def _git(*args: str, env: dict[str, str] | None = None, cwd: str | None = None) -> str:
    proc = subprocess.run(["git", *args], capture_output=True, text=True, env=env, cwd=cwd)
    if proc.returncode:
        raise RuntimeError(f"git {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def git_status(cwd: str | None = None) -> tuple[str, str]:
    """(HEAD's commit id, `git status --porcelain`) of the repository at cwd."""
    return _git("rev-parse", "HEAD", cwd=cwd).strip(), _git("status", "--porcelain", cwd=cwd)


def working_tree(cwd: str | None = None) -> str:
    """The id of a git tree holding the working tree (tracked and untracked files, not the
    ignored ones), made in a temporary index: the repository's index, HEAD and files stay."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": os.path.join(tmp, "index")}
        _git("read-tree", "HEAD", env=env, cwd=cwd)
        _git("add", "-A", env=env, cwd=cwd)
        return _git("write-tree", env=env, cwd=cwd).strip()


def install_script(remote_dir: str, tarball: str, *, vllm: bool = False, python: str = "") -> str:
    """The bash script every worker runs to install the shipped code (module docstring);
    `tarball` is the code's archive in the worker's home, `python` an interpreter already
    there (default: uv installs PYTHON)."""
    pins = " ".join(f'"{p}"' for p in (*TPU_PINS, *([VLLM_PIN] if vllm else [])))
    # uv's interpreter must be PYTHON exactly; one the image has, the same minor version.
    want = PYTHON if not python else ".".join(PYTHON.split(".")[:2])
    version = tuple(int(v) for v in want.split("."))
    # No single quotes: the script travels quoted inside gcloud's --command (readable there).
    lines = [
        "set -euo pipefail",
        # fail CODE MESSAGE: 2 stops the launcher (nothing a rerun changes), 1 is retried.
        'fail() { echo "error: $2" >&2; exit "$1"; }',
        f"rm -rf {remote_dir} && mkdir -p {remote_dir}",
        f'tar xzf ~/{tarball} -C {remote_dir} || fail 1 "cannot unpack ~/{tarball}"',
        f"cd {remote_dir}",
    ]
    if python:
        lines.append(f'PY="$(command -v "{python}")" || fail 2 "no Python {python} on $(hostname)"')
    else:
        uv = f'UV_PYTHON_INSTALL_DIR="{PYTHON_DIR}" python3 -m uv'
        lines += [
            'python3 -m pip --version >/dev/null || fail 2 "the image python3 has no pip to '
            'install uv with (--python=PATH: an interpreter the image has)"',
            f'python3 -m pip install --user --quiet uv=={UV} || fail 1 "cannot install uv=={UV}"',
            f'{uv} python install --no-bin {PYTHON} || fail 1 "uv could not install Python '
            f'{PYTHON} (python-build-standalone, from GitHub)"',
            f'PY="$({uv} python find --managed-python {PYTHON})" || fail 2 "no Python {PYTHON}'
            f' in {PYTHON_DIR} after uv python install"',
        ]
    lines += [
        f'"$PY" -c "import sys; sys.exit(sys.version_info[:{len(version)}] != {version})" || '
        f'fail 2 "$PY is $("$PY" -V 2>&1), not Python {want}"',
        '"$PY" -m venv --clear .venv || fail 2 "$PY cannot make a venv"',
        f'.venv/bin/python -m pip install --quiet pip=={PIP} || fail 1 "cannot install pip=={PIP}"',
        f'.venv/bin/python -m pip install --quiet -c {CONSTRAINTS} -e ".[tpu]" {pins} || '
        f'fail 1 "pip could not install the pins of {CONSTRAINTS}"',
        '.venv/bin/python -c "import jax, flax; print(jax.__version__, flax.__version__)"',
    ]
    return "\n".join(lines)


__all__ = [
    "PYTHON",
    "UV",
    "TPU_PINS",
    "VLLM_PIN",
    "dirty_paths",
    "dirty_refusal",
    "git_status",
    "install_script",
    "working_tree",
]
