"""Entry point: `python -m tg_jax.main --config=configs/X.py --workdir=DIR [--config.a.b=v]`.

Runs the stage named by `config.stage` (`STAGES`):

  data      the task sets as TFDS datasets in DIR/tfds (tg_jax.data.task_data)
  sft       SFT of the base model (resumed if unfinished, skipped if finished), then its
            held-out evaluation DIR/sft_eval.json (tg_jax.train.sft, tg_jax.train.sft_eval)
  pipeline  data -> sft -> the RL arms x seeds -> held-out evaluation -> DIR/report/
            (the main job, tg_jax.train.pipeline; every stage cached or resumed)
  forward   smoke: build the sharded model and run one forward pass
  eval      evaluation only: a checkpoint directory (model.hf_checkpoint) on the held-out
            tasks, with full traces and the report's tables (tg_jax.train.eval_stage)

This file parses flags, checks the config and calls the stage; the logic lives in libraries.
A bad command line or config (an unknown field, a value of the wrong type or out of range, a
workdir that is a file, an unknown stage) is one `error: ...` line on stderr and exit status
2, before any training; the base model outside its gates exits 3, a run stopped by a fault 4,
a preemption 143 (tg_jax.cli).
"""

from __future__ import annotations

import importlib

from absl import app, flags, logging
from ml_collections import config_flags

from tg_jax import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics, reports.")
flags.mark_flags_as_required(["config", "workdir"])

# Each stage: "module:function", called as function(config, workdir).
STAGES = {
    "data": "tg_jax.train.pipeline:run_data",
    "sft": "tg_jax.train.pipeline:run_sft_stage",
    "pipeline": "tg_jax.train.pipeline:run_pipeline",
    "forward": "tg_jax.cli:run_forward",
    "eval": "tg_jax.train.eval_stage:run",
}


def main(argv: list[str]) -> None:
    del argv
    config, workdir = _CONFIG.value, _WORKDIR.value
    with cli.exit_on_error(workdir):
        from tg_jax import config_lib, preflight

        config_lib.check(config, workdir, STAGES)  # before any device or data
        cli.start_jax()
        config_lib.check_on_devices(config)
        for note in preflight.check(config):  # checkpoint shapes, engine limits, rewards
            logging.warning("preflight: %s", note)
        module, _, function = STAGES[config.stage].partition(":")
        getattr(importlib.import_module(module), function)(config, workdir)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
