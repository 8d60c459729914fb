#!/usr/bin/env bash
# Run a tg_jax job on a Cloud TPU VM / pod slice, recreating it after preemptions
# (what it does, step by step: tg_jax/tpu/launch.py). Needs gcloud and python3 (no JAX) here:
#   bash launch/tpu.sh --name=tg-30b --zone=us-east5-a --project=my-project \
#       --topology=v5p:2x4x4 --config=configs/qwen3_coder_30b_a3b_tg.py \
#       --workdir=gs://my-bucket/runs/tg-30b --spot --queued [--vllm] [--allow-dirty] \
#       [--dry-run] [-- --config.a=b]
# It ships HEAD's commit (a dirty tree is refused unless --allow-dirty), installs Python 3.12 and
# the pins of constraints-tpu.txt on every worker, and stops at once on exits 2 and 3 (config
# error, fit check, gates); preemptions and crashes are retried. --dry-run prints it all.
# A local pod (the same worker command as P local processes of D CPU devices; the project's
# venv from `bash launch/local.sh` runs the workers):
#   bash launch/tpu.sh --local --processes=2 --devices-per-process=4 \
#       --config=configs/qwen3_coder_30b_a3b_tg.py:runlocal --workdir=W --hf-checkpoint=DIR
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
if [[ " $* " == *" --local "* && -x .venv/bin/python ]]; then
  PY=.venv/bin/python
fi
exec "$PY" -m tg_jax.tpu.launch "$@"
