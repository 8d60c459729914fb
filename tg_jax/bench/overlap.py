"""Async overlap: an RL step with the sampling loop running apart vs one after the other.

    python -m tg_jax.bench --sections overlap

The pieces of `tg_jax.train.rl.run_rl` (its rollout sampler and weight publishing from
`tg_jax.sampling.placement`, its `BatchRollout` over the coding environment, `build_batch`,
the jitted TG `train_step`), without its data stage, checkpoints, evaluation and logging, on
D devices (8 by default: a child process with that many XLA CPU host devices when this one
has fewer), in two layouts:

  split      the sampler on the last D/2 devices (`config.sampler_mesh.num_devices` = D/2),
             the trainer's mesh on the others: the headline figures;
  colocated  sampler and trainer on one mesh over all D devices (num_devices = 0): under
             "colocated".

Each layout runs two modes with the same meshes, sampler, step function and task batches:

  sequential  `InlineLoop`: publish the params and sample a group (sampling), then
              build_batch and the step, blocked until done (training), timed apart.
  async       `SamplingLoop` (its thread samples ahead, queue and staleness as configured):
              `warmup` + queue_size + 1 untimed steps first (the queue filled at the start
              drains, so the timed steps run at the steady rate), then a window of `steps`
              steps, from asking for the first group to publishing after the last.

Figures (means over the timed steps, so that they compare with window / steps):
sampling_s, training_s, sequential_step_s (their sum), async_step_s (window / steps),
async_over_max = async_step_s / max(sampling_s, training_s) (goal <= 1.15) and
async_over_sequential; sampler_idle and trainer_idle, the shares of the window the sampler
spent outside rollouts and the trainer outside build_batch + step + publish (waiting for a
group); sampling_in_async_s / training_in_async_s, the same work timed inside the window
(what running side by side costs each); dropped_groups, stale groups sampled and refused;
sequential_cpu_per_s / async_cpu_per_s, the process's CPU seconds per wall second in each
mode (on a machine shared with other jobs, a mode with more busy threads gets a larger share
of the cores: then async_over_max can fall below 1 without any real overlap).

On a CPU the simulated devices share the machine's cores: the split gives the sampler no
compute of its own, so async_over_max there measures how much the two compete for the cores,
not the overlap of separate chips. Params are a random initialisation: its turns run to the
token budget, so sampling is at its longest (an SFT model stops earlier). Batches are padded
to the full lengths so that no timed step compiles.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections

from tg_jax import config_files, config_lib, sharding
from tg_jax.bench.measure import load_average
from tg_jax.bench.throughput import _worker_env as worker_env
from tg_jax.envs import make_env
from tg_jax.envs.coding import CodingEnv, coding_env_config
from tg_jax.envs.hints import FeedbackRates
from tg_jax.envs.tasks import generate_tasks
from tg_jax.models import ModelConfig, Transformer
from tg_jax.rl.batch import build_batch
from tg_jax.rl.train_state import create_train_state, make_optimizer
from tg_jax.rl.train_step import make_train_step
from tg_jax.sampling import placement, rollout
from tg_jax.sampling.loop import InlineLoop, RolloutGroup, SamplingLoop
from tg_jax.text import ByteTokenizer, ChatRenderer
from tg_jax.train import rl_rollouts

DEVICES = 8  # the split: sampler on half of them, trainer on the other half


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
    devices: int = DEVICES,
) -> dict[str, Any]:
    """Times `steps` RL steps per mode and layout (after warmup); see the module docstring.

    Args:
      config: a full run config (model, mesh, env, rl, tg, optim, optional rl_loop and
        sampler_mesh: its shape is the split's sampler mesh).
      steps: timed steps per mode.
      warmup: untimed steps per mode (async: queue_size + 1 more).
      groups, rollouts, max_new_tokens: override rl_loop's groups_per_step,
        rollouts_per_group and max_new_tokens (tests).
      seed: params, sampling and task seed.
      devices: devices of both layouts (a child process has them when this one has fewer).

    Returns:
      The split layout's figures, the colocated layout's under "colocated", and the device
      counts.
    """
    kwargs = dict(
        steps=steps,
        warmup=warmup,
        groups=groups,
        rollouts=rollouts,
        max_new_tokens=max_new_tokens,
        seed=seed,
        devices=devices,
    )
    if jax.device_count() < devices:
        return _in_child(config, kwargs, devices)
    del kwargs["devices"]
    split = measure_layout(config, devices=devices, sampler_devices=devices // 2, **kwargs)
    colocated = measure_layout(config, devices=devices, sampler_devices=0, **kwargs)
    return {
        **split,
        "colocated": colocated,
        "devices": float(devices),
        "sampler_devices": float(devices // 2),
    }


@dataclasses.dataclass
class _Run:
    """One layout's pieces: the train state (advanced by `train`), the rollout function, the
    weight publishing (None: the sampler reads the trainer's params) and the sampler's spans."""

    state: Any
    rollout_fn: Callable[..., Any]
    train: Callable[[Any, RolloutGroup], Any]
    place: Any
    spans: list[tuple[float, float]] = dataclasses.field(default_factory=list)

    def timed_rollout(self, params: Any, index: int, tasks: Any, version: int) -> Any:
        start = time.perf_counter()
        out = self.rollout_fn(params, index, tasks, version)
        self.spans.append((start, time.perf_counter()))
        return out


def measure_layout(
    config: Any,
    *,
    devices: int,
    sampler_devices: int,
    steps: int,
    warmup: int = 1,
    groups: int | None = None,
    rollouts: int | None = None,
    max_new_tokens: int | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Both modes of one layout: the sampler on `sampler_devices` of the first `devices`
    devices (0 = on the trainer's mesh over all of them)."""
    lc = loop_section(config)
    groups = int(groups or lc.groups_per_step)
    rollouts = int(rollouts or lc.rollouts_per_group)
    max_new = int(max_new_tokens or lc.max_new_tokens)
    queue_size = int(lc.queue_size)
    cfg = _layout_config(config, sampler_devices)
    run = _parts(cfg, lc, rollouts, max_new, seed, jax.devices()[:devices])
    async_warmup = warmup + queue_size + 1
    # The same task batches in both modes (async also gets spares for the stale groups).
    tasks = generate_tasks("train", 4 * (async_warmup + steps) * groups, seed=seed)
    batches = [tasks[i : i + groups] for i in range(0, len(tasks), groups)]
    max_staleness = int(cfg.rl.max_staleness)
    sampling, training, seq_cpu = _sequential(run, batches[: warmup + steps], warmup, max_staleness)
    window = _async(run, batches, async_warmup, steps, queue_size, max_staleness)
    s, t = statistics.fmean(sampling), statistics.fmean(training)
    a = window["seconds"] / steps
    return {
        "sampling_s": s,
        "training_s": t,
        "sequential_step_s": s + t,
        "async_step_s": a,
        "async_over_sequential": a / (s + t),
        "async_over_max": a / max(s, t),
        "sampler_idle": 1.0 - window["sampler_busy"] / window["seconds"],
        "trainer_idle": 1.0 - window["trainer_busy"] / window["seconds"],
        "sampling_in_async_s": window["sampling"],
        "training_in_async_s": window["training"],
        "dropped_groups": window["dropped"],
        "sequential_cpu_per_s": seq_cpu,
        "async_cpu_per_s": window["cpu_per_s"],
        "episodes_per_step": float(groups * rollouts),
        "load": load_average(),
    }


def _sequential(
    run: _Run, batches: list[Any], warmup: int, max_staleness: int
) -> tuple[list[float], list[float], float]:
    """(sampling seconds, training seconds) of the timed steps, one after the other, and the
    process's CPU seconds per wall second over them."""
    source = InlineLoop(run.rollout_fn, batches, place=run.place)
    sampling, training, cpu = [], [], 0.0
    for i in range(len(batches)):
        t0, c0 = time.perf_counter(), time.process_time()
        source.publish(run.state.params, i)
        group = _next_group(source, max_staleness)
        t1 = time.perf_counter()
        run.state = run.train(run.state, group)
        if i >= warmup:
            sampling.append(t1 - t0)
            training.append(time.perf_counter() - t1)
            cpu += time.process_time() - c0
    return sampling, training, cpu / (sum(sampling) + sum(training))


def _async(
    run: _Run, batches: list[Any], warmup: int, steps: int, queue_size: int, max_staleness: int
) -> dict[str, float]:
    """The window of `steps` async steps after `warmup`: its seconds, the sampler's and the
    trainer's busy seconds in it, their mean work per step, and the groups dropped in it."""
    run.spans.clear()
    source = SamplingLoop(run.timed_rollout, batches, queue_size=queue_size, place=run.place)
    busy, trained, sampled = [], [], []
    start, cpu0, dropped0 = 0.0, 0.0, 0.0
    try:
        source.publish(run.state.params, 0)
        for i in range(warmup + steps):
            if i == warmup:
                start, cpu0 = time.perf_counter(), time.process_time()
                dropped0 = source.stats()["groups_dropped_stale"]
            group = _next_group(source, max_staleness)
            t1 = time.perf_counter()
            run.state = run.train(run.state, group)
            t2 = time.perf_counter()
            source.publish(run.state.params, i + 1)
            if i >= warmup:
                busy.append(time.perf_counter() - t1)
                trained.append(t2 - t1)
                sampled.append(group.seconds)
        end, cpu = time.perf_counter(), time.process_time() - cpu0
        dropped = source.stats()["groups_dropped_stale"] - dropped0
    finally:
        source.close()
    sampler_busy = sum(max(0.0, min(b, end) - max(a, start)) for a, b in run.spans)
    return {
        "seconds": end - start,
        "sampler_busy": sampler_busy,
        "trainer_busy": sum(busy),
        "sampling": statistics.fmean(sampled),
        "training": statistics.fmean(trained),
        "dropped": float(dropped),
        "cpu_per_s": cpu / (end - start),
    }


def _next_group(source: InlineLoop | SamplingLoop, max_staleness: int) -> RolloutGroup:
    group = source.get(max_staleness)
    if group is None:
        raise RuntimeError("overlap_bench ran out of task batches")
    return group


def _layout_config(config: Any, sampler_devices: int) -> ml_collections.ConfigDict:
    """`config` with TG on and `sampler_devices` devices of the sampler's own (0 = none)."""
    shape = tuple(config.sampler_mesh.shape) if "sampler_mesh" in config else (-1, 1)
    fields = config.to_dict()
    fields["sampler_mesh"] = config_lib.sampler_mesh_config(sampler_devices, shape).to_dict()
    return config_files.apply_overrides(ml_collections.ConfigDict(fields), {"tg.enabled": True})


def _parts(
    cfg: Any, lc: Any, rollouts: int, max_new: int, seed: int, devices: list[jax.Device]
) -> _Run:
    """`run_rl`'s pieces on a random initialisation, TG on, on `devices`."""
    renderer = ChatRenderer(ByteTokenizer())
    model = Transformer(ModelConfig.from_config(cfg.model))
    trainer_devices, sampler_devices = sharding.split_devices(cfg, devices)
    mesh = sharding.make_mesh(cfg.mesh, trainer_devices)
    rules = sharding.logical_rules(cfg.mesh)
    divisor = sharding.batch_divisor(mesh, rules)
    requirements = tuple(cfg.env.requirements)
    teacher_max = int(cfg.model.max_seq_len)
    reserve = rl_rollouts.hint_reserve(
        renderer, make_env(cfg.env).requirements, int(cfg.env.max_turns)
    )
    student_max = int(lc.seq_len) or teacher_max - reserve
    state = create_train_state(model, make_optimizer(cfg.optim), mesh, rules, jax.random.key(seed))
    step_fn = make_train_step(cfg, model, mesh, rules)
    sampler, place = placement.rollout_sampler(
        model,
        renderer.tokenizer.pad_id,
        mesh,
        rules,
        divisor,
        sampler_mesh_cfg=cfg.sampler_mesh,
        sampler_devices=sampler_devices,
    )
    env_cfg = coding_env_config(cfg.env)
    rollout_fn = rl_rollouts.BatchRollout(
        sampler,
        renderer,
        lambda: CodingEnv(env_cfg),
        rollouts_per_group=rollouts,
        config=rollout.RolloutConfig(
            max_new_tokens=max_new,
            max_total_tokens=student_max,
            temperature=float(cfg.rl.temperature),
        ),
        sampling_key=jax.random.key(seed + 1),
        seed=seed,
        rates=FeedbackRates(),
    )

    def train(state, group):
        batch = build_batch(
            group.trajectories,
            max_len=student_max,
            teacher_max_len=teacher_max,
            mode=str(cfg.tg.teacher_mode),
            gate=str(cfg.tg.gate),
            max_teacher_rows=int(cfg.tg.max_teacher_rows),
            requirement_names=requirements,
            pad_to_multiple=0,
            batch_multiple=divisor,
            micro_batches=int(cfg.rl.micro_batches),
        )
        state, metrics = step_fn(state, batch)
        jax.block_until_ready((state.params, metrics))
        return state

    return _Run(state, rollout_fn, train, place)


def _in_child(config: Any, kwargs: dict[str, Any], devices: int) -> dict[str, Any]:
    """`overlap_bench` in a child process with `devices` XLA CPU host devices."""
    job = json.dumps({"config": config.to_dict(), "kwargs": kwargs})
    proc = subprocess.run(
        [sys.executable, "-m", "tg_jax.bench.overlap"],
        input=job,
        capture_output=True,
        text=True,
        env=worker_env(devices),
        timeout=3 * 3600,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"overlap worker ({devices} devices) failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    """The child process: a JSON job on stdin, the figures as the last line of stdout."""
    job = json.loads(sys.stdin.read())
    result = overlap_bench(ml_collections.ConfigDict(job["config"]), **job["kwargs"])
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
