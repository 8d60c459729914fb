"""Async overlap: an RL step with the sampling loop running apart vs one after the other.

The pieces of `tg_jax.train.rl.run_rl` (its `BatchRollout` over the coding environment,
`build_batch`, the jitted TG `train_step`, weight publishing), without its data stage,
checkpoints, evaluation and logging, in two modes on the same sampler and step functions:

  sequential  `InlineLoop`: sample a rollout group, then train on it. The sampling and
              the training (build_batch + step, blocked until done) are timed apart.
  async       `SamplingLoop` (its thread samples ahead, queue and
              staleness as configured): the step's wall time is from asking for a group to
              the new params being published; the loop samples the next groups meanwhile.

Figures: async step / (sampling + training) and async step / max(sampling, training); the
goal is async <= 1.15 x max(sampling, training). Each mode runs `warmup` untimed steps first
(compilation of the sampler buckets and the step; async: the queue fills). Batches are padded
to the full lengths so that no timed step compiles. Params are a random initialisation: its
turns run to the token budget, so sampling is at its longest (an SFT model stops earlier).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from tg_jax import config_lib, sharding
from tg_jax.bench.measure import load_average
from tg_jax.envs.coding import CodingEnv, coding_env_config
from tg_jax.envs.hints import FeedbackRates
from tg_jax.envs.tasks import generate_tasks
from tg_jax.models import ModelConfig, Transformer
from tg_jax.rl.batch import build_batch
from tg_jax.rl.train_state import create_train_state, make_optimizer
from tg_jax.rl.train_step import make_train_step
from tg_jax.sampling import rollout
from tg_jax.sampling.loop import InlineLoop, RolloutGroup, SamplingLoop
from tg_jax.sampling.sampler import Sampler
from tg_jax.text import ByteTokenizer, ChatRenderer
from tg_jax.train import rl_rollouts


def loop_section(config: Any) -> Any:
    """`config.rl_loop`, or the loop defaults when the config file has none."""
    return config.rl_loop if "rl_loop" in config else config_lib.loop_config()


def overlap_bench(
    config: Any,
    *,
    steps: int,
    warmup: int = 1,
    groups: int | None = None,
    rollouts: int | None = None,
    max_new_tokens: int | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Times `steps` RL steps per mode (after `warmup`); see the module docstring.

    Args:
      config: a full run config (model, mesh, env, rl, tg, optim, optional rl_loop).
      steps: timed steps per mode.
      warmup: untimed steps per mode.
      groups, rollouts, max_new_tokens: override rl_loop's groups_per_step,
        rollouts_per_group and max_new_tokens (tests).
      seed: params, sampling and task seed.

    Returns:
      Seconds per step (medians): sampling, training, sequential, async; the two ratios;
      episodes per step and the load average at the end.
    """
    lc = loop_section(config)
    groups = int(groups or lc.groups_per_step)
    rollouts = int(rollouts or lc.rollouts_per_group)
    max_new = int(max_new_tokens or lc.max_new_tokens)
    cfg = config_lib.apply_overrides(config, {"tg.enabled": True})
    state, rollout_fn, train = _parts(cfg, lc, rollouts, max_new, seed)
    per_mode = warmup + steps
    # Async mode may drop stale groups, so it gets spare task batches.
    tasks = generate_tasks("train", 4 * per_mode * groups, seed=seed)
    batches = [tasks[i : i + groups] for i in range(0, len(tasks), groups)]
    max_staleness = int(cfg.rl.max_staleness)

    # Sequential: sample, then train, each timed on its own.
    source = InlineLoop(rollout_fn, batches[:per_mode])
    sampling, training = [], []
    for i in range(per_mode):
        source.publish(state.params, i)
        t0 = time.perf_counter()
        group = _next_group(source, max_staleness)
        t1 = time.perf_counter()
        state = train(state, group)
        if i >= warmup:
            sampling.append(t1 - t0)
            training.append(time.perf_counter() - t1)

    # Async: the sampling loop thread samples ahead while the trainer trains.
    source = SamplingLoop(
        rollout_fn, batches[per_mode:], first_index=per_mode, queue_size=int(lc.queue_size)
    )
    async_steps = []
    try:
        source.publish(state.params, per_mode)
        for i in range(per_mode):
            t0 = time.perf_counter()
            state = train(state, _next_group(source, max_staleness))
            source.publish(state.params, per_mode + i + 1)
            if i >= warmup:
                async_steps.append(time.perf_counter() - t0)
    finally:
        source.close()

    s, t = statistics.median(sampling), statistics.median(training)
    seq = statistics.median(np.add(sampling, training))
    a = statistics.median(async_steps)
    return {
        "sampling_s": s,
        "training_s": t,
        "sequential_step_s": seq,
        "async_step_s": a,
        "async_over_sequential": a / seq,
        "async_over_max": a / max(s, t),
        "episodes_per_step": float(groups * rollouts),
        "load": load_average(),
    }


def _next_group(source: InlineLoop | SamplingLoop, max_staleness: int) -> RolloutGroup:
    group = source.get(max_staleness)
    if group is None:
        raise RuntimeError("overlap_bench ran out of task batches")
    return group


def _parts(
    cfg: Any, lc: Any, rollouts: int, max_new: int, seed: int
) -> tuple[Any, rl_rollouts.BatchRollout, Callable[[Any, RolloutGroup], Any]]:
    """(initial train state, the batch rollout, train(state, group) -> new state): `run_rl`'s
    pieces on a random initialisation, TG on."""
    renderer = ChatRenderer(ByteTokenizer())
    model = Transformer(ModelConfig.from_config(cfg.model))
    mesh = sharding.make_mesh(cfg.mesh)
    rules = sharding.logical_rules(cfg.mesh)
    divisor = sharding.batch_divisor(mesh, rules)
    requirements = tuple(cfg.env.requirements)
    teacher_max = int(cfg.model.max_seq_len)
    reserve = rl_rollouts.hint_reserve(renderer, requirements, int(cfg.env.max_turns))
    student_max = int(lc.seq_len) or teacher_max - reserve
    state = create_train_state(model, make_optimizer(cfg.optim), mesh, rules, jax.random.key(seed))
    step_fn = make_train_step(cfg, model, mesh, rules)
    sampler = Sampler(model, pad_id=renderer.tokenizer.pad_id, batch_divisor=divisor)
    env_cfg = coding_env_config(cfg.env)
    rollout_fn = rl_rollouts.BatchRollout(
        sampler, renderer, lambda: CodingEnv(env_cfg), rollouts_per_group=rollouts,
        config=rollout.RolloutConfig(
            max_new_tokens=max_new, max_total_tokens=student_max,
            temperature=float(cfg.rl.temperature),
        ),
        sampling_key=jax.random.key(seed + 1), seed=seed, rates=FeedbackRates(),
    )  # fmt: skip

    def train(state, group):
        batch = build_batch(
            group.trajectories, max_len=student_max, teacher_max_len=teacher_max,
            mode=str(cfg.tg.teacher_mode), gate=str(cfg.tg.gate),
            max_teacher_rows=int(cfg.tg.max_teacher_rows), requirement_names=requirements,
            pad_to_multiple=0, batch_multiple=divisor, micro_batches=int(cfg.rl.micro_batches),
        )  # fmt: skip
        state, metrics = step_fn(state, batch)
        jax.block_until_ready((state.params, metrics))
        return state

    return state, rollout_fn, train
