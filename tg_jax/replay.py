"""Re-scores a dumped RL step under a checkpoint, without sampling.

    python -m tg_jax.replay --dump=W/runs/tg_seed0/rollouts/step_3.array_record \\
        --checkpoint=W/runs/tg_seed0/checkpoints

A run with `rl_loop.dump_rollouts` writes each step's batch and its config
(`tg_jax.train.rollout_dump`). The replay runs that step's train step on that batch, under the
params the checkpoint gives for the policy before the step, and reads:
  * the step's metrics as the trainer computes them (loss, pg_loss, tg_kl, grad_norm,
    logprob_mismatch_mean, ...): the same jitted train step (`make_train_step`), its update
    thrown away; beside them the metrics the run logged for that step (metrics.jsonl), each
    with its absolute difference;
  * per token: the student's log-prob of each target, its entropy, the divergence D_t to the
    hinted teacher on the TG mask M (0 elsewhere, and without TG), with the dump's tokens,
    behaviour log-probs and masks, in
    <dump stem>.replay.npz (B x T, the batch's rows and positions).

--checkpoint is either the run's training checkpoints (<run>/checkpoints: the state saved after
step N-1 is restored, optimizer and step counter included, so the replay is the trainer's
step; step N-1 must be among the kept ones), or a checkpoint directory of params (a Hugging
Face export: W/base_model is the policy before step 1, <run>/export/step_<K> the one before
step K+1): the step counter is set to N-1 and the optimizer state is fresh, so the loss terms
and log-probs are the trainer's but grad-based update figures are not (`lr` counts updates).
A run that needs the frozen reference (rl.kl_coef > 0, tg.teacher_params "reference") takes
it from --reference (default: W/base_model of the run's workdir, its starting policy).

Prints one line per figure; writes <dump stem>.replay.json (figures, logged figures,
differences) beside the npz. A dump or checkpoint that cannot be read is one `error:` line,
exit 2. One process, local paths (copy a gs:// run's rollouts/ and checkpoints/ first); the
run's mesh is made on this machine's devices, so another device count gives the same figures
to fp32 rounding.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np
from absl import app, flags

from tg_jax import cli, paths
from tg_jax.errors import UsageError

_DUMP = flags.DEFINE_string("dump", None, "A step's dump file (<run>/rollouts/step_<N>...).")
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", None, "<run>/checkpoints, or a params directory (an export, W/base_model)."
)
_REFERENCE = flags.DEFINE_string(
    "reference", None, "Frozen reference params directory (default: W/base_model)."
)
flags.mark_flags_as_required(["dump", "checkpoint"])

# The per-token arrays of the npz besides the replayed ones: the dump's own.
BATCH_ARRAYS = ("tokens_BxT", "behaviour_logprobs_BxT", "loss_mask_BxT", "tg_mask_BxT", "valid_B")


def step_of(dump: str) -> int:
    """N of a dump file step_<N>.array_record."""
    m = re.fullmatch(r"step_(\d+)\.array_record", os.path.basename(os.fspath(dump)))
    if m is None:
        raise UsageError(f"--dump {dump}: not a step's dump file (<run>/rollouts/step_<N>...)")
    return int(m.group(1))


def _run_dir(dump: str) -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(dump)))


def logged_metrics(dump: str, step: int) -> dict[str, float]:
    """The train metrics the run logged for `step` ({} when its metrics.jsonl has none)."""
    from tg_jax.metrics import METRICS_FILE  # noqa: PLC0415

    path = os.path.join(_run_dir(dump), METRICS_FILE)
    if not os.path.exists(path):
        return {}
    found = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("stage") == "train" and rec.get("step") == step:
                found = rec  # a resumed run may log a step again: the last is kept
    return {k: v for k, v in found.items() if isinstance(v, float | int) and k not in ("step",)}


class _Setup:
    """The run's model, mesh and jitted train step, from the dump's config."""

    def __init__(self, config: Any):
        from tg_jax import sharding  # noqa: PLC0415
        from tg_jax.models.qwen3 import ModelConfig, Transformer  # noqa: PLC0415
        from tg_jax.rl.step_config import StepConfig  # noqa: PLC0415
        from tg_jax.rl.train_step import make_train_step  # noqa: PLC0415

        self.config = config
        self.step_config = StepConfig.from_config(config)
        self.model_cfg = ModelConfig.from_config(config.model)
        self.model = Transformer(self.model_cfg)
        trainer_devices, _ = sharding.split_devices(config)
        self.mesh = sharding.make_mesh(config.mesh, trainer_devices)
        self.rules = sharding.logical_rules(config.mesh)
        self.step_fn = make_train_step(config, self.model, self.mesh, self.rules)

    def fresh_state(self, params: Any, step: int) -> Any:
        import jax  # noqa: PLC0415

        from tg_jax.rl.train_state import create_train_state, make_optimizer  # noqa: PLC0415

        state = create_train_state(
            self.model,
            make_optimizer(self.config.optim),
            self.mesh,
            self.rules,
            jax.random.key(0),
            params=params,
        )
        return state.replace(step=jax.device_put(np.int32(step), state.step.sharding))

    def load_params(self, directory: str) -> Any:
        """The params of a checkpoint directory (config.json and safetensors; no tokenizer
        needed)."""
        from tg_jax.models import checkpoint_io, hf_dir  # noqa: PLC0415

        local = hf_dir.stage_locally(directory)
        params, _ = checkpoint_io.load_hf_checkpoint(
            local, self.model_cfg, mesh=self.mesh, rules=self.rules
        )
        return params

    def restore(self, directory: str, step: int) -> Any:
        """The training state saved after `step` in a run's checkpoints directory."""
        from tg_jax import checkpointing  # noqa: PLC0415
        from tg_jax.rl.train_state import abstract_train_state, make_optimizer  # noqa: PLC0415

        optimizer = make_optimizer(self.config.optim)
        abstract = abstract_train_state(self.model, optimizer, self.mesh, self.rules)
        reader = checkpointing.TrainingCheckpointer(directory, read_only=True, async_save=False)
        try:
            kept = sorted(reader.all_steps())
            if step not in kept:
                raise UsageError(
                    f"--checkpoint {directory}: no checkpoint of step {step} (the state before "
                    f"the dumped step); kept: {kept or 'none'}. Pass a params directory instead "
                    "(W/base_model before step 1, <run>/export/step_<K> before step K+1)"
                )
            return reader.restore(abstract, step=step).state
        finally:
            reader.close()


def _initial_state(setup: _Setup, checkpoint: str, before: int) -> tuple[Any, str]:
    from tg_jax.models import hf_dir  # noqa: PLC0415

    if not os.path.isdir(checkpoint) and not paths.is_url(checkpoint):
        raise UsageError(f"--checkpoint {checkpoint}: not a directory")
    if paths.as_path(checkpoint).joinpath(hf_dir.CONFIG_FILE).exists():
        params = setup.load_params(checkpoint)
        return setup.fresh_state(params, before), "params (optimizer state fresh)"
    return setup.restore(checkpoint, before), f"training state of step {before}"


def token_arrays(setup: _Setup, params: Any, batch: Any, teacher_params: Any) -> dict:
    """Per-token student log-prob, entropy and divergence D_t of the whole batch (its rows and
    positions), computed per micro-batch as the train step does (teacher rows are local to
    their micro-batch)."""
    import flax.linen as nn  # noqa: PLC0415
    import jax  # noqa: PLC0415

    from tg_jax import multihost, sharding, tracing  # noqa: PLC0415
    from tg_jax.rl.batch import join_rows, split_batch  # noqa: PLC0415
    from tg_jax.rl.loss import token_stats  # noqa: PLC0415

    rl_cfg, tg_cfg = setup.step_config.rl, setup.step_config.tg

    def fn(p, b, tp):
        with nn.logical_axis_rules(setup.rules):
            stats, _ = token_stats(
                p, b, model=setup.model, rl_cfg=rl_cfg, tg_cfg=tg_cfg, teacher_params=tp
            )
        div = stats.divergence_BxT
        return stats.logprob_BxT, stats.entropy_BxT, (stats.logprob_BxT * 0 if div is None else div)

    jitted = tracing.jit(fn)
    num = rl_cfg.num_chunks
    data = sharding.data_sharding(setup.mesh, setup.rules, ndim=1)
    outs = []
    with jax.set_mesh(setup.mesh):
        for micro in split_batch(batch, num):
            outs.append(
                [
                    np.asarray(x)
                    for x in jitted(params, multihost.host_to_global(micro, data), teacher_params)
                ]
            )
    names = ("logprob_BxT", "entropy_BxT", "divergence_BxT")
    out = {name: join_rows([o[k] for o in outs]) for k, name in enumerate(names)}
    # D_t where the TG term reads it (M), 0 elsewhere (computed there, but in no loss).
    out["divergence_BxT"] = np.where(np.asarray(batch.tg_mask_BxT), out["divergence_BxT"], 0.0)
    return out


def replay(dump: str, checkpoint: str, reference: str | None = None) -> dict[str, Any]:
    """The module docstring's replay; returns {"step", "checkpoint", "state", "metrics",
    "logged", "abs_diff", "npz", "json"} and writes the npz and JSON beside the dump."""
    import jax  # noqa: PLC0415

    from tg_jax import multihost, sharding  # noqa: PLC0415
    from tg_jax.rl.loss import reference_teacher_params  # noqa: PLC0415
    from tg_jax.train import rollout_dump  # noqa: PLC0415

    step = step_of(dump)
    try:
        config = rollout_dump.read_run_config(dump)
        batch = rollout_dump.read_batch(dump)
    except (OSError, ValueError, SyntaxError) as e:
        raise UsageError(
            f"--dump {dump}: cannot read the step's batch or the run's config ({e}); a dump "
            f"written with rl_loop.dump_rollouts has {rollout_dump.BATCH_SUFFIX} and "
            f"{rollout_dump.CONFIG_FILE} beside it"
        ) from None
    setup = _Setup(config)
    state, source = _initial_state(setup, checkpoint, step - 1)
    ref_params = None
    if setup.step_config.needs_reference:
        workdir = os.path.dirname(os.path.dirname(_run_dir(dump)))  # W of W/runs/<run>
        ref_params = setup.load_params(reference or os.path.join(workdir, "base_model"))
    params = jax.tree.map(lambda x: x.copy(), state.params)  # the step donates the state
    tokens = token_arrays(
        setup, params, batch, reference_teacher_params(setup.step_config.tg, ref_params)
    )
    placed = multihost.host_to_global(batch, sharding.data_sharding(setup.mesh, setup.rules, 1))
    args = (state, placed) if ref_params is None else (state, placed, ref_params)
    _, metrics = setup.step_fn(*args)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    logged = logged_metrics(dump, step)
    diffs = {k: abs(metrics[k] - float(logged[k])) for k in metrics if k in logged}
    out = {
        "step": step,
        "checkpoint": checkpoint,
        "state": source,
        "metrics": metrics,
        "logged": {k: logged[k] for k in diffs},
        "abs_diff": diffs,
        "npz": rollout_dump.beside(dump, rollout_dump.REPLAY_SUFFIXES[0]),
        "json": rollout_dump.beside(dump, rollout_dump.REPLAY_SUFFIXES[1]),
    }
    if multihost.is_primary():
        host = {k: np.asarray(getattr(batch, k)) for k in BATCH_ARRAYS}
        np.savez_compressed(out["npz"], **tokens, **host)
        paths.write_json_atomic(out["json"], out, indent=1, sort_keys=True)
    return out


def _print(out: dict[str, Any]) -> None:
    print(f"replay of step {out['step']} under {out['checkpoint']} ({out['state']})")
    for k in sorted(out["metrics"]):
        line = f"  {k:28s} {out['metrics'][k]: .6g}"
        if k in out["logged"]:
            line += f"   logged {out['logged'][k]: .6g}   |diff| {out['abs_diff'][k]:.2g}"
        print(line)
    print(f"per token: {out['npz']}; figures: {out['json']}")


def main(argv: list[str]) -> None:
    del argv
    with cli.exit_on_error():
        cli.start_jax()
        _print(replay(_DUMP.value, _CHECKPOINT.value, _REFERENCE.value))


if __name__ == "__main__":
    app.run(main)
