"""Config sections of the RL loop (`tg_jax.train.rl`) and the held-out evaluation / report.

GRPO, TG and optimizer fields live in `tg_jax.config_lib` (rl_config, tg_config,
optim_config); config files assemble everything, e.g. in configs/default.py::

    c.rl_loop = rl_config.loop_config()
    c.eval = rl_config.eval_config()

Defaults are those of the embedded CPU run; `tiny_loop_config` / `tiny_eval_config` shrink them
for tests.
"""

from __future__ import annotations

from typing import Any

import ml_collections


def loop_config(**overrides: Any) -> ml_collections.ConfigDict:
    """The RL loop: steps, rollout groups, sampling, evaluation, checkpoints, feedback quality."""
    c = ml_collections.ConfigDict()
    c.steps = 100  # RL train steps (one policy update each)
    c.groups_per_step = 8  # N tasks per step (GRPO groups)
    c.rollouts_per_group = 8  # G rollouts of the same task per group
    c.max_new_tokens = 128  # decode budget per assistant turn
    c.seq_len = 0  # padded student length T of a batch; 0 = model.max_seq_len
    c.length_multiple = 64  # batch T is rounded up to a multiple of this (0 = always seq_len)
    c.async_sampling = True  # sampling loop in its own thread; False = deterministic, in-line
    c.queue_size = 1  # rollout groups sampled ahead (more: less waiting, more stale drops)
    c.data_seed = 0  # task order of the train split (the run seed is folded in)
    c.eval_every = 25  # periodic held-out evaluation interval in steps (0 = off; last step too)
    c.eval_tasks = 32  # held-out tasks of the periodic evaluation (plain prompts, 1 sample)
    c.checkpoint_every = 25  # checkpoint interval in steps (the last step is always saved)
    c.keep_checkpoints = 2  # checkpoints kept (keep-N)
    c.log_every = 10  # progress-line interval when stdout is not a TTY
    c.use_tensorboard = True  # TensorBoard event files next to metrics.jsonl
    c.feedback = ml_collections.ConfigDict()  # imperfect feedback for teacher hints
    c.feedback.correct = 1.0  # share of failed turns whose hint is the correct one
    c.feedback.irrelevant = 0.0  # share shown true-sounding advice unrelated to the requirement
    c.feedback.wrong = 0.0  # share shown a hint pointing at a different format
    c.update(overrides)
    return c


def tiny_loop_config(**overrides: Any) -> ml_collections.ConfigDict:
    """A loop that runs a few steps in seconds on CPU (tests)."""
    c = loop_config(
        steps=4, groups_per_step=2, rollouts_per_group=2, max_new_tokens=24, length_multiple=0,
        eval_every=2, eval_tasks=4, checkpoint_every=1, keep_checkpoints=2, log_every=1,
        use_tensorboard=False,
    )  # fmt: skip
    c.update(overrides)
    return c


def eval_config(**overrides: Any) -> ml_collections.ConfigDict:
    """Final held-out evaluation, arms and seeds, statistics and the non-inferiority margin.

    The margin and the interval that decides non-inferiority are fixed here, before any run
    (DESIGN.md section 4; see tg_jax.evaluation.stats for the exact interval).
    """
    c = ml_collections.ConfigDict()
    c.num_tasks = 128  # held-out tasks (never used in training); the bootstrap unit
    c.samples_per_task = 2  # episodes per task and condition (averaged per task first)
    c.temperature = 1.0  # sampling temperature (the RL sampling temperature)
    c.max_new_tokens = 128  # decode budget per assistant turn
    c.conditions = ("plain", "hinted")  # plain prompts; hinted = hint before every turn
    c.sampling_seed = 1234  # sampling key of the evaluation (same for every arm and seed)
    c.train_seeds = (0, 1, 2)  # training seeds per arm (the seed spread is reported apart)
    c.baseline = "grpo"  # arm every other arm is compared with
    c.candidate = "tg"  # arm whose non-inferiority is the headline verdict
    c.margin = -0.05  # allowed drop in held-out task success, candidate - baseline (<= 0)
    c.ni_interval = "paired_bootstrap"  # interval deciding NI: paired_bootstrap | seed_t
    c.floor = 0.1  # baseline held-out task success under which NI is "not meaningful"
    c.level = 0.95  # two-sided coverage of every interval (bootstrap and t)
    c.n_boot = 10_000  # bootstrap replicates
    c.bootstrap_seed = 0  # numpy seed of the bootstrap
    c.last_k = 32  # training steps of the Table 1 style mean +- std (not a CI)
    c.update(overrides)
    return c


def tiny_eval_config(**overrides: Any) -> ml_collections.ConfigDict:
    """A held-out evaluation that runs in seconds on CPU (tests)."""
    c = eval_config(
        num_tasks=4, samples_per_task=1, max_new_tokens=24, train_seeds=(0,), n_boot=200,
        last_k=2,
    )  # fmt: skip
    c.update(overrides)
    return c
