"""Runs a tiny RL loop in its own process (tests/test_rl_loop.py kills and resumes it).

    python -m tests.rl_loop_driver WORKDIR [--async] [--arm tg|grpo] [--steps N] [--slow S]

--slow S sleeps S seconds before each rollout batch (deterministic mode only), so that a test
watching the checkpoints has time to kill the run in the middle of a later step.

Writes WORKDIR/final_params.npz (every param leaf by path) when the run finishes.
"""

from __future__ import annotations

import argparse
import time
import types

import jax
import ml_collections
import numpy as np

from tg_jax import config_files, config_lib
from tg_jax.envs.tasks import generate_tasks
from tg_jax.models import ModelConfig, Transformer, init_params
from tg_jax.sampling import loop
from tg_jax.train import rl

STEPS = 4


def make_config(arm: str = "tg", async_sampling: bool = False, steps: int = STEPS):
    """configs/tiny.py plus the RL sections, shrunk to seconds per step."""
    c = ml_collections.ConfigDict(config_files.load_config_file("configs/tiny.py").to_dict())
    if "rl" not in c:
        c.rl = config_lib.rl_config()
    if "tg" not in c:
        c.tg = config_lib.tg_config()
    if "optim" not in c:
        c.optim = config_lib.optim_config()
    c.tg.enabled = arm != "grpo"
    c.optim.lr = 1e-3  # large enough that every step visibly changes the params
    c.rl_loop = config_lib.tiny_loop_config(
        steps=steps, async_sampling=async_sampling, eval_every=2, eval_tasks=2, max_new_tokens=16
    )
    c.eval = config_lib.tiny_eval_config()
    return c


def make_sources(n: int = 16) -> dict[str, list[dict]]:
    return {s: [t.to_record() for t in generate_tasks(s, n, seed=0)] for s in ("train", "heldout")}


def batch_parts(config, student_max: int, teacher_max: int) -> types.SimpleNamespace:
    """What `rl._build_batch` reads of a run's parts (`rl_setup.Parts`), for a batch of `config`
    at these lengths on one device."""
    return types.SimpleNamespace(
        config=config, student_max=student_max, teacher_max=teacher_max, divisor=1,
        requirement_names=tuple(config.env.requirements),
    )  # fmt: skip


def initial_params(config):
    return init_params(Transformer(ModelConfig.from_config(config.model)), jax.random.key(0))


def flat_params(params) -> dict[str, np.ndarray]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(jax.device_get(params))
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    parser.add_argument("--async", dest="async_sampling", action="store_true")
    parser.add_argument("--arm", default="tg")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--slow", type=float, default=0.0)
    args = parser.parse_args()
    if args.slow > 0:
        get = loop.InlineLoop.get

        def slow_get(self, max_staleness, timeout=None):
            time.sleep(args.slow)
            return get(self, max_staleness, timeout)

        loop.InlineLoop.get = slow_get
    config = make_config(args.arm, args.async_sampling, args.steps)
    result = rl.run_rl(
        config, args.workdir, initial_params(config), arm_name=args.arm, seed=0,
        sources=make_sources(),
    )  # fmt: skip
    if result.finished:
        np.savez(f"{args.workdir}/final_params.npz", **flat_params(result.state.params))
    print(f"driver: step {result.step} finished {result.finished}", flush=True)


if __name__ == "__main__":
    main()
