"""The `rl_loop` and `pipeline` sections of a run config, declared once (`tg_jax.config_schema`):
`LoopConfig` (with `FeedbackConfig`) drives `tg_jax.train.rl`, `PipelineConfig` (with
`TuneConfig`) the main job (`tg_jax.train.pipeline`, `tg_jax.train.tuning`). The start-up check
(`tg_jax.main`) reads both back, so a bad value is an error before any stage runs."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import ClassVar

from tg_jax.config_schema import Section
from tg_jax.sampling.agent_loop import check_engine


def _at_least(section: str, cfg: Section, bounds: dict[str, float]) -> None:
    for name, bound in bounds.items():
        if getattr(cfg, name) < bound:
            raise ValueError(f"{section}.{name} must be >= {bound}, got {getattr(cfg, name)}")


@dataclasses.dataclass(frozen=True)
class FeedbackConfig(Section):
    """`rl_loop.feedback`: imperfect feedback for the teacher's hints, and a judge that errs."""

    section: ClassVar[str] = "rl_loop.feedback"

    correct: float = 1.0
    """Share of failed turns whose hint is the correct one."""
    irrelevant: float = 0.0
    """Share shown true-sounding advice unrelated to the requirement."""
    wrong: float = 0.0
    """Share shown a hint pointing at a different format."""
    false_positive: float = 0.0
    """Share of failed turns the training judge calls met (`tg_jax.envs.hints.VerdictNoise`;
    the held-out evaluation judges truly)."""
    false_negative: float = 0.0
    """Share of met turns the training judge calls failed."""

    def __post_init__(self):
        for name in ("correct", "irrelevant", "wrong", "false_positive", "false_negative"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{self.section}.{name} must be in [0, 1], got {self}")


@dataclasses.dataclass(frozen=True)
class LoopConfig(Section):
    """`rl_loop`: steps, rollout groups, sampling, evaluation, checkpoints, feedback quality."""

    section: ClassVar[str] = "rl_loop"

    steps: int = 100
    """RL train steps (one policy update each)."""
    epochs: float = 0.0
    """Passes over the train tasks the run makes (0 = not declared). When set, steps x
    groups_per_step must equal epochs x the train tasks (checked once the tasks are known)."""
    groups_per_step: int = 8
    """N tasks per step (GRPO groups)."""
    rollouts_per_group: int = 8
    """G rollouts of the same task per group."""
    max_new_tokens: int = 128
    """Decode budget per assistant turn."""
    hide_thinking: bool = False
    """Hidden planning text: each assistant turn sees the episode without the <think> blocks of
    earlier turns, in the RL rollouts and every evaluation (each turn's context prefilled
    afresh); the trainer takes one row per turn in its own context
    (`tg_jax.rl.hidden_thinking`: a step's rows = episodes x env.max_turns). Needs a template
    with thinking and a bounded episode; not with model.router_replay."""
    think_budget: int = 0
    """Reasoning-length budget: the most tokens of an assistant turn's <think> block the policy
    samples, its opening tag included (0 = no limit). A block still open after them is closed
    by a </think> the policy did not sample (never trained on) and the turn goes on to its
    answer, in the RL rollouts and every evaluation. Needs a rollout engine ("builtin" or
    "vllm": the turn is sampled in two requests) and a template with thinking; not with
    hide_thinking or model.router_replay."""
    seq_len: int = 0
    """Padded student length T of a batch; 0 = model.max_seq_len."""
    length_multiple: int = 64
    """Batch T is rounded up to a multiple of this (0 = always seq_len)."""
    async_sampling: bool = True
    """Sampling loop in its own thread; False = deterministic, in-line."""
    env_workers: int = 2
    """Threads running one turn's tool calls (env.step) at once (more pays where a call waits
    long, e.g. a SWE task's pytest; docs/experiments.md)."""
    queue_size: int = 1
    """Rollout groups sampled ahead (more: less waiting, more stale drops)."""
    rollout_engine: str = "builtin"
    """Who plays the episodes (RL rollouts and held-out evaluation): "builtin" = one agent loop
    per episode on the continuous-batching engine over a paged KV pool
    (`tg_jax.sampling.agent_loop`, `tg_jax.engine`); "lockstep" = every turn of every live
    episode in one sampler call (`tg_jax.sampling.rollout`; a run whose saved config predates
    this field resumes with it); "vllm" = the same agent loops on vLLM in this process
    (`tg_jax.engine.vllm_engine`: the `.[vllm]` extra; the trainer's params are loaded into it
    at each call, no disk)."""
    engine_slots: int = 0
    """"builtin": episodes decoded at once (0 = every episode of a call); "vllm": vLLM's
    max_num_seqs (0 = groups_per_step x rollouts_per_group)."""
    engine_page_size: int = 16
    """"builtin": tokens per KV page."""
    engine_decode_steps: int = 1
    """"builtin": tokens a decode call draws per sequence at most (one host round trip per
    call; a sequence that stops early idles for the rest of the call; docs/benchmarks.md)."""
    engine_kv_tokens: int = 0
    """"builtin": the KV pool's size in tokens over all sequences (0 = every slot at its whole
    context, so nothing is ever preempted; less: when the live tokens outgrow it, the newest
    sequence is preempted and requeued). A pod config sets what its chips hold
    (`python -m tg_jax.tpu.aot --what=engine`)."""
    engine_min_bucket: int = 0
    """"builtin": the smallest decode-rows and page-table-width bucket (0 = the engine's
    `MIN_BUCKET`, 16; 1 = every power of two). Each bucket pair compiles the whole model and
    a smaller call is padded: on a CPU a model of some size decodes faster from 1
    (docs/benchmarks.md), at the price of more compilations (docs/results.md, 2026-12-05)."""
    self_tests: bool = True
    """Before a fresh run's first step, check on its first rollout group that the trainer's
    log-probs do not move with the batch around a row, that the teacher sees a hint where the
    chat template places it, and that the sampler's behaviour log-probs match the trainer's
    (`tg_jax.train.self_tests`; ~1 s on configs/tiny.py); a drift beyond tolerance stops the
    run with one `error:` line."""
    check_fit: bool = True
    """On a TPU backend, compile the train step and the sampler's call at start-up and refuse a
    config whose per-chip memory exceeds the chips' (`tg_jax.tpu.fit`; costs the compiles)."""
    data_seed: int = 0
    """Task order of the train split (the run seed is folded in)."""
    eval_every: int = 25
    """Periodic evaluation interval in steps (0 = off; the last step too)."""
    eval_tasks: int = 32
    """Dev tasks of the periodic evaluation (plain prompts, 1 sample): never the held-out
    ones, which only the final evaluation reads (`tg_jax.evaluation.heldout_reads`)."""
    eval_task_seed: int = 9
    """Their generation seed (`task_data.dev_tasks`)."""
    checkpoint_every: int = 25
    """Checkpoint interval in steps (the last step is always saved)."""
    keep_checkpoints: int = 2
    """Checkpoints kept (keep-N)."""
    export_every: int = 0
    """Also export the policy as a Hugging Face checkpoint directory every N steps, to
    <run>/export/step_<N> (0 = off; the main job always exports the final policy)."""
    dump_rollouts: bool = False
    """Write every step's batch (tokens, behaviour log-probs, verdicts, hints, the TG mask,
    rewards, advantages) to <run>/rollouts/step_<N>.array_record (tg_jax.train.rollout_dump);
    `python -m tg_jax.replay` re-scores a step under a checkpoint."""
    profile_steps: tuple[int, ...] = ()
    """(first, last): RL steps (1-based, inclusive) traced with the JAX profiler to
    <run>/profile, for TensorBoard's profile plugin or Perfetto: device time per program, each
    step marked ("rl_step"); () = off. A few steps: a trace holds every op."""
    log_every: int = 10
    """Progress-line interval when stdout is not a TTY."""
    use_tensorboard: bool = True
    """TensorBoard event files next to metrics.jsonl."""
    wandb_project: str = ""
    """A Weights & Biases project the RL metrics also go to ("" = none; the `wandb` extra):
    one wandb run per arm and seed, named <arm>_seed<seed>, with the run's config; a resumed
    run continues the same wandb run (its id derives from the workdir)."""
    feedback: FeedbackConfig = FeedbackConfig()
    """Imperfect feedback for the teacher's hints."""

    def __post_init__(self):
        _at_least(
            self.section,
            self,
            dict(
                steps=1,
                groups_per_step=1,
                rollouts_per_group=1,
                max_new_tokens=1,
                seq_len=0,
                length_multiple=0,
                env_workers=1,
                queue_size=0,
                engine_slots=0,
                engine_page_size=1,
                engine_decode_steps=1,
                engine_kv_tokens=0,
                engine_min_bucket=0,
                eval_every=0,
                eval_tasks=0,
                checkpoint_every=0,
                keep_checkpoints=1,
                export_every=0,
                log_every=1,
                think_budget=0,
            ),
        )
        if self.epochs < 0:
            raise ValueError(f"rl_loop.epochs must be >= 0 (0 = not checked), got {self.epochs}")
        p = self.profile_steps
        if p and not (len(p) == 2 and 1 <= p[0] <= p[1]):
            raise ValueError(
                f"rl_loop.profile_steps must be () or (first, last) with 1 <= first <= last, "
                f"got {p}"
            )
        check_engine(self.rollout_engine)
        if self.wandb_project and importlib.util.find_spec("wandb") is None:
            raise ValueError(
                f"rl_loop.wandb_project {self.wandb_project!r} needs wandb: pip install "
                "'tg_jax[wandb]', or set rl_loop.wandb_project=''"
            )
        if self.think_budget and self.rollout_engine == "lockstep":
            raise ValueError(
                "rl_loop.think_budget needs rl_loop.rollout_engine 'builtin' or 'vllm' (a turn "
                "sampled in two requests), not 'lockstep'"
            )
        if self.think_budget and self.hide_thinking:
            raise ValueError(
                "rl_loop.think_budget with rl_loop.hide_thinking: the </think> the rollout "
                "appends would stay in the later turns' context; choose one"
            )


@dataclasses.dataclass(frozen=True)
class TuneConfig(Section):
    """`pipeline.tune`: learning-rate trials, the same for every arm (`tg_jax.train.tuning`):
    each arm trains once per rate on the train split minus a validation split, is scored there,
    and its eval.train_seeds runs use its best rate."""

    section: ClassVar[str] = "pipeline.tune"

    lrs: tuple[float, ...] = ()
    """Learning rates tried per arm, e.g. (1e-4, 3e-4, 1e-3); () = no trials: every arm at
    optim.lr."""
    seed: int = 1000
    """Training seed of the trials (not one of eval.train_seeds)."""
    val_tasks: int = 128
    """Last tasks of the train split: the trials' validation split."""
    samples_per_task: int = 2
    """Validation episodes per task (plain prompts)."""


@dataclasses.dataclass(frozen=True)
class PipelineConfig(Section):
    """`pipeline`: the main job's arms and their learning-rate selection."""

    section: ClassVar[str] = "pipeline"

    arms: tuple[str, ...] = ("grpo", "tg")
    """RL arms (`tg_jax.train.pipeline.ARMS`), the same budget each."""
    tune: TuneConfig = TuneConfig()
    """Learning-rate trials (none by default)."""
    sitting: tuple[str, ...] = ()
    """The runs of this sitting, e.g. ("tg_seed1",) or ("base",) (empty: every run and the
    report). A registered attempt longer than one sitting runs its (arm, seed) pairs a few at a
    time, each written to docs/ledger/<claim>/<attempt>/ (commit each file); no report is
    written until a sitting runs them all: `python -m tg_jax.evaluation.verdict
    --attempt=ID` decides from the ledger. Not part of the pre-registration."""

    def __post_init__(self):
        if not self.arms or len(set(self.arms)) != len(self.arms):
            raise ValueError(f"pipeline.arms must be distinct and not empty, got {self.arms}")
        if len(set(self.sitting)) != len(self.sitting):
            raise ValueError(f"pipeline.sitting names a run twice: {self.sitting}")


__all__ = ["FeedbackConfig", "LoopConfig", "PipelineConfig", "TuneConfig"]
