"""The config sections the train step and its losses read: `rl`, `tg` (and its `schedule`)
and `optim`, each declared once here (`tg_jax.config_schema`: the command line's ConfigDicts
are generated from these dataclasses and read back into them, checked, once, at the
boundary; jitted code reads plain Python values). "0 = off" switches of the ConfigDicts are
None here (tis_cap, dual_clip, norm_length, top_k, grad_clip_norm).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

from tg_jax.config_schema import Section, off, pairs

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
NONFINITE_POLICIES = ("skip", "stop")
ADVANTAGE_MODES = ("grpo", "dr_grpo")
REWARD_NORMS = ("combined", "per_reward")
REQUIREMENT_CREDITS = ("episode", "turn")
DIVERGENCES = ("reverse", "forward", "jsd")
ESTIMATORS = ("full", "sampled")
GATES = ("failed_turns", "all_turns")
TEACHER_MODES = ("per_trajectory", "per_turn")
TEACHER_PARAMS = ("policy", "reference")
TG_NORMALIZE = ("token_mean", "token_sum")
DISTILL_BUDGETS = ("all", "answer_tokens")
TG_SPANS = ("turn", "to_break")
LAMBDA_KINDS = ("constant", "linear_warmup", "cosine")
TG_METHODS = ("tg", "sdpo", "opsd", "sdar", "sgcd")
PEER_ESTIMATORS = ("full", "topk", "sampled")
LR_SCHEDULES = ("constant", "warmup_cosine")


def _check_choice(section: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{section}.{name} must be one of {', '.join(choices)}; got {value!r}")


def _check(ok: bool, section: str, name: str, want: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{section}.{name} must be {want}; got {value!r}")


@dataclasses.dataclass(frozen=True)
class RLConfig(Section):
    """GRPO: advantages, the clipped surrogate, aggregation, reference KL, micro-batches, and
    the PPO update phase (epochs x minibatches)."""

    section: ClassVar[str] = "rl"

    advantage_mode: str = "grpo"
    """grpo (divide by the group std) | dr_grpo (do not)."""
    adv_eps: float = 1e-6
    """Added to the group std before dividing."""
    reward_norm: str = "combined"
    """combined (normalise the weighted reward sum in its group) | per_reward (normalise each
    reward component in its group, then weight and sum; `tg_jax.rl.advantages`)."""
    reward_weights: tuple[tuple[str, float], ...] = pairs((("task", 1.0),))
    """(reward component, weight) pairs of the combined reward."""
    requirement_credit: str = "episode"
    """episode (requirement rewards in the episode's reward) | turn (each requirement signal
    credited to the turn it judged; `tg_jax.rl.advantages.turn_advantages`)."""
    clip_low: float = 0.2
    """The PPO ratio is clipped below at 1 - clip_low."""
    clip_high: float = 0.28
    """The PPO ratio is clipped above at 1 + clip_high (clip-higher)."""
    dual_clip: float | None = off()
    """Dual-clip constant c > 1 for negative advantages; None = off."""
    tis_cap: float | None = off()
    """Truncated IS cap on pi_prox / pi_b (pi_prox = the params at the start of the update
    phase); None = off (with decoupled updates: the weight is not capped)."""
    agg_mode: str = "token_mean"
    """token_mean | seq_mean_token_mean | seq_mean_token_sum_norm."""
    norm_length: int | None = off()
    """L of seq_mean_token_sum_norm; None = the padded T."""
    kl_coef: float = 0.0
    """Weight of the KL to a frozen reference policy; 0 = no reference forward."""
    kl_estimator: str = "k3"
    """k1 | k2 | k3 per-token estimator of KL(pi_theta || pi_ref)."""
    temperature: float = 1.0
    """Sampling temperature: trainer logits are divided by it."""
    max_staleness: int = 1
    """Rollouts more than this many policy versions old are refused (read by the loop)."""
    micro_batches: int = 1
    """Gradient accumulation steps inside one optimizer update."""
    num_updates: int = 1
    """Epochs of the PPO update phase over one rollout batch."""
    num_minibatches: int = 1
    """Minibatches per epoch, one optimizer update each (of micro_batches micro-batches)."""
    nonfinite: str = "skip"
    """A step with a non-finite loss or gradient keeps its params; then skip (go on) | stop
    (the run ends with an error). The host policy of `tg_jax.train.rl`."""
    nonfinite_limit: int = 3
    """Non-finite steps in a row after which a skip-mode run ends with an error."""

    @property
    def num_chunks(self) -> int:
        """K: the batch is laid out (`build_batch(micro_batches=K)`) in minibatches x micro."""
        return self.num_minibatches * self.micro_batches

    @property
    def decoupled(self) -> bool:
        """More than one optimizer update per rollout batch: decoupled PPO (`ppo_updates`)."""
        return self.num_updates * self.num_minibatches > 1

    def __post_init__(self):
        s = "rl"
        _check_choice(s, "advantage_mode", self.advantage_mode, ADVANTAGE_MODES)
        _check_choice(s, "reward_norm", self.reward_norm, REWARD_NORMS)
        _check_choice(s, "requirement_credit", self.requirement_credit, REQUIREMENT_CREDITS)
        _check_choice(s, "agg_mode", self.agg_mode, AGG_MODES)
        _check_choice(s, "kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _check_choice(s, "nonfinite", self.nonfinite, NONFINITE_POLICIES)
        _check(self.nonfinite_limit >= 1, s, "nonfinite_limit", ">= 1", self.nonfinite_limit)
        _check(self.adv_eps >= 0, s, "adv_eps", ">= 0", self.adv_eps)
        _check(0 <= self.clip_low < 1, s, "clip_low", "in [0, 1)", self.clip_low)
        _check(self.clip_high >= 0, s, "clip_high", ">= 0", self.clip_high)
        dual = self.dual_clip
        _check(dual is None or dual > 1, s, "dual_clip", "> 1 (or 0 = off)", dual)
        _check(self.tis_cap is None or self.tis_cap > 0, s, "tis_cap", "> 0", self.tis_cap)
        norm = self.norm_length
        _check(norm is None or norm > 0, s, "norm_length", "> 0 (or 0 = padded T)", norm)
        _check(self.kl_coef >= 0, s, "kl_coef", ">= 0", self.kl_coef)
        _check(self.temperature > 0, s, "temperature", "> 0", self.temperature)
        _check(self.max_staleness >= 0, s, "max_staleness", ">= 0", self.max_staleness)
        _check(self.micro_batches >= 1, s, "micro_batches", ">= 1", self.micro_batches)
        _check(self.num_updates >= 1, s, "num_updates", ">= 1", self.num_updates)
        _check(self.num_minibatches >= 1, s, "num_minibatches", ">= 1", self.num_minibatches)

    def check_rows(self, num_rows: int, divisor: int) -> None:
        """Raises unless `num_rows` rollouts split into num_minibatches equal minibatches of
        micro_batches micro-batches whose rows are a multiple of the mesh's batch `divisor`
        (static shapes; with one minibatch the batch is padded instead, as before)."""
        if self.num_minibatches == 1:
            return
        unit = self.num_minibatches * self.micro_batches * divisor
        if num_rows % unit:
            raise ValueError(
                f"rl.num_minibatches={self.num_minibatches}: the {num_rows} rollout rows per "
                f"step must split into {self.num_minibatches} minibatches of "
                f"rl.micro_batches={self.micro_batches} micro-batches of a multiple of the "
                f"mesh's batch divisor {divisor} rows (rows a multiple of {unit})"
            )

    def credit_split(self, requirement_names: Sequence[str]) -> tuple[list[str], dict]:
        """With requirement_credit "turn": (the weighted requirement rewards among
        `requirement_names`, the other weights); raises unless both are non-empty."""
        weights = dict(self.reward_weights)
        req = [k for k in weights if k in requirement_names]
        episode = {k: w for k, w in weights.items() if k not in req}
        if not req or not episode:
            raise ValueError(
                "rl.requirement_credit 'turn' needs a requirement reward and another reward in "
                f"rl.reward_weights (requirements {list(requirement_names)}, weights "
                f"{sorted(weights)})"
            )
        return req, episode


@dataclasses.dataclass(frozen=True)
class LambdaSchedule(Section):
    """The shape of tg.lambda_tg over the train steps (`tg_jax.rl.tg.loss.lambda_tg`)."""

    section: ClassVar[str] = "tg.schedule"

    kind: str = "constant"
    """constant | linear_warmup | cosine."""
    warmup_steps: int = 0
    """Linear ramp 0 -> tg.lambda_tg over these steps (linear_warmup and cosine)."""
    decay_steps: int = 1000
    """Cosine: steps after the warmup to decay from tg.lambda_tg to final_value."""
    final_value: float = 0.0
    """Cosine: lambda_tg after the decay."""

    def __post_init__(self):
        s = "tg.schedule"
        _check_choice(s, "kind", self.kind, LAMBDA_KINDS)
        _check(self.warmup_steps >= 0, s, "warmup_steps", ">= 0", self.warmup_steps)
        if self.kind == "cosine":
            _check(self.decay_steps > 0, s, "decay_steps", "> 0 for cosine", self.decay_steps)


@dataclasses.dataclass(frozen=True)
class TGConfig(Section):
    """Targeted guidance: divergence, estimator, gating, chunking, lambda_tg and its schedule;
    tg.method picks TG or a peer's method on the same teacher path (`tg_jax.rl.peers`)."""

    section: ClassVar[str] = "tg"

    enabled: bool = True
    """False = the GRPO arm: no teacher forward, no TG term."""
    kind: str = "forward"
    """forward | reverse | jsd: KL(sg p_teacher || p_student) (the default: its gradient,
    p_student - p_teacher, does not vanish where the two distributions are near-disjoint, as
    they are at the token that decides a format; docs/design.md), KL(p_student || sg p_teacher),
    or JSD(beta)."""
    beta: float = 0.5
    """Teacher weight of the JSD mixture, in (0, 1) for jsd."""
    estimator: str = "full"
    """full (whole vocabulary) | sampled (produced token only)."""
    top_k: int | None = off()
    """Full estimator over the student's top-k tokens + a tail bucket; None = full vocab."""
    gate: str = "failed_turns"
    """failed_turns | all_turns: which turns get hints and distillation (read by batch
    building: the TG mask M, tg_jax.rl.tg.mask)."""
    include_thinking: bool = False
    """Also distil the <think> tokens of the selected turns (read by batch building)."""
    teacher_mode: str = "per_trajectory"
    """per_trajectory (hints before every failed turn) | per_turn (read by batch building)."""
    max_teacher_rows: int = 64
    """per_turn: teacher rows per batch (static), extra turns dropped."""
    teacher_params: str = "policy"
    """policy (the current params, hint in context) | reference (the frozen reference params
    the step takes as its third argument: the RL start params)."""
    compact: bool = True
    """Compact teacher rows (read by batch building: tg_jax.rl.tg.compact); only with the policy
    teacher (`compact_rows`)."""
    mask_hint_copies: bool = False
    """Leave out of the TG KL the student tokens that copy their turn's hint (read by batch
    building, tg_jax.rl.tg.hint_copies)."""
    distill_budget: str = "all"
    """all | answer_tokens: with include_thinking, distil per step at most as many tokens as
    the answer tokens of the targeted turns, a random subset of answer + thinking tokens (read
    by batch building, tg_jax.rl.tg.distill_budget): the thinking-token control at an equal
    distilled-token budget."""
    span: str = "turn"
    """turn | to_break: distil a targeted turn whole, or only up to and including the token
    that breaks its requirement (read by batch building, tg_jax.rl.tg.break_span)."""
    chunk_size: int = 256
    """Positions per chunk of the full-vocabulary logits / KL."""
    normalize: str = "token_sum"
    """token_sum: sum_M D / (trajectories x norm_length) (a distilled token's weight does not
    depend on how many others are distilled) | token_mean: sum_M D / |M|."""
    norm_length: float = 50.0
    """token_sum: tokens per trajectory the sum is normalised by (> 0)."""
    lambda_tg: float = 0.05
    """lambda_tg, the weight of the TG term: L = L_GRPO + lambda_tg * L_TG (its peak with a
    tg.schedule other than constant)."""
    schedule: LambdaSchedule = LambdaSchedule()
    """The shape of lambda_tg over the steps."""
    method: str = "tg"
    """tg | sdpo | opsd | sdar | sgcd: the loss on the shared teacher path (tg_jax.rl.peers);
    sdpo and opsd distil every turn (need gate all_turns). Ignored when enabled is False."""
    peer_weight: float = 0.5
    """sdpo: w of L = (1 - w) L_GRPO + w L_distill, in [0, 1] (replaces lambda_tg)."""
    peer_estimator: str = "full"
    """sdpo: full (whole-vocabulary divergence of tg.kind) | topk (over the teacher's top
    peer_top_k tokens, both distributions renormalised) | sampled (log p_s(y) - log p_t(y))."""
    peer_top_k: int = 16
    """sdpo topk: the teacher's top-k tokens the divergence is restricted to."""
    sdar_beta: float = 5.0
    """sdar: slope of the token gate sigmoid(beta (gap - tau)), gap = log p_t(y) - log p_s(y)."""
    sdar_tau: float = 0.0
    """sdar: threshold of the token gate."""
    sgcd_alpha: float = 0.5
    """sgcd: advantage reweighting A' = A clip(1 + alpha tanh(gap), 1 - c, 1 + c)."""
    sgcd_clip: float = 0.2
    """sgcd: c of that clip, in [0, 1]."""

    def __post_init__(self):
        s = "tg"
        _check_choice(s, "kind", self.kind, DIVERGENCES)
        _check_choice(s, "estimator", self.estimator, ESTIMATORS)
        _check_choice(s, "gate", self.gate, GATES)
        _check_choice(s, "teacher_mode", self.teacher_mode, TEACHER_MODES)
        _check_choice(s, "teacher_params", self.teacher_params, TEACHER_PARAMS)
        _check_choice(s, "normalize", self.normalize, TG_NORMALIZE)
        _check_choice(s, "distill_budget", self.distill_budget, DISTILL_BUDGETS)
        _check_choice(s, "span", self.span, TG_SPANS)
        self._check_method()
        if self.distill_budget != "all" and not self.include_thinking:
            raise ValueError(
                f"tg.distill_budget={self.distill_budget!r} caps the thinking arm at the answer "
                "tokens' count: it needs tg.include_thinking=True (without thinking tokens the "
                "cap changes nothing)"
            )
        _check(self.norm_length > 0, s, "norm_length", "> 0", self.norm_length)
        _check(self.lambda_tg >= 0, s, "lambda_tg", ">= 0", self.lambda_tg)
        if self.kind == "jsd":
            _check(0 < self.beta < 1, s, "beta", "in (0, 1) for jsd", self.beta)
        _check(self.top_k is None or self.top_k > 0, s, "top_k", ">= 0", self.top_k)
        if self.top_k is not None and self.estimator == "sampled":
            raise ValueError("tg.top_k applies to the full estimator only")
        _check(self.max_teacher_rows >= 1, s, "max_teacher_rows", ">= 1", self.max_teacher_rows)
        _check(self.chunk_size >= 1, s, "chunk_size", ">= 1", self.chunk_size)

    def _check_method(self) -> None:
        """The fields of tg.method (`tg_jax.rl.peers`)."""
        s = "tg"
        _check_choice(s, "method", self.method, TG_METHODS)
        _check_choice(s, "peer_estimator", self.peer_estimator, PEER_ESTIMATORS)
        _check(0 <= self.peer_weight <= 1, s, "peer_weight", "in [0, 1]", self.peer_weight)
        _check(self.peer_top_k >= 1, s, "peer_top_k", ">= 1", self.peer_top_k)
        _check(self.sgcd_alpha >= 0, s, "sgcd_alpha", ">= 0", self.sgcd_alpha)
        _check(0 <= self.sgcd_clip <= 1, s, "sgcd_clip", "in [0, 1]", self.sgcd_clip)
        if self.enabled and self.method in ("sdpo", "opsd") and self.gate != "all_turns":
            raise ValueError(
                f"tg.method={self.method!r} distils every turn: it needs tg.gate='all_turns' "
                f"(got {self.gate!r}; batch building reads the gate)"
            )

    @property
    def distils(self) -> bool:
        """tg.method puts a distillation term over M in the loss: every method but sgcd (its
        teacher signal reweights the advantages instead)."""
        return self.method != "sgcd"

    @property
    def reference_teacher(self) -> bool:
        """The teacher forward runs on the frozen reference params (TG on)."""
        return self.enabled and self.teacher_params == "reference"

    @property
    def compact_rows(self) -> bool:
        """Whether batches get compact teacher rows: tg.compact, except with the reference
        teacher, which gets full rows (compact rows continue the student's prefix keys and
        values, which are the policy's, not the reference's)."""
        return self.enabled and self.compact and not self.reference_teacher


@dataclasses.dataclass(frozen=True)
class OptimConfig(Section):
    """AdamW with global-norm clipping and a learning-rate schedule."""

    section: ClassVar[str] = "optim"

    lr: float = 1e-5
    """Peak learning rate."""
    b1: float = 0.9
    """Adam beta1."""
    b2: float = 0.999
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay (not applied to norm scales)."""
    grad_clip_norm: float | None = off(1.0)
    """Clip gradients to this global norm; None = off."""
    schedule: str = "constant"
    """constant | warmup_cosine."""
    warmup_steps: int = 0
    """Linear warmup 0 -> lr (both schedules)."""
    total_steps: int = 1000
    """warmup_cosine: warmup + cosine decay steps."""
    end_lr_fraction: float = 0.1
    """warmup_cosine: final lr = lr * end_lr_fraction."""

    def __post_init__(self):
        s = "optim"
        _check_choice(s, "schedule", self.schedule, LR_SCHEDULES)
        _check(self.lr >= 0, s, "lr", ">= 0", self.lr)
        _check(0 <= self.b1 < 1, s, "b1", "in [0, 1)", self.b1)
        _check(0 <= self.b2 < 1, s, "b2", "in [0, 1)", self.b2)
        _check(self.eps > 0, s, "eps", "> 0", self.eps)
        _check(self.weight_decay >= 0, s, "weight_decay", ">= 0", self.weight_decay)
        clip = self.grad_clip_norm
        _check(clip is None or clip > 0, s, "grad_clip_norm", "> 0 (or 0 = off)", clip)
        _check(self.warmup_steps >= 0, s, "warmup_steps", ">= 0", self.warmup_steps)
        _check(self.total_steps >= 0, s, "total_steps", ">= 0", self.total_steps)
        _check(self.end_lr_fraction >= 0, s, "end_lr_fraction", ">= 0", self.end_lr_fraction)


@dataclasses.dataclass(frozen=True)
class StepConfig(Section):
    """The three sections of one RL train step (`from_config` reads them from a run config;
    its other sections are not read)."""

    section: ClassVar[str] = "config"
    strict: ClassVar[bool] = False

    rl: RLConfig
    """GRPO policy loss, advantages, micro-batches."""
    tg: TGConfig
    """The targeted-guidance term."""
    optim: OptimConfig
    """The optimizer and its learning-rate schedule."""

    @property
    def needs_reference(self) -> bool:
        """Whether the step takes frozen reference params: for the reference KL (rl.kl_coef >
        0) or the reference teacher (tg.teacher_params "reference")."""
        return self.rl.kl_coef > 0 or self.tg.reference_teacher
