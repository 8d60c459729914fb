"""Held-out evaluation of a params set: episodes on tasks never used in training.

`evaluate_heldout` plays `samples_per_task` episodes per task and condition with the rollout
evaluation helper (`tg_jax.sampling.rollout.evaluate`) and returns the per-episode
`EpisodeRecord`s that `tg_jax.evaluation.stats` and `tg_jax.evaluation.report` consume:

  plain   the prompt exactly as in training: does the policy meet the requirement by default?
  hinted  a hint for every requirement right before every assistant turn: can it when reminded?

Every arm and seed is evaluated on the same tasks with the same sampling key
(`eval.sampling_seed`), so arm differences can be paired task by task.

Several processes (`jax.distributed`; `split_episodes`, what a run's final evaluation plays):
the tasks are split over the processes that roll out (`sharding.sampler_processes`) as the
RL rollouts' groups are, contiguous shares in process order (`multihost.process_share`). Each
process plays its share on its own devices, with its own copy of the params
(`placement.rollout_sampler`, the rollouts' placement: one collective before any episode), and
its episodes draw from the streams of their task positions (`rollout.evaluate`'s
`first_stream`), so each samples what one process playing every task would. One
`allgather_objects` after every process's last episode then merges the shares into that one
process's order. Between the two collectives each process only runs programs on its own
devices, so when its tools return (or what they print) cannot put the processes' collectives
out of step: with one SPMD sampler over every host, the built-in engine's calls followed each
host's tool timing, and lock-step followed its tool outputs, both a hang after training.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from tg_jax import engine as engine_api
from tg_jax import multihost, paths, sharding
from tg_jax.envs import env_factory
from tg_jax.evaluation.report_settings import eval_temperature
from tg_jax.models import ModelConfig, Transformer
from tg_jax.rl import hidden_thinking
from tg_jax.sampling import agent_loop, placement, rollout
from tg_jax.sampling.episode import CONDITIONS, EpisodeRecord
from tg_jax.sampling.sampler import Sampler
from tg_jax.text import ByteTokenizer, ChatRenderer


def make_sampler(config: Any, renderer: ChatRenderer) -> Sampler:
    """A sampler of `config.model` (single-replica placement of the params)."""
    model = Transformer(ModelConfig.from_config(config.model))
    return Sampler(model, pad_id=renderer.tokenizer.pad_id)


def evaluate_heldout(
    config: Any, params: Any, tasks: Sequence[Any], **kwargs: Any
) -> list[EpisodeRecord]:
    """Plays held-out episodes with `params` and returns one record per episode
    (`heldout_episodes`, with the same arguments, without the trajectories)."""
    return heldout_episodes(config, params, tasks, **kwargs)[0]


def heldout_episodes(
    config: Any,
    params: Any,
    tasks: Sequence[Any],
    *,
    conditions: Sequence[str] | None = None,
    samples_per_task: int | None = None,
    temperature: float | None = None,
    max_new_tokens: int | None = None,
    sampling_seed: int | None = None,
    sampler: Sampler | None = None,
    renderer: ChatRenderer | None = None,
    first_stream: int = 0,
) -> tuple[list[EpisodeRecord], list[Any]]:
    """Plays held-out episodes with `params`: one record and one Trajectory per episode.

    Args:
      config: full config (sections model, env, and `eval` from
        `tg_jax.config_lib.eval_config` for the defaults of the arguments below).
      params: policy params.
      tasks: held-out tasks (`tg_jax.data.task_data.load_tasks(sources, "heldout", n)`).
      conditions: subset of ("plain", "hinted"); default `config.eval.conditions`.
      samples_per_task: episodes per task and condition; default `config.eval.samples_per_task`.
      temperature: sampling temperature (0 = greedy); default `eval_temperature(config)`
        (`eval.temperature`, or `rl.temperature` where that is -1).
      max_new_tokens: decode budget per turn; default `config.eval.max_new_tokens`.
      sampling_seed: sampling key seed; default `config.eval.sampling_seed`.
      sampler, renderer: reuse existing ones (default: new ones for `config.model` and the
        byte tokenizer).
      first_stream: `tasks` are positions first_stream.. of the evaluation's tasks (a
        process's share, `split_episodes`): task n's episodes draw from stream
        first_stream + n of each condition's and sample's key.

    Returns:
      (records, trajectories): EpisodeRecords, condition by condition, sample by sample, task
      by task, each with its task's hidden function as `cluster_id` (the bootstrap's
      resampling unit); the episodes' Trajectories in the same order.
    """
    ev = config.eval
    conditions = tuple(ev.conditions if conditions is None else conditions)
    unknown = set(conditions) - set(CONDITIONS)
    if unknown:
        raise ValueError(f"unknown conditions {sorted(unknown)}; known: {CONDITIONS}")
    renderer = renderer or ChatRenderer(ByteTokenizer())
    sampler = sampler or make_sampler(config, renderer)
    make_env = env_factory(config.env, renderer.tool_format)
    rollout_cfg = _rollout_config(config, max_new_tokens, temperature)
    seed = int(ev.sampling_seed if sampling_seed is None else sampling_seed)
    runner = _engine_runner(config, sampler, renderer, len(tasks), rollout_cfg)
    records: list[EpisodeRecord] = []
    trajectories: list[Any] = []
    for i, condition in enumerate(conditions):
        recs, trajs = rollout.evaluate(
            runner or sampler,
            params,
            renderer,
            make_env,
            tasks,
            config=rollout_cfg,
            rng=jax.random.fold_in(jax.random.key(seed), i),
            condition=condition,
            samples_per_task=int(
                ev.samples_per_task if samples_per_task is None else samples_per_task
            ),
            play=None if runner is None else agent_loop.play_episodes,
            first_stream=first_stream,
        )
        records.extend(recs)
        trajectories.extend(trajs)
    return _with_clusters(records, tasks), trajectories


def _rollout_config(
    config: Any, max_new_tokens: int | None, temperature: float | None
) -> rollout.RolloutConfig:
    """The held-out episodes' rollout settings: `config.eval`'s decode budget and temperature
    where `heldout_episodes` was given none, the hidden thinking the policy was trained with."""
    ev = config.eval
    return rollout.RolloutConfig(
        max_new_tokens=int(ev.max_new_tokens if max_new_tokens is None else max_new_tokens),
        max_total_tokens=int(config.model.max_seq_len),
        temperature=eval_temperature(config) if temperature is None else float(temperature),
        env_workers=int(ev.env_workers),
        max_rows=int(config.sampler_mesh.max_rows),
        **hidden_thinking.rollout_settings(config),  # as the policy was trained
    )


def _engine_runner(
    config: Any,
    sampler: Sampler,
    renderer: ChatRenderer,
    episodes: int,
    rollout_cfg: rollout.RolloutConfig,
) -> Any:
    """The engine of `rl_loop.rollout_engine` that plays the episodes' agent loops
    (`agent_loop.runner_from_config`); None: the sampler plays them lock-step."""
    return agent_loop.runner_from_config(
        config,
        engine_api,
        getattr(sampler, "model", None),
        episodes=episodes,
        max_total_tokens=rollout_cfg.max_total_tokens,
        pad_id=renderer.tokenizer.pad_id,
        mesh=getattr(sampler, "mesh", None),
    )


def _with_clusters(records: Sequence[EpisodeRecord], tasks: Sequence[Any]) -> list[EpisodeRecord]:
    """`records` with each one's task's bootstrap cluster (`_cluster_of`) as its `cluster_id`
    (its task id for a task not in `tasks`)."""
    clusters = {rollout.task_id_of(t): _cluster_of(t) for t in tasks}
    return [dataclasses.replace(r, cluster_id=clusters.get(r.task_id, r.task_id)) for r in records]


def process_sampler(
    config: Any, params: Any, renderer: ChatRenderer
) -> tuple[Sampler, Any, tuple[int, ...]]:
    """(this process's sampler, its copy of `params` or None, the processes that sample).

    `params` on the trainer's mesh (`config.mesh` over `sharding.split_devices`' trainer
    devices): placed as the RL rollouts are (`placement.rollout_sampler`: each sampling
    process's own devices and copy; the whole-host split's trainer processes get None). On
    other devices (the whole-host split's state after RL, on every device:
    `rl_hosts.full_state`): every process samples on its own devices of them, colocated. The
    copy is a collective over every process."""
    model = Transformer(ModelConfig.from_config(config.model))
    trainer_devices, sampler_devices = sharding.split_devices(config)
    samplers = sharding.sampler_processes(config)
    held = {d for x in jax.tree.leaves(params) for d in x.sharding.device_set}
    mesh = sharding.make_mesh(config.mesh, trainer_devices)
    if held != set(trainer_devices):
        mesh = sharding.every_device_mesh(config, [d for d in jax.devices() if d in held])
        sampler_devices, samplers = None, tuple(range(jax.process_count()))
    rules = sharding.logical_rules(config.mesh)
    sampler, to_sampler = placement.rollout_sampler(
        model,
        renderer.tokenizer.pad_id,
        mesh,
        rules,
        sharding.batch_divisor(mesh, rules),
        sampler_mesh_cfg=config.get("sampler_mesh"),
        sampler_devices=sampler_devices,
    )
    return sampler, (params if to_sampler is None else to_sampler(params)), samplers


def merge_shares(
    shares: Sequence[tuple[list[EpisodeRecord], list[Any]]], conditions: Sequence[str]
) -> tuple[list[EpisodeRecord], list[Any]]:
    """The processes' (records, trajectories), in process order, as one process plays them:
    condition by condition (`conditions`' order), sample by sample, task by task (a share's
    records of one condition and sample are its tasks in order; the shares' tasks follow each
    other). Trajectories may be [] (not gathered), else one per record."""
    rank = {c: i for i, c in enumerate(conditions)}
    pairs = []
    for records, trajectories in shares:
        if trajectories and len(trajectories) != len(records):
            raise ValueError(f"{len(records)} records but {len(trajectories)} trajectories")
        pairs += zip(records, trajectories or [None] * len(records), strict=True)
    pairs.sort(key=lambda p: (rank[p[0].condition], p[0].sample))  # stable: task order kept
    kept = [t for _, t in pairs if t is not None]
    return [r for r, _ in pairs], kept


def split_episodes(
    config: Any,
    params: Any,
    tasks: Sequence[Any],
    *,
    renderer: ChatRenderer | None = None,
    conditions: Sequence[str] | None = None,
    trajectories: bool = True,
    **kwargs: Any,
) -> tuple[list[EpisodeRecord], list[Any]]:
    """`heldout_episodes` of `params` (on the trainer's mesh) on every process at once: the
    tasks split over the sampling processes, each played on its process's own devices, the
    episodes gathered once (module docstring); the same records and trajectories, in the same
    order, as one process. `trajectories` False: none gathered ([]). One process: plainly
    `heldout_episodes`.

    Collectives, in this order on every process whatever its tools do: the params' copy
    (`process_sampler`), then one `allgather_objects` of the episodes."""
    renderer = renderer or ChatRenderer(ByteTokenizer())
    conditions = tuple(config.eval.conditions if conditions is None else conditions)
    kwargs.update(renderer=renderer, conditions=conditions)
    if jax.process_count() == 1:
        records, trajs = heldout_episodes(config, params, tasks, **kwargs)
        return records, (trajs if trajectories else [])
    sampler, local, samplers = process_sampler(config, params, renderer)
    me = jax.process_index()
    own: tuple[list[EpisodeRecord], list[Any]] | None = None  # a process that samples nothing
    if me in samplers:
        share = multihost.process_share(len(tasks), samplers.index(me), len(samplers))
        logging.info(
            "held-out: process %d plays tasks %d..%d of %d",
            me,
            share.start,
            share.stop - 1,
            len(tasks),
        )
        own = [], []
        if share.stop > share.start:
            records, trajs = heldout_episodes(
                config,
                local,
                list(tasks)[share],
                sampler=sampler,
                first_stream=share.start,
                **kwargs,
            )
            own = records, (trajs if trajectories else [])
    gathered = multihost.allgather_objects(own)  # the one collective after the episodes
    return merge_shares([g for g in gathered if g is not None], conditions)


def _cluster_of(task: Any) -> str:
    """A task's bootstrap cluster: its `function_id` (tasks sharing a hidden function), a
    plug-in environment's record's "cluster_id", else the task itself."""
    if isinstance(task, dict):
        return str(task.get("cluster_id", rollout.task_id_of(task)))
    return str(getattr(task, "function_id", rollout.task_id_of(task)))


def heldout_metrics(records: Sequence[EpisodeRecord], prefix: str = "heldout/") -> dict[str, float]:
    """Episode means of every per-episode value, by condition ("plain" has no suffix)."""
    out: dict[str, float] = {}
    for cond in CONDITIONS:
        values = [r.values() for r in records if r.condition == cond]
        if not values:
            continue
        tag = "" if cond == "plain" else f"{cond}/"
        for key in sorted({k for v in values for k in v}):
            out[f"{prefix}{tag}{key}"] = float(np.mean([v.get(key, 0.0) for v in values]))
    return out


HELDOUT_FILE = "heldout.jsonl"
HELDOUT_SUMMARY_FILE = "heldout_summary.json"  # {"wall_s", "episodes"} of the evaluation


def save_records(path: str | os.PathLike, records: Sequence[EpisodeRecord]) -> None:
    """Writes records as JSON lines, atomically (a reader never sees a partial file)."""
    path = paths.as_path(path)
    tmp = path.parent / f"{path.name}.tmp"
    tmp.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in records))
    tmp.replace(path)


def load_records(path: str | os.PathLike) -> list[EpisodeRecord]:
    """Reads records written by `save_records`."""
    lines = paths.as_path(path).read_text().splitlines()
    return [EpisodeRecord.from_dict(json.loads(line)) for line in lines if line.strip()]


def evaluate_run(
    config: Any,
    workdir: str,
    params: Any,
    tasks: Sequence[Any],
    *,
    records_file: str = HELDOUT_FILE,
    summary_file: str = HELDOUT_SUMMARY_FILE,
    traces: Any = None,
    **kwargs: Any,
) -> list[EpisodeRecord]:
    """`evaluate_heldout` cached in `workdir/heldout.jsonl` (the run's final evaluation),
    split over the processes (`split_episodes`; `params` on the trainer's mesh).

    A file left by an earlier call is returned as is, so a rerun pipeline does not re-evaluate;
    delete it to evaluate again (e.g. after changing the eval config). The evaluation's wall
    time goes to `workdir/heldout_summary.json` (the report counts it in the protocol's cost).
    Other tasks than the held-out ones (a tuning trial's validation split) are cached under
    other names (`records_file`, `summary_file`). `traces(records, trajectories)`, when given,
    is called by the primary process with the episodes played (not when read back).
    """
    path = paths.as_path(workdir) / records_file
    if multihost.agreed(path.exists()):  # every process evaluates, or none (collectives)
        return load_records(path)
    start = time.perf_counter()
    records, trajectories = split_episodes(
        config, params, tasks, trajectories=traces is not None, **kwargs
    )
    wall_s = time.perf_counter() - start
    if multihost.is_primary():  # every process holds every episode; one writes them
        path.parent.mkdir(parents=True, exist_ok=True)
        summary = {"wall_s": wall_s, "episodes": len(records)}
        paths.write_json_atomic(path.parent / summary_file, summary)
        if traces is not None:  # before the records: a cached run has its traces
            traces(records, trajectories)
        save_records(path, records)
    return records
