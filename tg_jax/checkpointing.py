"""Training-state checkpoints: orbax CheckpointManager plus JSON metadata, and preemption.

One checkpoint step holds two items:

* ``state``: the training-state pytree (params, optimizer state, step, RNG key, ...), saved
  with orbax ``StandardSave`` (async by default: ``save`` returns once the arrays are copied to
  host memory, the files are written in a background thread).
* ``meta``: a JSON dict (data-iterator state, sampler policy version, anything else).

Orbax writes every step to ``<step>.orbax-checkpoint-tmp`` and renames it only after all items
are written, so a failed or interrupted save never touches the previous good checkpoint.

Restores go into an abstract target (a pytree of ``jax.ShapeDtypeStruct``, with shardings for
sharded state); the checkpoint's tree structure, shapes and dtypes are checked against it first,
and every failure is a ``CheckpointError`` naming the directory and what is wrong.

Intended loop usage (the checkpoint step is the number of completed train steps)::

    ckpt = TrainingCheckpointer(workdir / "checkpoints", max_to_keep=3, save_interval_steps=100)
    install_sigterm_handler()
    restored = ckpt.restore_latest(abstract_state)  # ShapeDtypeStructs with shardings
    if restored is None:
        state, start = init_state(rng), 0
    else:
        state, start = restored.state, restored.step
        data_iter.set_state(restored.metadata["data"])
    for step in range(start, num_steps):
        state, metrics = train_step(state, next(data_iter))
        done = step + 1
        preempted = preemption_requested(done)  # call once per step on every host
        if preempted or done == num_steps or ckpt.should_save(done):
            ckpt.save(done, state, metadata={"data": data_iter.get_state(),
                                             "policy_version": done}, force=True)
        if preempted:
            break
    ckpt.close()  # waits for the last async save; exit cleanly after this

Preemption: on one host, ``install_sigterm_handler`` turns SIGTERM into a flag that
``preemption_requested`` returns. On several hosts with ``jax.distributed`` and its preemption
service (what orbax's own preemption support builds on), ``preemption_requested(step)`` is true
at the sync step agreed by all hosts, so every host saves the same step; there the JAX runtime
owns SIGTERM and the Python handler is not installed. A job of several stages raises
``Preempted`` once a stage stopped this way, so nothing later runs on unfinished state.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import signal
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as ocm

from tg_jax import faults, paths, tracing

_STATE = "state"
_META = "meta"


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, found, read, or matched to the restore target."""


@dataclasses.dataclass(frozen=True)
class RestoredCheckpoint:
    """What a restore returns."""

    step: int
    state: Any
    metadata: dict[str, Any]


class TrainingCheckpointer:
    """Saves and restores training state + JSON metadata under one directory, keeping N steps."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = 3,
        save_interval_steps: int = 1,
        async_save: bool = True,
        read_only: bool = False,
        processes: Sequence[int] | None = None,
    ):
        """Opens (and unless read_only, creates) a checkpoint directory.

        Args:
          directory: root directory; steps live in ``directory/<step>``.
          max_to_keep: keep only the latest N complete steps (None keeps all).
          save_interval_steps: ``should_save(step)`` is true every this many steps (and at a
            multi-host preemption sync point).
          async_save: write files in a background thread.
          read_only: never write; the directory must exist.
          processes: the processes that save and restore (orbax's active processes: the
            trainer processes of the whole-host split); None = every process.
        """
        # A URL (gs://...) reaches orbax unchanged; only local paths are made absolute.
        self.directory = os.fspath(paths.as_path(directory))
        if read_only and not paths.as_path(self.directory).is_dir():
            raise CheckpointError(f"checkpoint directory {self.directory} does not exist")
        multiprocessing = {}
        if processes is not None:  # orbax creates no root directory for active processes
            if not read_only:
                paths.as_path(self.directory).mkdir(parents=True, exist_ok=True)
            multiprocessing["multiprocessing_options"] = ocp.options.MultiprocessingOptions(
                primary_host=min(processes),
                active_processes=set(processes),
                barrier_sync_key_prefix="active",
            )
        options = ocp.CheckpointManagerOptions(
            **multiprocessing,
            read_only=read_only,
            create=not read_only and processes is None,
            # Leftovers of saves that died midway would otherwise block re-saving that step.
            cleanup_tmp_directories=not read_only,
            enable_async_checkpointing=async_save,
            save_decision_policy=ocm.AnySavePolicy(
                [
                    ocm.FixedIntervalPolicy(save_interval_steps),
                    ocm.PreemptionCheckpointingPolicy(),
                ]
            ),
            preservation_policy=ocm.LatestN(n=max_to_keep),
        )
        try:
            self._manager = ocp.CheckpointManager(
                self.directory,
                # Explicit handlers so a fresh manager can read metadata before any save.
                item_handlers={
                    _STATE: ocp.StandardCheckpointHandler(),
                    _META: ocp.JsonCheckpointHandler(),
                },
                options=options,
            )
        except Exception as e:
            raise CheckpointError(f"cannot open checkpoint directory {self.directory}: {e}") from e

    # -- queries ---------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Complete (committed) steps, ascending."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete step, or None."""
        return self._manager.latest_step()

    def should_save(self, step: int) -> bool:
        """True at the save interval or a multi-host preemption sync point (not yet saved)."""
        return self._manager.should_save(step)

    # -- save ------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        *,
        metadata: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Saves ``state`` and JSON ``metadata`` as ``step``; async unless configured otherwise.

        Args:
          step: checkpoint step (by convention: completed train steps).
          state: pytree of arrays (jax or numpy), typed PRNG keys allowed.
          metadata: JSON-serialisable dict, e.g. ``{"data": iterator_state,
            "policy_version": v}``.
          force: save even if ``should_save(step)`` is false.

        Returns:
          Whether a save was started. Errors of the previous async save surface here.
        """
        metadata = dict(metadata or {})
        try:
            # Checked here, not in orbax's writer thread, so bad metadata fails before any I/O.
            json.dumps(metadata, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"metadata for step {step} in {self.directory} is not JSON-serialisable: {e}"
            ) from e
        args = ocp.args.Composite(
            **{_STATE: ocp.args.StandardSave(state), _META: ocp.args.JsonSave(metadata)}
        )
        try:
            if faults.hit("checkpoint.save"):
                raise OSError(errno.ENOSPC, "No space left on device (injected: TG_JAX_FAULTS)")
            return self._manager.save(step, args=args, force=force)
        except Exception as e:
            raise self._save_error(step, e) from e

    def wait_until_finished(self) -> None:
        """Blocks until the pending async save is committed; raises CheckpointError if it failed."""
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise self._save_error(None, e) from e

    def _save_error(self, step: int | None, e: Exception) -> CheckpointError:
        what = f"step {step}" if step is not None else "the pending save"
        if not paths.as_path(self.directory).exists():
            kept = "the checkpoint directory no longer exists (removed during the run?)"
        else:
            if step is not None:  # the save before this one may still be in flight: let it land
                try:
                    self._manager.wait_until_finished()
                except Exception:  # noqa: BLE001 (its own failure is reported by what is on disk)
                    pass
            self._manager.reload()  # the steps on disk now, not those the manager last saw
            kept = f"Earlier checkpoints are untouched; latest complete step: {self.latest_step()}"
        return CheckpointError(
            f"saving {what} to {self.directory} failed: {type(e).__name__}: {e}. {kept}"
        )

    # -- restore ---------------------------------------------------------------------------

    def restore_latest(self, abstract_state: Any) -> RestoredCheckpoint | None:
        """Restores the newest readable step into ``abstract_state``, or returns None if there
        is none. A newest step that is unreadable (a partial or corrupt write) is skipped with
        a warning for the one before it; if none is readable, the newest one's error is
        raised. A checkpoint that does not match ``abstract_state`` is an error, not skipped."""
        self.wait_until_finished()
        steps = sorted(self.all_steps(), reverse=True)
        first_error = None
        for step in steps:
            try:
                return self.restore(abstract_state, step=step)
            except CorruptCheckpointError as e:
                first_error = first_error or e
                if step == steps[-1]:  # nothing to fall back to: keep it as it is
                    break
                kept = self._set_aside(step)
                logging.warning("%s; kept as %s, falling back to the checkpoint before it", e, kept)
        if first_error is not None:
            raise first_error
        return None

    def _set_aside(self, step: int) -> str:
        """Renames an unreadable step to `<step>.corrupt` (kept for a post-mortem; no longer a
        step, so the next save of `step` can be written) and returns the new path."""
        src = paths.as_path(self.directory) / str(step)
        dst = paths.as_path(self.directory) / f"{step}.corrupt"
        if dst.exists():
            dst.rmtree()
        src.rename(dst)
        self._manager.reload()
        return os.fspath(dst)

    def restore(self, abstract_state: Any, *, step: int | None = None) -> RestoredCheckpoint:
        """Restores ``step`` (default: newest) into ``abstract_state``.

        Args:
          abstract_state: pytree of ``jax.ShapeDtypeStruct`` (or arrays) giving structure, shapes,
            dtypes and shardings; arrays are placed on those shardings.
          step: which step; None for the latest.

        Returns:
          The restored step, state and metadata dict.
        """
        self.wait_until_finished()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(
                    f"no complete checkpoint in {self.directory} (expected step subdirectories)"
                )
        elif step not in self.all_steps():
            raise CheckpointError(
                f"no checkpoint step {step} in {self.directory}; steps: {self.all_steps()}"
            )
        step_dir = os.fspath(paths.as_path(self.directory) / str(step))
        target = _abstract_target(abstract_state)
        try:
            stored = self._manager.item_metadata(step)[_STATE]
            stored_tree = stored.tree if hasattr(stored, "tree") else stored
            if stored_tree is None:
                raise ValueError("no state metadata")
        except Exception as e:
            raise _corrupt(step_dir, e) from e
        _check_matches(stored_tree, target, step_dir)
        args = ocp.args.Composite(
            **{_STATE: ocp.args.StandardRestore(target), _META: ocp.args.JsonRestore()}
        )
        try:
            restored = self._manager.restore(step, args=args)
        except Exception as e:
            raise _corrupt(step_dir, e) from e
        return RestoredCheckpoint(step, restored[_STATE], dict(restored[_META] or {}))

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for the pending save and releases orbax's threads."""
        try:
            self._manager.close()
        except Exception as e:
            raise self._save_error(None, e) from e

    def __enter__(self) -> TrainingCheckpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def restore_checkpoint(
    directory: str | os.PathLike, abstract_state: Any, *, step: int | None = None
) -> RestoredCheckpoint:
    """Restores from an explicit source (e.g. an SFT run's checkpoints), read-only.

    ``directory`` is a checkpoint root or one step directory inside it (``root/<step>``).
    """
    directory = paths.as_path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    base = directory.name
    if step is None and base.isdigit() and (directory / _STATE).is_dir():
        directory, step = directory.parent, int(base)
    ckpt = TrainingCheckpointer(directory, read_only=True)
    try:
        return ckpt.restore(abstract_state, step=step)
    finally:
        ckpt.close()


# -- target checks ---------------------------------------------------------------------------


def _abstract_target(tree: Any) -> Any:
    """ShapeDtypeStructs (keeping shardings) for any pytree of arrays or structs."""

    def leaf(x):
        sharding = getattr(x, "sharding", None)
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            x = np.asarray(x)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(leaf, tree)


def _key_str(k: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _flat(tree: Any) -> dict[str, Any]:
    # Orbax stores namedtuples/dataclasses as dicts and tuples as lists, so compare by path
    # names rather than by treedef.
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(_key_str(k) for k in path): leaf for path, leaf in leaves}


def _stored_shape_dtype(target_leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    """How a target leaf is stored: typed PRNG keys are saved as their raw key data."""
    if jax.dtypes.issubdtype(target_leaf.dtype, jax.dtypes.prng_key):
        raw = tracing.eval_shape(jax.random.key_data, target_leaf)
        return tuple(raw.shape), np.dtype(raw.dtype)
    return tuple(target_leaf.shape), np.dtype(target_leaf.dtype)


def _check_matches(stored_tree: Any, target: Any, step_dir: str) -> None:
    """Raises CheckpointError at the first leaf whose presence, shape or dtype differs."""
    stored, wanted = _flat(stored_tree), _flat(target)
    for path, leaf in wanted.items():
        if path not in stored:
            raise CheckpointError(
                f"checkpoint {step_dir} does not match the restore target: leaf '{path}' is in "
                f"the target but not in the checkpoint (checkpoint leaves: {_few(stored)})"
            )
        meta = stored[path]
        shape, dtype = _stored_shape_dtype(leaf)
        got_shape = tuple(getattr(meta, "shape", ()) or ())
        got_dtype = getattr(meta, "dtype", None)
        if got_shape != shape or (got_dtype is not None and np.dtype(got_dtype) != dtype):
            raise CheckpointError(
                f"checkpoint {step_dir} does not match the restore target at leaf '{path}': "
                f"checkpoint has shape {got_shape} dtype {got_dtype}, target wants shape "
                f"{shape} dtype {dtype}"
            )
    extra = [p for p in stored if p not in wanted]
    if extra:
        raise CheckpointError(
            f"checkpoint {step_dir} does not match the restore target: leaf '{extra[0]}' is in "
            f"the checkpoint but not in the target ({len(extra)} such leaves)"
        )


def _few(names: Iterable[str], n: int = 5) -> str:
    names = list(names)
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


class CorruptCheckpointError(CheckpointError):
    """A checkpoint step whose files cannot be read (partial or corrupt)."""


def _corrupt(step_dir: str, e: Exception) -> CheckpointError:
    return CorruptCheckpointError(
        f"checkpoint {step_dir} is unreadable (corrupt or truncated files?): "
        f"{type(e).__name__}: {e}"
    )


# -- preemption ------------------------------------------------------------------------------

_preempted = threading.Event()
PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM: what a shell reports for a SIGTERM-ended process


class Preempted(SystemExit):
    """A stage stopped early on a preemption request and the job must stop too.

    The stage's checkpoint is saved; it was not evaluated, nothing marks it finished, and no
    later stage ran. Uncaught, it ends the process with status 143 (it is a SystemExit);
    rerunning the same command resumes the stage.
    """

    def __init__(self, stage: str, workdir: str):
        self.stage, self.workdir = stage, workdir
        self.message = (
            f"preempted during {stage}: its checkpoint is in {workdir}; nothing was evaluated "
            "or marked finished. Rerun the same command to resume."
        )
        super().__init__(PREEMPTED_EXIT_CODE)

    def __str__(self) -> str:
        return self.message


def _preemption_service_active() -> bool:
    """True when jax.distributed runs with its preemption service (it then owns SIGTERM)."""
    from jax._src import distributed  # no public accessor for the preemption sync manager

    state = distributed.global_state
    return state.client is not None and state.preemption_sync_manager is not None


def install_sigterm_handler(signals: tuple[int, ...] = (signal.SIGTERM,)) -> bool:
    """Makes ``signals`` set the preemption flag instead of killing the process.

    Must be called from the main thread. A previously installed Python handler is still called.

    Returns:
      False when JAX's multi-host preemption service is active (it handles SIGTERM and
      ``preemption_requested(step)`` asks it), True when the handler was installed.
    """
    if _preemption_service_active():
        return False
    for sig in signals:
        previous = signal.getsignal(sig)
        if _is_preemption_handler(previous):
            continue  # already ours (code that replaced it since gets it installed again)

        def handler(signum, frame, previous=previous):
            logging.warning("signal %d: preemption requested; will save and exit", signum)
            _preempted.set()
            if callable(previous):
                previous(signum, frame)

        handler._tg_jax_preemption = True
        signal.signal(sig, handler)
    return True


def _is_preemption_handler(handler: Any) -> bool:
    return bool(getattr(handler, "_tg_jax_preemption", False))


def sigterm_handler_installed() -> bool:
    """Whether SIGTERM currently goes to `install_sigterm_handler`'s handler."""
    return _is_preemption_handler(signal.getsignal(signal.SIGTERM))


def request_preemption() -> None:
    """Sets the preemption flag by hand (tests, wall-clock limits, other threads)."""
    _preempted.set()


def clear_preemption_request() -> None:
    """Clears the preemption flag (tests, or after a handled preemption in a notebook)."""
    _preempted.clear()


def preemption_requested(step: int | None = None) -> bool:
    """Whether the loop should save and stop now.

    Args:
      step: the step about to be checkpointed. With jax.distributed's preemption service, every
        host must call this at every step with the same step; it is true at the agreed step.

    Returns:
      True after SIGTERM / ``request_preemption`` (single host), or at the multi-host sync point.
    """
    if _preempted.is_set():
        return True
    if step is not None and _preemption_service_active():
        from jax.experimental import multihost_utils

        try:
            return bool(multihost_utils.reached_preemption_sync_point(step))
        except RuntimeError:
            return False
    return False
