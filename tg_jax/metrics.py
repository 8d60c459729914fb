"""Metrics logging: JSONL (always), TensorBoard (tensorboardX), wandb (only when configured).

Every ``MetricsWriter.write`` appends one JSON line ``{"step", "stage", "time", <metrics>}`` to
``workdir/metrics.jsonl``; ``read_metrics`` reads it back (notebooks, reports, tests).
TensorBoard event files go to ``workdir/tb/<stage>`` so stages (train, eval, ...) show as runs.

Train steps return device arrays; fetching them right away would block until the step finishes
and leave the accelerator idle while Python logs. ``LaggedMetrics`` fetches step N's metrics
only after step N+1 has been dispatched::

    lagged = LaggedMetrics(writer, stage="train")
    for step in range(start, num_steps):
        state, metrics = train_step(state, batch)   # dispatched, not finished
        logged = lagged.push(step + 1, metrics)    # writes step `step`'s metrics (if any)
        progress.update(step + 1, logged[1] if logged else None)
    lagged.flush()
    writer.close()

After a resume, steps already in ``metrics.jsonl`` are logged again from the checkpoint step on;
readers that need one value per step should keep the last line for each (stage, step).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from tg_jax import paths

METRICS_FILE = "metrics.jsonl"
_RESERVED = ("step", "stage", "time")


def flatten_metrics(metrics: Any) -> dict[str, Any]:
    """Names every leaf of a metrics pytree (dict, dataclass, flax struct) by its path."""
    if isinstance(metrics, Mapping) and all(
        not isinstance(v, Mapping) and not hasattr(v, "__dataclass_fields__")
        for v in metrics.values()
    ):
        return {str(k): v for k, v in metrics.items()}
    leaves, _ = jax.tree_util.tree_flatten_with_path(metrics)
    out = {}
    for path, leaf in leaves:
        names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        out["/".join(names)] = leaf
    return out


def to_scalar(name: str, value: Any) -> float | int:
    """A host Python number from a scalar (Python, numpy or jax; blocks on jax arrays)."""
    if isinstance(value, bool | np.bool_):
        return int(value)
    if isinstance(value, int | float):
        return value
    arr = np.asarray(jax.device_get(value))
    if arr.size != 1:
        raise ValueError(f"metric {name!r} is not a scalar: shape {arr.shape}")
    item = arr.reshape(()).item()
    if isinstance(item, bool):
        return int(item)
    if not isinstance(item, int | float):
        raise TypeError(f"metric {name!r} is not a number: {type(item).__name__}")
    return item


class MetricsWriter:
    """Writes scalar metrics to JSONL, TensorBoard and optionally wandb."""

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        use_tensorboard: bool = True,
        wandb_config: Mapping[str, Any] | None = None,
        enabled: bool | None = None,
    ):
        """Opens ``workdir/metrics.jsonl`` for appending.

        Args:
          workdir: run directory (created if missing).
          use_tensorboard: also write TensorBoard event files to ``workdir/tb/<stage>``.
          wandb_config: keyword arguments for ``wandb.init`` (e.g. project, name, config);
            None disables wandb. wandb is imported only here, and only then.
          enabled: whether this process writes; default: only JAX process 0 writes.
        """
        self.workdir = os.fspath(paths.as_path(workdir))
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self._use_tensorboard = use_tensorboard
        self._tb: dict[str, Any] = {}
        self._wandb_run = None
        self._file = None
        if not self.enabled:
            return
        path = paths.as_path(self.workdir) / METRICS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = _ObjectFile(path) if paths.is_url(path) else path.open("a")
        if wandb_config is not None:
            try:
                import wandb
            except ImportError as e:
                raise ImportError(
                    "wandb_config was given but wandb is not installed: pip install "
                    "'tg_jax[wandb]', or pass wandb_config=None"
                ) from e
            self._wandb_run = wandb.init(**dict(wandb_config))

    def write(self, step: int, metrics: Any, *, stage: str = "train") -> dict[str, Any]:
        """Logs a dict (or pytree) of scalars for ``step``; returns the JSON record written.

        Jax-array values are fetched here (blocking): use ``LaggedMetrics`` in the train loop.
        """
        values = {k: to_scalar(k, v) for k, v in flatten_metrics(metrics).items()}
        for key in _RESERVED:
            if key in values:
                raise ValueError(f"metric name {key!r} is reserved in {METRICS_FILE}")
        record = {"step": int(step), "stage": stage, "time": time.time(), **values}
        if not self.enabled:
            return record
        self._file.write(json.dumps(record) + "\n")
        # Flushed per line so a crash or a reader in a notebook sees every completed step.
        self._file.flush()
        if self._use_tensorboard:
            tb = self._tb_writer(stage)
            for name, value in values.items():
                tb.add_scalar(name, value, int(step))
        if self._wandb_run is not None:
            self._wandb_run.log({f"{stage}/{k}": v for k, v in values.items()}, step=int(step))
        return record

    def _tb_writer(self, stage: str):
        if stage not in self._tb:
            from tensorboardX import SummaryWriter

            logdir = os.fspath(paths.as_path(self.workdir) / "tb" / stage)
            _check_tensorboard_url(logdir)
            self._tb[stage] = SummaryWriter(logdir, flush_secs=30)
        return self._tb[stage]

    def flush(self) -> None:
        """Flushes JSONL and TensorBoard files."""
        if self._file is not None:
            self._file.flush()
        for tb in self._tb.values():
            tb.flush()

    def close(self) -> None:
        """Flushes and closes every sink (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        for tb in self._tb.values():
            tb.close()
        self._tb.clear()
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _ObjectFile:
    """Appends to an object-store file (which has no append): each flush rewrites the object."""

    def __init__(self, path):
        self._path = path
        self._text = path.read_text() if path.exists() else ""  # a resumed run keeps its lines

    def write(self, text: str) -> None:
        self._text += text

    def flush(self) -> None:
        self._path.write_text(self._text)

    def close(self) -> None:
        self.flush()


def _check_tensorboard_url(logdir: str) -> None:
    """tensorboardX writes URLs itself (gs:// via google-cloud-storage, s3:// via boto3)."""
    if not paths.is_url(logdir):
        return
    from tensorboardX import record_writer

    scheme = logdir.split("://", 1)[0]
    if scheme not in record_writer.REGISTERED_FACTORIES:
        raise ValueError(f"tensorboardX cannot write to {logdir}; pass use_tensorboard=False")
    if scheme == "gs" and not record_writer.GCS_ENABLED:
        raise ImportError(
            f"TensorBoard logs to {logdir} need google-cloud-storage (tensorboardX writes gs:// "
            "itself): pip install google-cloud-storage, or pass use_tensorboard=False"
        )


class LaggedMetrics:
    """Holds step N's device metrics and fetches them once step N+1 has been dispatched."""

    def __init__(self, writer: MetricsWriter | None = None, *, stage: str = "train"):
        """Args: writer: where fetched metrics go (None: only return them); stage: their stage."""
        self._writer = writer
        self._stage = stage
        self._pending: tuple[int, Any] | None = None

    def push(self, step: int, metrics: Any) -> tuple[int, dict[str, float | int]] | None:
        """Queues ``step``'s metrics; fetches, writes and returns the previously queued ones.

        Returns:
          ``(previous_step, host_metrics)``, or None on the first call.
        """
        for leaf in jax.tree.leaves(metrics):
            # Starts the device-to-host copy now without waiting for it.
            if isinstance(leaf, jax.Array):
                leaf.copy_to_host_async()
        previous, self._pending = self._pending, (step, metrics)
        return None if previous is None else self._emit(*previous)

    def flush(self) -> tuple[int, dict[str, float | int]] | None:
        """Fetches, writes and returns the queued metrics (end of loop, before eval or save)."""
        previous, self._pending = self._pending, None
        return None if previous is None else self._emit(*previous)

    def _emit(self, step: int, metrics: Any) -> tuple[int, dict[str, float | int]]:
        host = jax.device_get(metrics)
        values = {k: to_scalar(k, v) for k, v in flatten_metrics(host).items()}
        if self._writer is not None:
            self._writer.write(step, values, stage=self._stage)
        return step, values


def read_metrics(workdir: str | os.PathLike, *, stage: str | None = None) -> list[dict[str, Any]]:
    """Reads ``workdir/metrics.jsonl`` in write order, optionally only one stage.

    A torn last line (the writer was killed mid-write) is skipped; a bad line elsewhere raises
    ValueError naming the file and line.
    """
    path = paths.as_path(workdir) / METRICS_FILE
    if not path.exists():
        return []
    lines = path.read_text().split("\n")
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:  # no trailing newline: the write never finished
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON line: {e}") from e
        if stage is None or record.get("stage") == stage:
            records.append(record)
    return records


def last_per_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Keeps the last record of each (stage, step), ordered by stage then step (after resumes)."""
    latest = {(r["stage"], r["step"]): r for r in records}
    return [latest[k] for k in sorted(latest)]


RL_SUMMARY_FILE = "rl_summary.json"  # written by tg_jax.train.rl in each run directory


def read_rl_summary(workdir: str) -> dict[str, Any]:
    """rl_summary.json of a run (arm, seed, steps, finished, costs, sessions)."""
    return paths.read_json(paths.as_path(workdir) / RL_SUMMARY_FILE)
