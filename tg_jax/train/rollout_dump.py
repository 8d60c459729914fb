"""Rollout dumps: each RL step's batch as the trainer saw it, in array_record files.

With `rl_loop.dump_rollouts`, step N's batch goes to <run>/rollouts/step_<N>.array_record
before its train step (process 0 writes): one record per real batch row (an episode; with
`rl_loop.hide_thinking`, one turn's segment), a msgpack dict (`flax.serialization`):

  step, row, task_id, group_id, policy_version   where the row came from: the batch of step N
  sampler_process, request_ids                   trains policy version N-1 into version N; the
                                                 process that sampled the row and the engine
                                                 request of each of its turns (lineage; none
                                                 from the lock-step sampler)
  tokens_T, roles_T, turn_ids_T                  the row's tokens (T: its length, no padding)
  behaviour_logprobs_T, loss_mask_T, tg_mask_T,  per target, at the position that predicts it
  requirement_ids_T, advantages_T                (the batch's convention: position t predicts
                                                 token t + 1): the sampler's log-prob, the
                                                 policy loss's and the TG KL's tokens (M), the
                                                 hint placed before the target's turn (an index
                                                 into requirement_names, -1: none), the
                                                 advantage (an episode's, or per turn with
                                                 `rl.requirement_credit` "turn")
  verdicts_KxR                                   per assistant turn and requirement: 1 met,
                                                 0 broken, -1 not judged
  requirement_names, hints                       the names; {requirement: hint message ids}
  rewards, reward                                {component: reward}, their weighted sum

Groups the step dropped (unusable engine output) and rollout batches the sampling loop dropped
as stale before it are listed with why in step_<N>.dropped.json.
Beside each file, step_<N>.batch.msgpack holds the whole `Batch` the train step read (padding
rows, teacher rows and all), and rollouts/run_config.py the run's config as a Python literal
(written with the first dump): with a checkpoint, `python -m tg_jax.replay` re-scores the step
from these alone.

`read_dump(path)` returns a file's records in row order, `read_batch(path)` the step's
`Batch`, `read_run_config(path)` the run's config.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import pprint
from collections.abc import Sequence
from typing import Any

import ml_collections
import numpy as np

from tg_jax import multihost, paths

DUMP_DIR = "rollouts"
BATCH_SUFFIX = ".batch.msgpack"
DROPPED_SUFFIX = ".dropped.json"
REPLAY_SUFFIXES = (".replay.npz", ".replay.json")  # written by `python -m tg_jax.replay`
CONFIG_FILE = "run_config.py"


def dump_path(workdir: str, step: int) -> str:
    """Step `step`'s dump file in the run's `workdir`."""
    return os.fspath(paths.as_path(workdir) / DUMP_DIR / f"step_{int(step)}.array_record")


def dump_step(
    config: Any, workdir: str, step: int, trajectories: Sequence[Any], batch: Any
) -> None:
    """Writes step `step`'s batch (built from `trajectories`) when `rl_loop.dump_rollouts`."""
    if not config.rl_loop.get("dump_rollouts", False) or not multihost.is_primary():
        return
    from tg_jax.rl import hidden_thinking  # noqa: PLC0415

    if hidden_thinking.enabled(config):  # the batch's rows are the turns' segments
        trajectories, _ = hidden_thinking.segments(trajectories)
    records = step_records(config, step, trajectories, batch)
    path = dump_path(workdir, step)
    config_path = paths.as_path(path).parent / CONFIG_FILE
    if not config_path.exists():  # the run's config: the same for every step of a run
        config_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = config_path.parent / f"{CONFIG_FILE}.tmp"
        tmp.write_text(pprint.pformat(config.to_dict()) + "\n")
        tmp.replace(config_path)
    write_batch(batch_path(path), batch)
    dropped = [d for t in trajectories for d in t.info.get("dropped_groups", ())]
    if dropped:
        paths.write_json_atomic(beside(path, DROPPED_SUFFIX), dropped)
    write_records(path, records)


def beside(dump: str, suffix: str) -> str:
    """The file `suffix` names beside a step's dump file: step_<N><suffix>."""
    return os.fspath(dump).removesuffix(".array_record") + suffix


def batch_path(dump: str) -> str:
    """The whole-batch file beside a step's dump file."""
    return beside(dump, BATCH_SUFFIX)


def write_batch(path: str, batch: Any) -> None:
    """`batch` (a `tg_jax.rl.core.Batch` of host arrays) as one msgpack file (tmp, renamed)."""
    from flax import serialization  # noqa: PLC0415

    fields = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, tuple):  # requirement_names
            value = list(value)
        elif value is not None and not isinstance(value, str | bool | int | dict):
            value = np.asarray(value)
        fields[f.name] = value
    p = paths.as_path(path)
    tmp = p.parent / f"{p.name}.tmp"
    tmp.write_bytes(serialization.msgpack_serialize(fields))
    tmp.replace(p)


def read_batch(dump: str) -> Any:
    """The `Batch` of the step whose dump file is `dump` (numpy arrays)."""
    from flax import serialization  # noqa: PLC0415

    from tg_jax.rl.core import Batch  # noqa: PLC0415

    fields = serialization.msgpack_restore(paths.as_path(batch_path(dump)).read_bytes())
    fields["requirement_names"] = tuple(fields["requirement_names"])
    return Batch(**fields)


def read_run_config(dump: str) -> ml_collections.ConfigDict:
    """The config of the run whose dump file is `dump` (run_config.py beside it)."""
    text = (paths.as_path(dump).parent / CONFIG_FILE).read_text()
    return ml_collections.ConfigDict(ast.literal_eval(text))


def step_records(
    config: Any, step: int, trajectories: Sequence[Any], batch: Any
) -> list[dict[str, Any]]:
    """One dict per real row of `batch` (row b holds trajectories[b]; module docstring)."""
    from tg_jax.rl.loss import batch_advantages  # noqa: PLC0415
    from tg_jax.rl.step_config import RLConfig  # noqa: PLC0415

    adv, reward_B, _ = batch_advantages(batch, RLConfig.from_config(config.rl))
    adv, reward_B = np.asarray(adv, np.float32), np.asarray(reward_B, np.float32)
    names = tuple(batch.requirement_names)
    host = {
        k: np.asarray(getattr(batch, k))
        for k in (
            "tokens_BxT",
            "segment_ids_BxT",
            "behaviour_logprobs_BxT",
            "loss_mask_BxT",
            "tg_mask_BxT",
            "requirement_ids_BxT",
            "valid_B",
            "group_ids_B",
            "policy_version_B",
        )
    }
    out = []
    for b, traj in enumerate(trajectories):
        if not host["valid_B"][b]:
            continue
        n = int((host["segment_ids_BxT"][b] > 0).sum())
        verdicts = [
            [-1 if v.get(r) is None else int(bool(v[r])) for r in names] for v in traj.turn_verdicts
        ]
        row_adv = adv[b, :n] if adv.ndim == 2 else np.where(host["loss_mask_BxT"][b, :n], adv[b], 0)
        out.append(
            {
                "step": int(step),
                "row": b,
                "task_id": str(traj.task_id),
                "group_id": int(host["group_ids_B"][b]),
                "policy_version": int(host["policy_version_B"][b]),
                "sampler_process": int(traj.info.get("sampler_process", 0)),
                "request_ids": [str(r) for r in traj.info.get("request_ids", ())],
                "tokens_T": host["tokens_BxT"][b, :n].astype(np.int32),
                "roles_T": np.asarray(traj.roles, np.int8)[:n],
                "turn_ids_T": np.asarray(traj.turn_ids, np.int32)[:n],
                "behaviour_logprobs_T": host["behaviour_logprobs_BxT"][b, :n].astype(np.float32),
                "loss_mask_T": host["loss_mask_BxT"][b, :n].astype(np.int8),
                "tg_mask_T": host["tg_mask_BxT"][b, :n].astype(np.int8),
                "requirement_ids_T": host["requirement_ids_BxT"][b, :n].astype(np.int32),
                "advantages_T": np.asarray(row_adv, np.float32),
                "verdicts_KxR": np.asarray(verdicts, np.int8).reshape(len(verdicts), len(names)),
                "requirement_names": list(names),
                "hints": {k: np.asarray(v, np.int32) for k, v in traj.hint_tokens.items()},
                "rewards": {k: float(v[b]) for k, v in batch.rewards.items()},
                "reward": float(reward_B[b]),
            }
        )
    return out


def write_records(path: str, records: Sequence[dict[str, Any]]) -> None:
    """`records` as msgpack records of one array_record file (written whole, then renamed)."""
    from array_record.python import array_record_module  # noqa: PLC0415
    from flax import serialization  # noqa: PLC0415

    p = paths.as_path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{os.fspath(p)}.tmp"
    writer = array_record_module.ArrayRecordWriter(tmp, "group_size:1")
    for rec in records:
        writer.write(serialization.msgpack_serialize(rec))
    writer.close()
    os.replace(tmp, os.fspath(p))


def read_dump(path: str) -> list[dict[str, Any]]:
    """The records of a dump file, in row order."""
    from array_record.python import array_record_module  # noqa: PLC0415
    from flax import serialization  # noqa: PLC0415

    reader = array_record_module.ArrayRecordReader(os.fspath(path))
    try:
        raw = reader.read_all()
    finally:
        reader.close()
    return [serialization.msgpack_restore(r) for r in raw]
