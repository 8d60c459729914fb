"""Config sections of the data and SFT stages: tasks, environment, SFT (incl. its evaluation).

The model, mesh, RL, TG and optimizer sections live in `tg_jax.config_lib`; config files
(`configs/*.py`) assemble all of them. Defaults here are those of the embedded default run
(configs/default.py); configs/tiny.py shrinks them for tests.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from tg_jax import config_lib
from tg_jax.envs import tasks as tasks_lib


def tasks_config(**overrides: Any) -> ml_collections.ConfigDict:
    """The task sets of the data stage (written as TFDS datasets into the workdir)."""
    c = ml_collections.ConfigDict()
    c.seed = 0  # task generation seed (train and held-out sets are disjoint by function)
    c.num_train = 2048  # RL training tasks (train split)
    c.num_heldout = 256  # evaluation tasks (held-out split: functions never seen in training)
    # Hidden-function families (tg_jax.envs.tasks): the one-parameter EASY_FAMILIES, whose
    # constant is copied from f(0), put a minutes-of-CPU byte model's pass rate in the
    # 0.2-0.6 band; HARD_FAMILIES (slopes to compute) leave it below 0.1.
    c.families = tasks_lib.EASY_FAMILIES
    c.update(overrides)
    return c


def env_config(**overrides: Any) -> ml_collections.ConfigDict:
    """The coding environment (tg_jax.envs.coding.CodingEnvConfig fields)."""
    c = ml_collections.ConfigDict()
    # Requirements the policy is judged on and TG teaches. Both: the SFT base model follows
    # each hint (held-out hinted compliance 0.98 fence / 0.99 tool_json at temperature 1) and
    # never meets either unprompted (0.00), at no extra SFT cost.
    c.requirements = ("fence", "tool_json")
    c.max_turns = 3  # assistant turns before an episode ends without a submission
    c.task_reward = "all_pass"  # all_pass (1 iff every hidden test passes) | fraction
    c.requirement_reward = "fraction"  # fraction of applicable turns meeting it | all
    c.requirement_weight = 1.0  # weight of each requirement reward in the weighted total
    c.executor = "sandbox"  # sandbox (model outputs) | trusted (in-process, our own code only)
    c.timeout_s = 1.0  # sandbox wall-clock limit per tool call
    c.cpu_s = 1  # sandbox CPU-seconds limit per tool call
    c.memory_mb = 256  # sandbox address-space limit per tool call
    c.update(overrides)
    return c


def transcripts_config(**overrides: Any) -> ml_collections.ConfigDict:
    """Knobs of the synthetic expert (tg_jax.envs.transcripts.TranscriptConfig fields)."""
    c = ml_collections.ConfigDict()
    c.p_correct = 0.7  # share of correct final answers: caps the temperature-1 pass rate
    c.p_hinted = 0.3  # share of hinted transcripts (hints followed; unhinted never comply)
    c.p_hint_requirement = 0.7  # per applicable requirement, chance it is hinted in a turn
    c.p_ignore_hint = 0.0  # chance a hinted requirement is not followed in its turn
    c.p_multi_turn = 0.5  # run_tests -> observation -> revise/submit (else one submit turn)
    c.p_fix = 0.3  # multi-turn: first attempt is a wrong guess revised after the observation
    c.p_retest = 0.5  # after a revision, run the tests again before submitting
    c.p_think = 1.0  # code turns open with a <think> block naming the family (a first step)
    c.max_chars = 800  # redraw transcripts whose contents sum to more (long ones stay in)
    c.update(overrides)
    return c


def sft_config(steps: int = 3000, **overrides: Any) -> ml_collections.ConfigDict:
    """SFT of the base model: data, batches, optimizer, checkpoints, evaluation.

    Why many small steps: the byte model first learns the format (loss ~0.1 after ~100
    steps), then plateaus until attention learns to copy numbers out of the prompt; that
    takes optimizer steps, not tokens (B=12 x 170 steps and B=6 x 350 steps stayed on the
    plateau; B=2 copied f(0) by ~1000 steps at the same compute).
    """
    c = ml_collections.ConfigDict()
    c.steps = steps  # train steps
    c.batch_size = 2  # packed rows per step (a multiple of the mesh's batch split)
    # Tokens per packed row (<= model.max_seq_len); attention cost grows with it, and longer
    # transcripts (< 0.5% at max_chars 800) are left out.
    c.seq_len = 512
    c.num_transcripts = 12_000  # expert transcripts, one per drawn train task (~1 epoch)
    c.data_seed = 1  # seed of the SFT tasks, transcripts, packing and batch order
    # Requirements whose hints appear in the SFT transcripts (the hints the base model learns
    # to follow); empty = env.requirements. RL judges and teaches env.requirements only.
    c.hint_requirements = ()
    c.transcripts = transcripts_config()  # the synthetic expert's knobs
    c.optim = config_lib.optim_config(
        lr=5e-3, weight_decay=0.01, schedule="warmup_cosine", warmup_steps=50, end_lr_fraction=0.05
    )  # AdamW + warmup-cosine
    c.optim.total_steps = c.get_ref("steps")  # the cosine ends with SFT (follows sft.steps)
    c.log_every = 100  # progress-line interval when not on a TTY
    c.checkpoint_every = 500  # checkpoint interval in steps (the last step is always saved)
    c.eval = sft_eval_config()  # the base-model evaluation written to sft_eval.json
    c.select = sft_select_config()  # model selection on dev tasks (tg_jax.train.sft_select)
    c.update(overrides)
    return c


def sft_select_config(**overrides: Any) -> ml_collections.ConfigDict:
    """Model selection during SFT on dev tasks of the train split (tg_jax.train.sft_select)."""
    c = ml_collections.ConfigDict()
    c.enabled = True  # False: the last SFT step is the base model
    c.every = 250  # steps between dev evaluations
    c.start = 1000  # first step evaluated
    c.num_tasks = 64  # dev tasks per evaluation (train-split functions, never held-out)
    c.seed = 7  # seed of the dev tasks and their sampling
    c.max_new_tokens = 128  # decode budget per assistant turn
    c.pass_rate_max = 0.6  # eligible up to this temperature-1 dev pass rate
    c.unprompted_max = 0.02  # eligible if unprompted compliance <= this (every requirement)
    c.hinted_min = 0.95  # eligible if hinted compliance >= this (every requirement)
    c.update(overrides)
    return c


def sft_eval_config(**overrides: Any) -> ml_collections.ConfigDict:
    """Base-model evaluation on held-out tasks (pass rate, unprompted/hinted compliance)."""
    c = ml_collections.ConfigDict()
    c.num_tasks = 128  # held-out tasks per evaluation mode
    c.seed = 0  # sampling seed
    c.temperatures = (1.0, 0.0)  # 1.0 = the RL sampling temperature, 0.0 = greedy
    c.max_new_tokens = 128  # decode budget per assistant turn
    c.update(overrides)
    return c
