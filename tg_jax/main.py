"""Entry point: `python -m tg_jax.main --config=configs/X.py --workdir=DIR [--config.a.b=v]`.

Runs the stage named by `config.stage`:

  data      the task sets as TFDS datasets in DIR/tfds (tg_jax.train.data_stage)
  sft       SFT of the base model (resumed if unfinished, skipped if finished), then its
            held-out evaluation DIR/sft_eval.json (tg_jax.train.sft, tg_jax.train.sft_eval)
  pipeline  data -> sft -> the RL arms x seeds -> held-out evaluation -> DIR/report/
            (the main job, tg_jax.train.pipeline; every stage cached or resumed)
  forward   smoke: build the sharded model and run one forward pass

The logic lives in libraries; this file only parses flags and dispatches.
"""

from __future__ import annotations

import os

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics, reports.")
flags.mark_flags_as_required(["config", "workdir"])


def run_forward(config, workdir: str) -> None:
    """Smoke stage: builds the sharded model and runs one forward pass."""
    import jax
    import jax.numpy as jnp

    from tg_jax import sharding
    from tg_jax.models import ModelConfig, Transformer, forward

    model = Transformer(ModelConfig.from_config(config.model))
    mesh = sharding.make_mesh(config.mesh)
    rules = sharding.logical_rules(config.mesh)
    params, _ = sharding.create_sharded_params(model, jax.random.key(config.seed), mesh, rules)
    tokens = jnp.zeros((sharding.batch_divisor(mesh, rules), 16), jnp.int32)
    with sharding.activation_sharding(mesh, rules):
        logits = jax.jit(lambda p, t: forward(model, p, t))(params, tokens)
    n = sum(x.size for x in jax.tree.leaves(params))
    logging.info("forward ok: %d params, logits %s, mesh %s", n, logits.shape, dict(mesh.shape))
    print(f"forward ok: {n:,} params, logits {tuple(logits.shape)} on mesh {dict(mesh.shape)}")


def run_data(config, workdir: str) -> None:
    """Data stage: the train / held-out task datasets in DIR/tfds."""
    from tg_jax.train import pipeline

    pipeline.run_data(config, workdir)


def run_sft(config, workdir: str) -> None:
    """SFT stage: trains (or resumes, or skips) the base model, then writes sft_eval.json."""
    from tg_jax.train import pipeline

    pipeline.run_sft_stage(config, workdir)


def run_pipeline(config, workdir: str) -> None:
    """The main job: data -> sft (cached) -> RL arms x seeds -> held-out evaluation -> report."""
    from tg_jax.train import pipeline

    pipeline.run_pipeline(config, workdir)


STAGES = {"forward": run_forward, "data": run_data, "sft": run_sft, "pipeline": run_pipeline}


def main(argv):
    del argv
    from tg_jax.tpu import distributed

    # Library INFO lines (orbax logs every checkpoint step) drown the progress lines; pass
    # --verbosity=0 to see them.
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)

    # Multi-host TPU pods (launch/tpu.sh sets TG_JAX_DISTRIBUTED=1): join the JAX cluster first.
    distributed.initialize_from_env()
    config = _CONFIG.value
    workdir = _WORKDIR.value
    if "://" not in workdir:  # gs:// workdirs are handled by orbax / tensorboard, not os
        os.makedirs(workdir, exist_ok=True)
    if config.stage not in STAGES:
        raise app.UsageError(f"Unknown stage {config.stage!r}; known: {sorted(STAGES)}")
    STAGES[config.stage](config, workdir)


if __name__ == "__main__":
    app.run(main)
