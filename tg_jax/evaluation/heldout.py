"""Held-out evaluation of a params set: episodes on tasks never used in training.

`evaluate_heldout` plays `samples_per_task` episodes per task and condition with the rollout
evaluation helper (`tg_jax.sampling.rollout.evaluate`) and returns the per-episode
`EpisodeRecord`s that `tg_jax.evaluation.stats` and `tg_jax.evaluation.report` consume:

  plain   the prompt exactly as in training: does the policy meet the requirement by default?
  hinted  a hint for every requirement right before every assistant turn: can it when reminded?

Every arm and seed is evaluated on the same tasks with the same sampling key
(`eval.sampling_seed`), so arm differences can be paired task by task.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from tg_jax import engine as engine_api
from tg_jax import multihost, paths
from tg_jax.envs import env_factory
from tg_jax.evaluation.report_settings import eval_temperature
from tg_jax.models import ModelConfig, Transformer
from tg_jax.rl import hidden_thinking
from tg_jax.sampling import agent_loop, rollout
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
    rollout_cfg = rollout.RolloutConfig(
        max_new_tokens=int(ev.max_new_tokens if max_new_tokens is None else max_new_tokens),
        max_total_tokens=int(config.model.max_seq_len),
        temperature=eval_temperature(config) if temperature is None else float(temperature),
        env_workers=int(ev.env_workers),
        max_rows=int(config.sampler_mesh.max_rows),
        **hidden_thinking.rollout_settings(config),  # as the policy was trained
    )
    seed = int(ev.sampling_seed if sampling_seed is None else sampling_seed)
    # rl_loop.rollout_engine "builtin": the episodes' agent loops on the engine.
    runner = agent_loop.runner_from_config(
        config, engine_api, getattr(sampler, "model", None), episodes=len(tasks),
        max_total_tokens=rollout_cfg.max_total_tokens, pad_id=renderer.tokenizer.pad_id,
        mesh=getattr(sampler, "mesh", None),
    )  # fmt: skip
    records: list[EpisodeRecord] = []
    trajectories: list[Any] = []
    for i, condition in enumerate(conditions):
        recs, trajs = rollout.evaluate(
            runner or sampler, params, renderer, make_env, tasks,
            config=rollout_cfg, rng=jax.random.fold_in(jax.random.key(seed), i),
            condition=condition,
            samples_per_task=int(ev.samples_per_task if samples_per_task is None
                                 else samples_per_task),
            play=None if runner is None else agent_loop.play_episodes,
        )  # fmt: skip
        records.extend(recs)
        trajectories.extend(trajs)
    clusters = {rollout.task_id_of(t): _cluster_of(t) for t in tasks}
    records = [
        dataclasses.replace(r, cluster_id=clusters.get(r.task_id, r.task_id)) for r in records
    ]
    return records, trajectories


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
    """`evaluate_heldout` cached in `workdir/heldout.jsonl` (the run's final evaluation).

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
    records, trajectories = heldout_episodes(config, params, tasks, **kwargs)
    wall_s = time.perf_counter() - start
    if multihost.is_primary():  # every process played the same episodes; one writes them
        path.parent.mkdir(parents=True, exist_ok=True)
        summary = {"wall_s": wall_s, "episodes": len(records)}
        paths.write_json_atomic(path.parent / summary_file, summary)
        if traces is not None:  # before the records: a cached run has its traces
            traces(records, trajectories)
        save_records(path, records)
    return records
