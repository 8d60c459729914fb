"""An RL run's resume point, and what differs under the whole-host split.

Resume (every layout): the latest readable checkpoint's state, session and task-iterator
position (`resume`), refused when it holds another arm or seed.

The whole-host split (`sampler_mesh.processes` H > 0, several processes): the last H processes
only sample and the others only train (`sharding.split_devices`). Every process still runs the
same loop, step for step, and calls the same collectives in the same order:
  * the train step and the weight copy are called by every process; a sampler process holds
    no shard of the trainer's arrays, so its call of the train step computes nothing, and the
    copy (`placement.HostTransfer`) moves the weights device to device onto its chips;
  * only sampler processes roll out (a trainer process's loop is `rl_rollouts.NoRollouts`);
    `ProcessGather` merges their groups, as with any multi-process run;
  * what a sampler process cannot read it receives from process 0 (a trainer) as host data:
    the step's metrics (`rl.nonfinite` decides control flow on them) and the resume point;
    the held-out figures go the other way, from the first sampler process (`from_samplers`);
  * checkpoints are the trainer processes' (orbax's active processes); a sampler process's
    checkpointer answers the loop's questions and saves nothing (`Follower`);
  * at the end of the run every process restores the last checkpoint onto the whole mesh
    (`full_state`: every device), so what follows the RL stage (exports, the final
    evaluation, the report) sees the state as in any other multi-process run.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import jax

from tg_jax import checkpointing, multihost, sharding
from tg_jax.errors import RunError
from tg_jax.models import ModelConfig, Transformer
from tg_jax.rl.train_state import TrainState, make_optimizer, train_state_shardings
from tg_jax.train.rl_costs import Costs, Session


@dataclasses.dataclass(frozen=True)
class Roles:
    """Which processes sample and train."""

    samplers: tuple[int, ...]  # the processes that roll out (all of them but with whole hosts)
    whole: bool  # the whole-host split: samplers train nothing, the others sample nothing

    @property
    def samples(self) -> bool:
        return jax.process_index() in self.samplers

    @property
    def trains(self) -> bool:
        return not (self.whole and self.samples)

    @property
    def trainers(self) -> tuple[int, ...]:
        return tuple(p for p in range(jax.process_count()) if p not in self.samplers)


def roles(config: Any) -> Roles:
    """This run's roles (`sampler_mesh.processes`). Under the whole-host split every process
    checks that all name the same sampler processes, in a collective over every process that
    also comes before any collective of the trainer's alone (on CPU, gloo's first context
    over every process failed to connect when a trainer-only one came first).

    Raises:
      RunError: the processes disagree (each was given another config).
    """
    samplers = sharding.sampler_processes(config)
    whole = len(samplers) < jax.process_count()
    if whole:
        named = multihost.allgather_objects(samplers)
        if not multihost.same_on_all(named):
            raise RunError(
                f"process {jax.process_index()}: the processes name different sampler "
                f"processes ({named}, by process): every process must run the same config"
            )
    return Roles(samplers, whole)


def from_samplers(r: Roles, value: Any) -> Any:
    """The first sampler process's `value`, on every process (a collective under the
    whole-host split; `value` itself otherwise)."""
    return multihost.allgather_objects(value)[r.samplers[0]] if r.whole else value


def follow(r: Roles, metrics: Mapping[str, Any]) -> Mapping[str, Any]:
    """A step's metrics as process 0 (a trainer) read them, on every process under the
    whole-host split (the metrics must be computed: the caller waited for them)."""
    if not r.whole:
        return metrics
    return multihost.agreed(jax.device_get(dict(metrics)) if multihost.is_primary() else None)


class Follower:
    """A sampler process's checkpointer under the whole-host split: the trainer processes
    save; this answers the loop's questions as their checkpointer does (the save interval;
    the latest step the loop asked to save) and writes nothing."""

    def __init__(self, directory: str, save_interval_steps: int):
        self.directory, self.interval = directory, int(save_interval_steps)
        self.step: int | None = None

    def should_save(self, step: int) -> bool:
        return step % self.interval == 0

    def save(self, step: int, state: Any, **_: Any) -> bool:
        del state
        self.step = step
        return False

    def latest_step(self) -> int | None:
        return self.step

    def wait_until_finished(self) -> None:
        pass

    def close(self) -> None:
        pass


def checkpointer(
    r: Roles, directory: str, max_to_keep: int, save_interval_steps: int
) -> checkpointing.TrainingCheckpointer | Follower:
    """The run's checkpointer: every process's, the trainer processes' alone under the
    whole-host split (a sampler process's `Follower`)."""
    if not r.whole:
        return checkpointing.TrainingCheckpointer(
            directory, max_to_keep=max_to_keep, save_interval_steps=save_interval_steps
        )
    if not r.trains:
        return Follower(directory, save_interval_steps)
    return checkpointing.TrainingCheckpointer(
        directory,
        max_to_keep=max_to_keep,
        save_interval_steps=save_interval_steps,
        processes=r.trainers,
    )


def _check_resume(meta: Mapping[str, Any], arm_name: str, seed: int, directory: str) -> None:
    if meta.get("arm", arm_name) != arm_name or int(meta.get("seed", seed)) != seed:
        raise checkpointing.CheckpointError(
            f"{directory} holds arm {meta.get('arm')!r} seed {meta.get('seed')}, not arm "
            f"{arm_name!r} seed {seed}: use another workdir per arm and seed"
        )


def _restore(
    ckpt: checkpointing.TrainingCheckpointer, state: TrainState, arm_name: str, seed: int
) -> tuple[TrainState, Session, dict[str, Any] | None]:
    restored = ckpt.restore_latest(state)
    if restored is None:
        return state, Session(0, Costs(), 0.0, 0), None
    _check_resume(restored.metadata, arm_name, seed, ckpt.directory)
    costs = Costs(**restored.metadata.get("costs", {}))
    logging.info("rl %s seed %d: resumed at step %d", arm_name, seed, restored.step)
    session = Session(
        restored.step,
        costs,
        costs.wall_time_s,
        costs.dropped_groups,
        peak0=(costs.peak_memory_bytes, costs.peak_memory_above_start_bytes),
    )
    return restored.state, session, restored.metadata["data"]


def resume(
    r: Roles, ckpt: Any, state: TrainState, arm_name: str, seed: int
) -> tuple[TrainState, Session, dict[str, Any] | None]:
    """(state, session, task-iterator state or None): the latest checkpoint's, or a fresh
    start's. Under the whole-host split the trainer processes restore, and a sampler process
    takes process 0's session and position (its state: the trainer's arrays, none of whose
    shards it holds)."""
    if not r.whole:
        return _restore(ckpt, state, arm_name, seed)
    restored = _restore(ckpt, state, arm_name, seed) if r.trains else (state, None, None)
    session, data = multihost.agreed(restored[1:] if multihost.is_primary() else None)
    return restored[0], session, data


def full_state(config: Any, directory: str, state: TrainState) -> TrainState:
    """The run's latest checkpoint restored onto `sharding.every_device_mesh` (every process
    calls it, after the trainer processes committed the checkpoint)."""
    multihost.barrier("rl checkpoint committed")
    model = Transformer(ModelConfig.from_config(config.model))
    mesh = sharding.every_device_mesh(config)
    shardings = train_state_shardings(
        model, make_optimizer(config.optim), mesh, sharding.logical_rules(config.mesh)
    )
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )
    reader = checkpointing.TrainingCheckpointer(directory, read_only=True, async_save=False)
    try:
        return reader.restore(abstract).state
    finally:
        reader.close()


__all__ = [
    "Follower",
    "Roles",
    "checkpointer",
    "follow",
    "from_samplers",
    "full_state",
    "resume",
    "roles",
]
