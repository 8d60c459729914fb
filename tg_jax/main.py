"""Entry point: `python -m tg_jax.main --config=configs/X.py --workdir=DIR [--config.a.b=v]`.

Runs the stage named by `config.stage`:

  data      the task sets as TFDS datasets in DIR/tfds (tg_jax.data.task_data)
  sft       SFT of the base model (resumed if unfinished, skipped if finished), then its
            held-out evaluation DIR/sft_eval.json (tg_jax.train.sft, tg_jax.train.sft_eval)
  pipeline  data -> sft -> the RL arms x seeds -> held-out evaluation -> DIR/report/
            (the main job, tg_jax.train.pipeline; every stage cached or resumed)
  forward   smoke: build the sharded model and run one forward pass

The logic lives in libraries; this file only parses flags and dispatches. A bad command line
(unknown config field, a value of the wrong type, a workdir that is a file, an unknown stage)
prints one `error: ...` line to stderr and exits with status 2, before any training.
"""

from __future__ import annotations

import logging as std_logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

from absl import app, flags, logging
from ml_collections import config_flags

from tg_jax import paths, tracing

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics, reports.")
flags.mark_flags_as_required(["config", "workdir"])


def run_forward(config, workdir: str) -> None:
    """Smoke stage: builds the sharded model and runs one forward pass."""
    import jax
    import jax.numpy as jnp

    from tg_jax import sharding
    from tg_jax.models import ModelConfig, Transformer, forward, hf_dir

    mesh = sharding.make_mesh(config.mesh, sharding.split_devices(config)[0])  # the trainer's
    rules = sharding.logical_rules(config.mesh)
    if config.model.hf_checkpoint:  # the checkpoint's architecture and weights
        md = hf_dir.open_model_dir(config.model.hf_checkpoint, tool_format=config.model.tool_format)
        config = hf_dir.resolve_config(config, md)
        model = Transformer(ModelConfig.from_config(config.model))
        params = md.load_params(model.config, mesh=mesh, rules=rules)
    else:
        model = Transformer(ModelConfig.from_config(config.model))
        params, _ = sharding.create_sharded_params(model, jax.random.key(config.seed), mesh, rules)
    tokens = jnp.zeros((sharding.batch_divisor(mesh, rules), 16), jnp.int32)
    with sharding.activation_sharding(mesh, rules):
        logits = tracing.jit(lambda p, t: forward(model, p, t))(params, tokens)
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

    if config.model.hf_checkpoint:
        _fail("the sft stage trains the embedded default from scratch; a model.hf_checkpoint "
              "run starts RL from the checkpoint (--config.stage=pipeline)")  # fmt: skip

    pipeline.run_sft_stage(config, workdir)


def run_pipeline(config, workdir: str) -> None:
    """The main job: data -> sft (cached) -> RL arms x seeds -> held-out evaluation -> report."""
    from tg_jax.train import pipeline

    pipeline.run_pipeline(config, workdir)


STAGES = {"forward": run_forward, "data": run_data, "sft": run_sft, "pipeline": run_pipeline}
USAGE_ERROR = 2  # exit status of a bad command line
GATE_ERROR = 3  # exit status when the base model fails its gates (sft.require)
RUN_ERROR = 4  # exit status of a run stopped by a fault (the message says what was kept)


def _fail(message: str) -> None:
    """One line on stderr, exit status 2: a usage error, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(USAGE_ERROR)


def _config_overrides(args: Sequence[str]) -> tuple[str | None, list[tuple[str, str | None]]]:
    """(--config value, [(dotted key, text or None)]) of `--config.a.b=v` style arguments."""
    path, overrides = None, []
    for i, arg in enumerate(args):
        name, eq, text = arg.partition("=")
        nxt = args[i + 1] if i + 1 < len(args) else None
        if name in ("--config", "-config"):
            path = text if eq else nxt
        for prefix in ("--config.", "--noconfig."):
            if name.startswith(prefix):
                overrides.append((name[len(prefix) :], text if eq else None))
    return path, overrides


def check_config_args(args: Sequence[str]) -> str | None:
    """Why the `--config.*` overrides in `args` cannot apply to the config file, or None."""
    from tg_jax import config_files

    path, overrides = _config_overrides(args)
    if path is None or not overrides:
        return None  # absl reports a missing --config itself
    file, _, arg = path.partition(":")
    try:
        cfg = config_files.load_config_file(file, arg or None)
    except Exception as e:  # noqa: BLE001  (any failure of the user's config file)
        return f"--config={path}: {type(e).__name__}: {e}"
    for key, text in overrides:
        if (why := config_files.unknown_field(cfg, key)) is not None:
            return why
        if text is not None and (why := config_files.parse_error(cfg, key, text)) is not None:
            return f"--config.{key}: {why}"
    return None


def last_override_wins(args: Sequence[str]) -> list[str]:
    """`args` with each `--config.KEY=VALUE` given more than once kept only where it is given
    last, as for any other flag (ml_collections' tuple fields would otherwise join the
    repeated values: `shape=(1,4) ... shape=(1,2)` became `(1, 4, 1, 2)`)."""
    seen, keep = set(), []
    for arg in reversed(args):  # the last of each key is met first
        name, eq, _ = arg.partition("=")
        if eq and name.startswith("--config."):
            if name in seen:
                continue
            seen.add(name)
        keep.append(arg)
    return keep[::-1]


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with bad config overrides reported by `_fail` (one line)."""
    argv = [argv[0], *last_override_wins(argv[1:])]
    if (why := check_config_args(argv[1:])) is not None:
        _fail(why)
    try:
        return flags.FLAGS(argv)
    except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
        _fail(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)


def check_workdir(workdir: str) -> None:
    """Creates a local workdir; a path that is a file (or cannot be made) is a usage error."""
    if paths.is_url(workdir):  # gs://: no directories to make; stages write through epath
        return
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        _fail(f"--workdir {workdir} is a file")
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        _fail(f"--workdir {workdir}: {e.strerror or e}")


def use_compilation_cache() -> None:
    """XLA executables persist in $TG_JAX_COMPILATION_CACHE (launch/local.sh sets it), so a rerun
    or a resumed stage skips compiles; an explicit JAX_COMPILATION_CACHE_DIR wins."""
    import jax

    cache = os.environ.get("TG_JAX_COMPILATION_CACHE")
    if cache and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.abspath(cache))


def main(argv):
    del argv
    config = _CONFIG.value
    workdir = _WORKDIR.value
    check_workdir(workdir)
    _check_config(config, workdir)
    from tg_jax.tpu import distributed

    use_compilation_cache()
    # Library INFO lines (orbax logs every checkpoint step) drown the progress lines; pass
    # --verbosity=0 to see them.
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)

    # Multi-host TPU pods (launch/tpu.sh sets TG_JAX_DISTRIBUTED=1): join the JAX cluster first.
    distributed.initialize_from_env()
    _check_config_on_devices(config)
    _preflight(config)
    _run_stage(config, workdir)


def _preflight(config) -> None:
    """The run against its checkpoint's shapes, the engine's limits and the reward weights
    (`tg_jax.preflight`): one `error:` line before any stage; the notes (dimensions
    replicated) logged."""
    from tg_jax import preflight
    from tg_jax.errors import ConfigError

    try:
        notes = preflight.check(config)
    except ConfigError as e:
        _fail(f"invalid config: {e}")
    for note in notes:
        logging.warning("preflight: %s", note)


def _check_config(config, workdir: str) -> None:
    """What the config (and the registry it names) decides, before any device or data: one
    `error:` line each."""
    if config.stage not in STAGES:
        _fail(f"unknown stage {config.stage!r} (known: {', '.join(sorted(STAGES))})")
    if "env" in config:
        from tg_jax.envs import env_kind, requirement_names

        try:  # the environment and its requirements, plug-ins loaded and checked
            env_kind(config.env)
            requirement_names(config.env)
            if "rl_loop" in config and int(config.rl_loop.eval_every) > 0:
                from tg_jax.data.task_data import check_dev_tasks

                check_dev_tasks(config, "the periodic evaluation (rl_loop.eval_every)",
                                "; set rl_loop.eval_every=0 or give it one")  # fmt: skip
            if "tasks" in config and config.tasks.get("dev_source"):
                from tg_jax.data.task_data import check_dev_source

                check_dev_source(config)
        except ValueError as e:
            _fail(f"invalid config: {e}")
    from tg_jax.evaluation.report_settings import EvalConfig
    from tg_jax.mesh_settings import MeshConfig, SamplerMeshConfig
    from tg_jax.train.loop_settings import LoopConfig, PipelineConfig
    from tg_jax.train.sft_settings import SftConfig

    sections = {"rl_loop": LoopConfig, "pipeline": PipelineConfig, "mesh": MeshConfig,
                "sampler_mesh": SamplerMeshConfig, "eval": EvalConfig,
                "sft": SftConfig}  # fmt: skip
    try:  # sections declared as dataclasses (unknown fields, bad values); hint kinds
        for name, section in sections.items():
            if name in config:
                section.from_config(config[name])
        if "rl_loop" in config:
            _check_loop(config)
    except ValueError as e:
        _fail(f"invalid config: {e}")
    if all(name in config for name in ("rl", "tg", "optim")):
        from tg_jax.rl.step_config import StepConfig

        try:  # the train step's sections, checked now rather than after data and SFT
            StepConfig.from_config(config)
        except ValueError as e:
            _fail(f"invalid config: {e}")
    if "sft" in config and "require" in config.sft:
        from tg_jax.train.sft_gates import check_require_config

        try:  # gates no base model can meet, before data and SFT
            check_require_config(config)
        except ValueError as e:
            _fail(f"invalid config: {e}")
    if config.stage == "pipeline" and "pipeline" in config:
        from tg_jax.train import tuning

        try:  # learning-rate trials that cannot run, before data and SFT
            tuning.check_tune_config(config)
        except ValueError as e:
            _fail(f"invalid config: {e}")
    if config.stage == "pipeline" and "eval" in config:  # a registered hypothesis: attempts
        from tg_jax.errors import ConfigError
        from tg_jax.evaluation import registry

        try:
            registry.check(config.eval, workdir)
        except ConfigError as e:
            _fail(f"invalid config: {e}")
    from tg_jax import faults

    try:  # a malformed fault plan fails here, not in a worker thread at its first use
        faults.validate()
    except ValueError as e:
        _fail(str(e))


def _check_loop(config) -> None:
    """ValueError where the RL loop's settings cannot run: hint kinds, a wrong judge's rates,
    router replay on an engine without it, thinking controls (each arm's)."""
    from tg_jax.rl import hidden_thinking
    from tg_jax.sampling.agent_loop import router_replay
    from tg_jax.train import rl_rollouts

    rl_rollouts.feedback_rates(config.rl_loop.feedback)
    rl_rollouts.verdict_noise(config.rl_loop.feedback)
    for _, c in _run_configs(config):  # a pipeline's arms may turn them on
        router_replay(c)  # vLLM records no routing to replay; nor does a turn in two parts
        hidden_thinking.check_config(c)


def _check_config_on_devices(config) -> None:
    """What needs the devices or the files the config names: the sampler's split, the epochs
    of generated tasks, the checkpoint directory or the shipped base."""
    from tg_jax.errors import ConfigError

    if "sampler_mesh" in config:  # the devices now known: a split that cannot be built
        from tg_jax import sharding
        from tg_jax.sampling.rollout import RolloutConfig

        try:
            sharding.split_devices(config)
            RolloutConfig(max_rows=int(config.sampler_mesh.get("max_rows", 0)))
        except ValueError as e:
            _fail(f"invalid config: {e}")
    if "rl_loop" in config and "tasks" in config and not config.tasks.get("train_source"):
        from tg_jax.data.task_data import check_epochs

        try:  # generated tasks: their count is the config's (a task file's: once read)
            check_epochs(config.rl_loop, int(config.tasks.num_train))
        except ConfigError as e:
            _fail(f"invalid config: {e}")
    if "model" in config and config.model.get("hf_checkpoint") and config.stage != "data":
        _check_model_dir(config)
    elif config.stage in ("pipeline", "sft") and "sft" in config:  # shipped bases: there, right
        from tg_jax.train import shipped_base

        try:
            if config.stage == "pipeline" and shipped_base.source(config) == "shipped":
                shipped_base.check(config)
            else:  # SFT trains the base: from sft.init's weights when set
                shipped_base.sft_init(config)
        except ConfigError as e:
            _fail(f"invalid config: {e}")
    _check_fit(config)


def _check_fit(config) -> None:
    """On a TPU backend (and `rl_loop.check_fit`): the RL programs' memory against the chips'
    (`tg_jax.tpu.fit`); the figures on stderr, then one error line if they do not fit."""
    import jax

    lc = config.get("rl_loop") if config.stage == "pipeline" else None
    if lc is None or jax.default_backend() != "tpu" or not lc.get("check_fit", True):
        return
    from tg_jax.tpu import fit

    try:
        lines = fit.check(config)
    except fit.FitError as e:
        first, _, figures = str(e).partition("\n")
        print(figures, file=sys.stderr)
        _fail(first)
    logging.warning("fit check:\n%s", "\n".join(lines))


def _run_stage(config, workdir: str) -> None:
    """Runs the stage; what a user must act on ends in one `error:` line, not a traceback."""
    from tg_jax.checkpointing import CheckpointError
    from tg_jax.envs.ns_sandbox import SandboxUnavailable
    from tg_jax.envs.swe.importer import TaskImportError
    from tg_jax.errors import ConfigError, RunError
    from tg_jax.models.hf_dir import ModelDirError
    from tg_jax.train.sft_gates import BaseModelGateError

    identity = paths.dir_identity(workdir)
    _quiet_threads_once_removed(workdir, identity)
    try:
        STAGES[config.stage](config, workdir)
    except ModelDirError as e:  # a checkpoint directory that cannot be used
        _fail(str(e))
    except TaskImportError as e:  # a user's task file: the message names the file and line
        _fail(f"cannot import tasks: {e}")
    except ConfigError as e:  # found once the data is known
        _fail(f"invalid config: {e}")
    except BaseModelGateError as e:  # a measured outcome, not a crash: no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(GATE_ERROR)
    except Exception as e:
        if paths.dir_removed(workdir, identity):  # whatever failed first
            print(f"error: the workdir {workdir} was removed during the run; what it held "
                  "(checkpoints, metrics) went with it", file=sys.stderr)  # fmt: skip
            # Nothing is left to save: exit now, before background writers (orbax's) fail
            # again at shutdown over the missing directory.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(RUN_ERROR)
        # A fault said in one line, also when a thread raised it (its error is the cause).
        fault = _first_of(e, (RunError, CheckpointError, SandboxUnavailable))
        if fault is None:
            raise
        print(f"error: {fault}", file=sys.stderr)
        sys.exit(RUN_ERROR)


def _check_model_dir(config) -> None:
    """The checkpoint directory opens (its chat template serves a rollout), and the config asks
    nothing of the model it lacks: distilling thinking needs a template with thinking."""
    from tg_jax.models import hf_dir

    try:
        md = hf_dir.open_model_dir(
            config.model.hf_checkpoint, tool_format=config.model.get("tool_format", "")
        )
    except hf_dir.ModelDirError as e:
        _fail(str(e))
    if md.renderer.has_thinking:
        return
    no_thinking = (f"the chat template of {config.model.hf_checkpoint} renders no thinking (it "
                   "drops reasoning_content)")  # fmt: skip
    for what, c in _run_configs(config):
        if "tg" in c and c.tg.get("enabled") and c.tg.get("include_thinking"):
            _fail(
                f"invalid config: tg.include_thinking is True in {what}, but {no_thinking}: "
                "there are no thinking tokens to distil; set tg.include_thinking=False"
            )
        if "rl_loop" in c and c.rl_loop.get("hide_thinking"):
            _fail(
                f"invalid config: rl_loop.hide_thinking is True in {what}, but {no_thinking}: "
                "there is no thinking to hide; set rl_loop.hide_thinking=False"
            )
        if "rl_loop" in c and c.rl_loop.get("think_budget"):
            _fail(
                f"invalid config: rl_loop.think_budget is set in {what}, but {no_thinking}: "
                "there is no thinking to budget; set rl_loop.think_budget=0"
            )


def _run_configs(config) -> list[tuple[str, Any]]:
    """(name, config) of what the run trains: the config, or each arm of a pipeline."""
    from tg_jax.train import pipeline

    if config.stage == "pipeline" and "pipeline" in config:
        return [(f"arm {a!r}", pipeline.arm_config(config, a)) for a in config.pipeline.arms]
    return [("the config", config)]


def _quiet_threads_once_removed(workdir: str, identity: tuple[int, int] | None) -> None:
    """Once the workdir is removed, background threads (orbax's async checkpoint writers) that
    fail over the missing files print and log nothing (thread exceptions, unraisable
    exceptions, log records): the command's one error line says what happened. Until then
    every one of them is printed as before."""
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if not paths.dir_removed(workdir, identity):
            previous(args)

    threading.excepthook = hook
    previous_unraisable = sys.unraisablehook  # e.g. their event loops' __del__ at teardown

    def unraisable(args: Any) -> None:
        if not paths.dir_removed(workdir, identity):
            previous_unraisable(args)

    sys.unraisablehook = unraisable
    removed = _RemovedFilter(workdir, identity)
    for handler in [*std_logging.getLogger().handlers, logging.get_absl_handler()]:
        handler.addFilter(removed)


class _RemovedFilter(std_logging.Filter):
    """Drops every log record once the workdir is removed (see _quiet_threads_once_removed)."""

    def __init__(self, workdir: str, identity: tuple[int, int] | None):
        super().__init__()
        self.workdir, self.identity = workdir, identity

    def filter(self, record: std_logging.LogRecord) -> bool:
        return not paths.dir_removed(self.workdir, self.identity)


def _first_of(error: BaseException, kinds: tuple[type, ...]) -> BaseException | None:
    """`error` or the first of its causes that is one of `kinds`, else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kinds):
            return error
        seen.add(id(error))
        error = error.__cause__
    return None


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
