"""Times the jitted TG train step against the GRPO step, at several shares of failed turns.

    python -m tg_jax.bench.rl_step                # default model, 64 sequences x 384 tokens
    python -m tg_jax.bench.rl_step --batch=16 --seq_len=128 --steps=3   # quicker

What to expect: the TG step adds one forward pass of the teacher (no backward) to a
forward+backward step, plus the full-vocabulary divergence and its backward (small at
V = 272, significant at V = 151,936). The teacher runs only where it teaches (compact rows,
`tg_jax.rl.tg.compact`): rows for the trajectories with a failed turn, from the first hint (the
prefix's keys and values are the student's) to the end of the last failed turn, and the
divergence runs over those rows' slots only (`tg_jax.rl.tg.teacher.slot_divergence`). So both
costs fall with the share of trajectories that fail a requirement: the arms "tg" (every
trajectory has a failed turn, as at the first steps), "tg_50pct" and "tg_10pct" (the
behaviour mostly learnt); turns fail independently at the rate that gives that share
(`with_failure_share`: at 100% every turn fails). Their batches have compact rows where those
save at least `compact.MIN_COMPACT_SAVING` of the teacher's token slots, full rows otherwise
(the same at all three shares here). "tg_full" is the uncompacted step on the "tg"
batch.
Goals: TG / GRPO <= 1.35 with every trajectory failing, <= 1.10 at 10%.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np

from tg_jax import config_files, config_lib, sharding
from tg_jax.models import ModelConfig, Transformer
from tg_jax.rl.batch import Batch, build_batch
from tg_jax.rl.tg.compact import MIN_COMPACT_SAVING
from tg_jax.rl.train_state import create_train_state, make_optimizer
from tg_jax.rl.train_step import make_train_step
from tg_jax.sampling.trajectory import Trajectory
from tg_jax.testing import synthetic_trajectories

# Arm -> share of trajectories with at least one failed turn (None: the GRPO arm).
FAIL_SHARES = {"tg": 1.0, "tg_50pct": 0.5, "tg_10pct": 0.1}


def bench_config(model: ml_collections.ConfigDict | None = None) -> ml_collections.ConfigDict:
    """A config with model, mesh, rl, tg and optim sections for the benchmark."""
    c = ml_collections.ConfigDict()
    c.model = model if model is not None else config_lib.model_config()
    c.mesh = config_lib.mesh_config()
    c.rl = config_lib.rl_config(reward_weights={"task": 1.0, "fence": 0.5})
    c.tg = config_lib.tg_config()
    c.optim = config_lib.optim_config()
    return c


def with_failure_share(
    trajectories: Sequence[Trajectory], share: float, rng: np.random.Generator
) -> list[Trajectory]:
    """The trajectories with verdicts redrawn so that round(share * n) of them (chosen at
    random) have at least one failed turn and the others none.

    Turns fail independently at the rate q for which a trajectory of K turns has a failed one
    with probability `share`: 1 - (1 - q)^K = share. So share 1 is the first steps (the
    requirement never met: every turn fails) and a small share the behaviour mostly learnt
    (mostly one failed turn). The requirement rewards follow the verdicts.
    """
    n = len(trajectories)
    failing = set(rng.permutation(n)[: round(share * n)].tolist())
    out = []
    for i, traj in enumerate(trajectories):
        turns = traj.num_turns
        rate = 1.0 - (1.0 - share) ** (1.0 / turns)
        fails = np.zeros((turns,), bool)
        while i in failing and not fails.any():
            fails = rng.random(turns) < rate
        verdicts = [
            {r: not bool(f) for r in v} for v, f in zip(traj.turn_verdicts, fails, strict=True)
        ]
        rewards = {**traj.rewards}
        for r in traj.turn_verdicts[0]:
            rewards[r] = float(np.mean([v[r] for v in verdicts]))
        out.append(dataclasses.replace(traj, turn_verdicts=verdicts, rewards=rewards))
    return out


def teacher_flops(model_cfg: ModelConfig, batch: Batch) -> float:
    """Forward FLOPs of the batch's real teacher tokens (matmuls and causal attention over the
    context each token sees; padding not counted) plus, for compact rows, the value projection
    of the student prefix slots they read."""
    cfg = model_cfg
    unembed = 2 * cfg.d_model * cfg.vocab_size
    per_token = cfg.flops_per_token(0) - unembed
    per_context = cfg.flops_per_token(2) - cfg.flops_per_token(0)  # per key a query sees
    real = np.asarray(batch.teacher_segment_ids_BtxTt) > 0
    context = (np.asarray(batch.teacher_positions_BtxTt) + 1)[real].sum()
    flops = per_token * real.sum() + per_context * context
    if batch.teacher_compact:
        v_proj = 2 * cfg.d_model * cfg.num_kv_heads * cfg.head_dim * cfg.num_layers
        flops += v_proj * int(real.any(-1).sum()) * batch.teacher_prefix_len
    return float(flops)


def bench_batches(
    config: ml_collections.ConfigDict, batch_size: int, seq_len: int, seed: int, divisor: int
) -> tuple[dict[str, Batch], dict[str, float]]:
    """{arm: batch} (GRPO and "tg_full" on the "tg" trajectories) and {arm: teacher FLOPs
    saved against full rows}."""
    rng = np.random.default_rng(seed)
    base = synthetic_trajectories(rng, batch_size, seq_len)
    kwargs = dict(
        max_len=seq_len,
        teacher_max_len=seq_len + 64,
        mode=config.tg.teacher_mode,
        max_teacher_rows=config.tg.max_teacher_rows,
        requirement_names=("fence",),
        pad_to_multiple=64,
        teacher_pad_to_multiple=16,
        batch_multiple=divisor,
        micro_batches=config.rl.micro_batches,
    )
    model_cfg = ModelConfig.from_config(config.model)
    batches, saved = {}, {}
    for arm, share in FAIL_SHARES.items():
        trajs = with_failure_share(base, share, rng)
        batches[arm] = build_batch(
            trajs, compact=True, min_compact_saving=MIN_COMPACT_SAVING, **kwargs
        )
        full = build_batch(trajs, **kwargs)
        saved[arm] = 1.0 - teacher_flops(model_cfg, batches[arm]) / teacher_flops(model_cfg, full)
        if arm == "tg":
            batches["grpo"], batches["tg_full"] = batches["tg"], full
    return batches, saved


def bench(
    config: ml_collections.ConfigDict | None = None,
    *,
    batch_size: int = 64,
    seq_len: int = 384,
    steps: int = 5,
    seed: int = 0,
    arms: Sequence[str] = ("grpo", "tg", "tg_50pct", "tg_10pct", "tg_full"),
) -> dict[str, float]:
    """Times GRPO and the TG arms; prints and returns the timings, ratios and FLOPs saved.

    The arms run interleaved, one step each per round (the order reversed every other round,
    so that no arm always follows the same one), after one compile call each, so that a change
    in machine load during the run hits all alike. Two clocks: wall time, and
    the CPU time of this process (all its threads), which other processes on a shared machine
    do not inflate; on an accelerator only wall time means anything. Ratios are of medians.
    Keys: `<arm>_<clock>_s`, `ratio_<clock>` (the "tg" arm), `<arm>_ratio_<clock>` and
    `<arm>_teacher_flops_saved` for the other TG arms and "tg". `arms`: a subset to time
    ("grpo" and "tg" always among them); the printed line needs all five.
    """
    config = config if config is not None else bench_config()
    model = Transformer(ModelConfig.from_config(config.model))
    # One device: the step's time on this host's CPU. Simulated host devices (the tests' 8)
    # share its cores and add collectives whose order XLA's CPU runtime may interleave
    # differently per device (the 8-device bench step hung in a rendezvous under load).
    mesh = sharding.make_mesh(config.mesh, devices=jax.devices()[:1])
    rules = sharding.logical_rules(config.mesh)
    batches, saved = bench_batches(
        config, batch_size, seq_len, seed, sharding.batch_divisor(mesh, rules)
    )
    arms = ("grpo", "tg", *(a for a in arms if a not in ("grpo", "tg")))
    step_fns, states = {}, {}
    wall, cpu = {arm: [] for arm in arms}, {arm: [] for arm in arms}
    for arm in arms:
        batches[arm] = jax.device_put(batches[arm], sharding.data_sharding(mesh, rules, ndim=1))
        cfg = config_files.apply_overrides(config, {"tg.enabled": arm != "grpo"})
        optimizer = make_optimizer(cfg.optim)
        states[arm] = create_train_state(model, optimizer, mesh, rules, jax.random.key(seed))
        step_fns[arm] = make_train_step(cfg, model, mesh, rules)
        states[arm], metrics = step_fns[arm](states[arm], batches[arm])  # compile
        jax.block_until_ready(metrics)
    for r in range(steps):
        for arm in arms if r % 2 == 0 else arms[::-1]:
            start, start_cpu = time.perf_counter(), time.process_time()
            states[arm], metrics = step_fns[arm](states[arm], batches[arm])
            jax.block_until_ready((states[arm].params, metrics))
            wall[arm].append(time.perf_counter() - start)
            cpu[arm].append(time.process_time() - start_cpu)
    results = {}
    for clock, times in (("wall", wall), ("cpu", cpu)):
        for arm in arms:
            results[f"{arm}_{clock}_s"] = float(np.median(times[arm]))
        for arm in arms[1:]:
            ratio = results[f"{arm}_{clock}_s"] / results[f"grpo_{clock}_s"]
            results["ratio_" + clock if arm == "tg" else f"{arm}_ratio_{clock}"] = ratio
    for arm, value in saved.items():
        results[f"{arm}_teacher_flops_saved"] = value
    if len(arms) == 5:
        _print(results, batches, batch_size, seq_len, steps)
    return results


def share_figures(results: dict[str, float]) -> dict[str, float]:
    """The bench section's figures of the other arms: `tg_over_grpo_50pct` /
    `tg_over_grpo_10pct` (wall; `_cpu`: process CPU), `tg_full_over_grpo` (the uncompacted
    step) and `teacher_flops_saved[_50pct|_10pct]`."""
    out = {}
    for arm, suffix in (("tg_50pct", "_50pct"), ("tg_10pct", "_10pct"), ("tg_full", "")):
        name = "tg_full_over_grpo" if arm == "tg_full" else f"tg_over_grpo{suffix}"
        out[name] = results[f"{arm}_ratio_wall"]
        out[f"{name}_cpu"] = results[f"{arm}_ratio_cpu"]
    for arm, suffix in (("tg", ""), ("tg_50pct", "_50pct"), ("tg_10pct", "_10pct")):
        out[f"teacher_flops_saved{suffix}"] = results[f"{arm}_teacher_flops_saved"]
    return out


def _print(results, batches, batch_size, seq_len, steps) -> None:
    shapes = {a: batches[a].teacher_tokens_BtxTt.shape for a in ("tg_full", *FAIL_SHARES)}
    print(
        f"B={batch_size} T={seq_len} on {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s), median of {steps} interleaved steps; teacher "
        f"B_t x T_t: " + ", ".join(f"{a} {s[0]}x{s[1]}" for a, s in shapes.items())
    )
    for clock, name in (("wall", "wall"), ("cpu", "process CPU")):
        parts = [f"GRPO {results[f'grpo_{clock}_s']:.3f} s"]
        for arm in ("tg", "tg_50pct", "tg_10pct", "tg_full"):
            key = f"ratio_{clock}" if arm == "tg" else f"{arm}_ratio_{clock}"
            parts.append(f"{arm} {results[f'{arm}_{clock}_s']:.3f} s ({results[key]:.3f})")
        print(f"  {name}: " + ", ".join(parts))
    print(
        "  teacher FLOPs saved: "
        + ", ".join(f"{a} {results[f'{a}_teacher_flops_saved']:.2f}" for a in FAIL_SHARES)
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq_len", type=int, default=384)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    bench(batch_size=args.batch, seq_len=args.seq_len, steps=args.steps)


if __name__ == "__main__":
    main()
