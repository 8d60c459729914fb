"""Entry point: `python -m tg_jax.main --config=configs/X.py --workdir=DIR [--config.a.b=v]`.

Runs the stage named by `config.stage`:

  data      the task sets as TFDS datasets in DIR/tfds (tg_jax.train.data_stage)
  sft       SFT of the base model (resumed if unfinished, skipped if finished), then its
            held-out evaluation DIR/sft_eval.json (tg_jax.train.sft, tg_jax.train.sft_eval)
  pipeline  data -> sft -> the RL arms -> held-out evaluation -> report (the main job)
  forward   smoke: build the sharded model and run one forward pass

The logic lives in libraries; this file only parses flags and dispatches.
"""

from __future__ import annotations

import json
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


def run_data(config, workdir: str) -> dict:
    """Data stage: writes (or reuses) the train / held-out task datasets."""
    from tg_jax.train import data_stage

    sources = data_stage.prepare_tasks(config, workdir)
    sizes = {split: len(src) for split, src in sources.items()}
    print(f"data: {sizes} tasks in {os.path.join(workdir, data_stage.TFDS_DIR)}")
    return sources


def run_sft(config, workdir: str, sources: dict | None = None) -> None:
    """SFT stage: trains or resumes the base model, then evaluates it once (sft_eval.json)."""
    from tg_jax.train import data_stage, sft, sft_eval

    state = sft.run_sft(config, workdir)
    if os.path.exists(os.path.join(workdir, sft_eval.EVAL_FILE)):
        print(f"sft: finished checkpoint and {sft_eval.EVAL_FILE} found in {workdir}")
        return
    sources = sources if sources is not None else data_stage.prepare_tasks(config, workdir)
    tasks = data_stage.load_tasks(sources, "heldout", config.sft.eval.num_tasks)
    result = sft_eval.write_sft_eval(config, workdir, state.params, tasks)
    headline = {k: v for k, v in result.items() if not isinstance(v, dict | list)}
    print("sft_eval:", json.dumps(headline, indent=1))


def run_pipeline(config, workdir: str) -> None:
    """The main job: data -> sft (cached) -> RL arms -> held-out evaluation -> report."""
    sources = run_data(config, workdir)
    run_sft(config, workdir, sources)
    # The RL loop, its evaluation and the report are being written (tg_jax/train/rl.py,
    # tg_jax/evaluation/, tg_jax/report.py): wire them here when they exist.
    try:
        from tg_jax.train import rl  # noqa: F401
    except ImportError as e:
        raise NotImplementedError(
            "pipeline: data and SFT are done, but the RL stage (tg_jax.train.rl.run_rl), its "
            "held-out evaluation and the report are not available yet"
        ) from e
    raise NotImplementedError("pipeline: the RL arms, evaluation and report are not wired yet")


STAGES = {"forward": run_forward, "data": run_data, "sft": run_sft, "pipeline": run_pipeline}


def main(argv):
    del argv
    config = _CONFIG.value
    workdir = _WORKDIR.value
    os.makedirs(workdir, exist_ok=True)
    if config.stage not in STAGES:
        raise app.UsageError(f"Unknown stage {config.stage!r}; known: {sorted(STAGES)}")
    STAGES[config.stage](config, workdir)


if __name__ == "__main__":
    app.run(main)
