#!/usr/bin/env bash
# Run a tg_jax job on a Cloud TPU VM / pod slice, recreating it after preemptions
# (what it does, step by step: tg_jax/tpu/launch.py). Needs gcloud and python3 (no JAX) here:
#   bash launch/tpu.sh --name=tg-30b --zone=us-east5-a --project=my-project \
#       --topology=v5p:2x4x4 --config=configs/qwen3_coder_30b_a3b_tg.py \
#       --workdir=gs://my-bucket/runs/tg-30b --spot --queued [--dry-run] [-- --config.a=b]
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 -m tg_jax.tpu.launch "$@"
