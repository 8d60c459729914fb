"""Times the jitted TG train step against the GRPO step on the same batch.

    python -m tg_jax.bench.rl_step                # default model, 64 sequences x 384 tokens
    python -m tg_jax.bench.rl_step --batch=16 --seq_len=128 --steps=3   # quicker

What to expect: the TG step adds one forward pass of the teacher (no backward) to a
forward+backward step. A backward costs about twice a forward, so the teacher adds about
1/3 of the GRPO step (a bit more when the teacher sequences are longer than the student's,
because of the inserted hints), plus the full-vocabulary divergence per chunk (small at
V = 272, significant at V = 151,936). Goal: TG / GRPO <= 1.35.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np

from tg_jax import config_lib, sharding
from tg_jax.models import ModelConfig, Transformer
from tg_jax.rl.batch import build_batch
from tg_jax.rl.train_state import create_train_state, make_optimizer
from tg_jax.rl.train_step import make_train_step
from tg_jax.testing import synthetic_trajectories


def bench_config(model: ml_collections.ConfigDict | None = None) -> ml_collections.ConfigDict:
    """A config with model, mesh, rl, tg and optim sections for the benchmark."""
    c = ml_collections.ConfigDict()
    c.model = model if model is not None else config_lib.model_config()
    c.mesh = config_lib.mesh_config()
    c.rl = config_lib.rl_config(reward_weights={"task": 1.0, "fence": 0.5})
    c.tg = config_lib.tg_config()
    c.optim = config_lib.optim_config()
    return c


def bench(
    config: ml_collections.ConfigDict | None = None,
    *,
    batch_size: int = 64,
    seq_len: int = 384,
    steps: int = 5,
    seed: int = 0,
) -> dict[str, float]:
    """Times TG and GRPO steps on one batch; prints and returns the timings and the ratio.

    The two arms run interleaved (GRPO, TG, GRPO, TG, ...) after one compile call each, so that
    a change in machine load during the run hits both alike. Two clocks: wall time, and the
    CPU time of this process (all its threads), which other processes on a shared machine do
    not inflate; on an accelerator only wall time means anything. Ratios are of medians.
    """
    config = config if config is not None else bench_config()
    model = Transformer(ModelConfig.from_config(config.model))
    mesh = sharding.make_mesh(config.mesh)
    rules = sharding.logical_rules(config.mesh)
    trajs = synthetic_trajectories(np.random.default_rng(seed), batch_size, seq_len)
    batch = build_batch(
        trajs,
        max_len=seq_len,
        teacher_max_len=seq_len + 64,
        mode=config.tg.teacher_mode,
        max_teacher_rows=config.tg.max_teacher_rows,
        requirement_names=("fence",),
        pad_to_multiple=64,
        teacher_pad_to_multiple=16,
        batch_multiple=sharding.batch_divisor(mesh, rules),
        micro_batches=config.rl.micro_batches,
    )
    batch = jax.device_put(batch, sharding.data_sharding(mesh, rules, ndim=1))
    arms = ("grpo", "tg")
    step_fns, states = {}, {}
    wall, cpu = {arm: [] for arm in arms}, {arm: [] for arm in arms}
    for arm in arms:
        cfg = config_lib.apply_overrides(config, {"tg.enabled": arm == "tg"})
        optimizer = make_optimizer(cfg.optim)
        states[arm] = create_train_state(model, optimizer, mesh, rules, jax.random.key(seed))
        step_fns[arm] = make_train_step(cfg, model, mesh, rules)
        states[arm], metrics = step_fns[arm](states[arm], batch)  # compile
        jax.block_until_ready(metrics)
    for _ in range(steps):
        for arm in arms:
            start, start_cpu = time.perf_counter(), time.process_time()
            states[arm], metrics = step_fns[arm](states[arm], batch)
            jax.block_until_ready((states[arm].params, metrics))
            wall[arm].append(time.perf_counter() - start)
            cpu[arm].append(time.process_time() - start_cpu)
    results = {}
    for clock, times in (("wall", wall), ("cpu", cpu)):
        for arm in arms:
            results[f"{arm}_{clock}_s"] = float(np.median(times[arm]))
        results[f"ratio_{clock}"] = results[f"tg_{clock}_s"] / results[f"grpo_{clock}_s"]
    platform = jax.devices()[0].platform
    print(
        f"B={batch_size} T={seq_len} (teacher T_t={batch.teacher_tokens_BtxTt.shape[1]}) on "
        f"{jax.device_count()} {platform} device(s), median of {steps} interleaved steps:\n"
        f"  wall: GRPO {results['grpo_wall_s']:.3f} s, TG {results['tg_wall_s']:.3f} s, "
        f"TG/GRPO = {results['ratio_wall']:.3f}\n"
        f"  process CPU: GRPO {results['grpo_cpu_s']:.3f} s, TG {results['tg_cpu_s']:.3f} s, "
        f"TG/GRPO = {results['ratio_cpu']:.3f}"
    )
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq_len", type=int, default=384)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    bench(batch_size=args.batch, seq_len=args.seq_len, steps=args.steps)


if __name__ == "__main__":
    main()
