"""The command line's door: flags parsed with clear errors, and the one place errors end it.

`parse_flags` is absl's flag parser for every command that takes `--config` (tg_jax.main,
tg_jax.ship_base): an override of a field the config file lacks, or a value of the wrong type,
is one `error:` line (with the field's close matches), and an override given twice is the last
one. `exit_on_error` turns what a user must act on into one `error:` line and an exit status:

  2  a bad command line or config (`errors.UsageError`, `errors.ConfigError`, a checkpoint
     directory that cannot be used, a task file that cannot be read), before any compute
  3  the base model outside its gates (`sft.require`): a measured outcome, not a crash
  4  a run stopped by a fault (`errors.RunError`, a checkpoint or sandbox fault, a workdir
     removed during the run); the message says what was kept
  143  a preemption (`checkpointing.Preempted`, a SystemExit): passed through, its work saved
"""

from __future__ import annotations

import contextlib
import logging as std_logging
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from absl import flags, logging

from tg_jax import paths
from tg_jax.errors import RunError, UsageError

USAGE_ERROR = 2  # exit status of a bad command line or config
GATE_ERROR = 3  # exit status when the base model fails its gates (sft.require)
RUN_ERROR = 4  # exit status of a run stopped by a fault (the message says what was kept)


def fail(message: str, status: int = USAGE_ERROR) -> None:
    """One line on stderr, then exit: no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(status)


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
    """absl's flag parsing (`app.run(main, flags_parser=parse_flags)`); a bad flag or config
    override is one `error:` line, exit status 2."""
    argv = [argv[0], *last_override_wins(argv[1:])]
    if (why := check_config_args(argv[1:])) is not None:
        fail(why)
    try:
        return flags.FLAGS(argv)
    except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
        fail(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)


def prepare_workdir(workdir: str) -> None:
    """Creates a local workdir; a path that is a file (or cannot be made) is a UsageError."""
    if paths.is_url(workdir):  # gs://: no directories to make; stages write through epath
        return
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise UsageError(f"--workdir {workdir} is a file")
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--workdir {workdir}: {e.strerror or e}") from None


def start_jax() -> None:
    """Quiet library logs, the persistent compilation cache, and (on a pod) the JAX cluster.

    Library INFO lines (orbax logs every checkpoint step) drown the progress lines; pass
    --verbosity=0 to see them. XLA executables persist in $TG_JAX_COMPILATION_CACHE
    (launch/local.sh sets it), so a rerun or a resumed stage skips compiles; an explicit
    JAX_COMPILATION_CACHE_DIR wins. Multi-host TPU pods (launch/tpu.sh sets
    TG_JAX_DISTRIBUTED=1) join the cluster here, before any device is used."""
    import jax

    from tg_jax.tpu import distributed

    cache = os.environ.get("TG_JAX_COMPILATION_CACHE")
    if cache and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.abspath(cache))
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    distributed.initialize_from_env()


@contextlib.contextmanager
def exit_on_error(workdir: str | None = None) -> Iterator[None]:
    """Ends the command with one `error:` line and its exit status (module docstring) where
    the body raises what a user must act on; anything else propagates with its traceback.
    With `workdir` (made here, a UsageError if it cannot be), a run whose workdir is removed
    under it exits 4 on whatever failed first, and background threads failing over the
    missing files stay quiet."""
    identity = None
    if workdir is not None:
        with exit_on_error():
            prepare_workdir(workdir)
        identity = paths.dir_identity(workdir)
        _quiet_threads_once_removed(workdir, identity)
    try:
        yield
    except Exception as e:
        if (said := _user_error(e)) is not None:
            fail(*said)
        if workdir is not None and paths.dir_removed(workdir, identity):  # what failed first
            print(
                f"error: the workdir {workdir} was removed during the run; what it held "
                "(checkpoints, metrics) went with it",
                file=sys.stderr,
            )
            # Nothing is left to save: exit now, before background writers (orbax's) fail
            # again at shutdown over the missing directory.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(RUN_ERROR)
        # A fault said in one line, also when a thread raised it (its error is the cause).
        if (fault := _first_of(e, _fault_kinds())) is None:
            raise
        fail(str(fault), RUN_ERROR)


def _user_error(e: Exception) -> tuple[str, int] | None:
    """(line, exit status) of an error a user must act on that is no fault of the run."""
    # Imported here: a usage error ends the command before these (heavy) modules load.
    from tg_jax.envs.swe.importer import TaskImportError
    from tg_jax.models.hf_dir import ModelDirError
    from tg_jax.tpu.fit import FitError
    from tg_jax.train.sft_gates import BaseModelGateError

    if isinstance(e, UsageError):  # ConfigError too: "invalid config: ..."
        return f"{e.prefix}{e}", USAGE_ERROR
    if isinstance(e, ModelDirError):  # a checkpoint directory that cannot be used
        return str(e), USAGE_ERROR
    if isinstance(e, TaskImportError):  # a user's task file: the message names file and line
        return f"cannot import tasks: {e}", USAGE_ERROR
    if isinstance(e, FitError):  # the memory figures on stderr, then the line
        first, _, figures = str(e).partition("\n")
        print(figures, file=sys.stderr)
        return first, USAGE_ERROR
    if isinstance(e, BaseModelGateError):  # a measured outcome, not a crash: no traceback
        return str(e), GATE_ERROR
    return None


def _fault_kinds() -> tuple[type, ...]:
    from tg_jax.checkpointing import CheckpointError
    from tg_jax.envs.ns_sandbox import SandboxUnavailable

    return (RunError, CheckpointError, SandboxUnavailable)


def _first_of(error: BaseException, kinds: tuple[type, ...]) -> BaseException | None:
    """`error` or the first of its causes that is one of `kinds`, else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kinds):
            return error
        seen.add(id(error))
        error = error.__cause__
    return None


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


def run_forward(config: Any, workdir: str) -> None:
    """Smoke stage: builds the sharded model and runs one forward pass."""
    del workdir
    import jax
    import jax.numpy as jnp

    from tg_jax import sharding, tracing
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
