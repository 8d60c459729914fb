"""The `eval` section, declared once (`tg_jax.config_schema`): `ReportSettings`, how the report
(`tg_jax.evaluation.report`) compares arms, and `EvalConfig`, those fields and the held-out
evaluation's."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from tg_jax.config_schema import Section
from tg_jax.evaluation.registry import corrected_level
from tg_jax.sampling.episode import CONDITIONS


@dataclasses.dataclass(frozen=True)
class ReportSettings(Section):
    """How the report compares arms; `from_config` reads them from the `eval` section (its
    other fields are not read)."""

    section: ClassVar[str] = "eval"
    strict: ClassVar[bool] = False

    baseline: str = "grpo"
    """Arm every other arm is compared with."""
    candidate: str = "tg"
    """Arm whose non-inferiority is the headline verdict."""
    references: tuple[str, ...] = ()
    """More references the candidate's non-inferiority is tested against, beside `baseline`
    (pre-registered with it; the headline stays the baseline's): arms (e.g.
    "grpo_task_only", GRPO without the requirement reward) or "base" (the base model itself,
    evaluated once on the held-out tasks: its episodes stand for every training seed)."""
    margin: float = -0.05
    """Allowed drop in held-out task success, candidate - baseline (<= 0; fixed before the
    run)."""
    floor: float = 0.1
    """Baseline task success under which the verdict is "not meaningful"."""
    collapse_drop: float = 0.1
    """A baseline seed whose held-out task success falls more than this under the base
    model's own (the base is evaluated whenever a baseline arm runs beside others) collapsed:
    the verdict is "not meaningful", naming the seed. Negative: not checked (the base is then
    evaluated only if `references` names it); the floor still applies."""
    level: float = 0.95
    """Two-sided coverage of every interval (the verdict's: its registered share,
    `verdict_level`)."""
    n_boot: int = 10_000
    """Bootstrap replicates."""
    bootstrap_seed: int = 0
    """Bootstrap numpy seed."""
    last_k: int = 32
    """Training steps in the Table 1 style mean +- std."""
    hypothesis: str = ""
    """The registered hypothesis this run tests (e.g. "fence/tg-vs-grpo"; "" = none):
    registered in `registry` before the first RL step (tg_jax.evaluation.registry)."""
    registry: str = ""
    """The JSONL registry of pre-registered tests (the project's: docs/preregistrations.jsonl)."""
    earlier: tuple[str, ...] = ()
    """The ids of the registry's earlier attempts of this run's claim (found by the claim's
    derived key; given here they are checked against it): attempt k = len(earlier) + 1 spends
    alpha / 2^k of the claim's alpha = 1 - `level` (tg_jax.evaluation.registry)."""

    def verdict_level(self) -> float:
        """The level of the verdict's interval: this attempt's share of the claim's alpha."""
        return corrected_level(self.level, len(self.earlier)) if self.hypothesis else self.level


@dataclasses.dataclass(frozen=True)
class EvalConfig(ReportSettings):
    """`eval`: the final held-out evaluation, the arms' training seeds, and (the fields of
    `ReportSettings`) how the report compares the arms. The margin and the interval that
    decides non-inferiority are fixed here, before any run (docs/design.md section 4)."""

    strict: ClassVar[bool] = True

    num_tasks: int = 128
    """Held-out tasks (never used in training); the bootstrap unit."""
    samples_per_task: int = 2
    """Episodes per task and condition (averaged per task first)."""
    temperature: float = -1.0
    """Sampling temperature of the held-out and periodic evaluations (0 = greedy); -1 = follow
    `rl.temperature`, the policy's own (`eval_temperature`)."""
    max_new_tokens: int = 128
    """Decode budget per assistant turn."""
    conditions: tuple[str, ...] = CONDITIONS
    """"plain" prompts; "hinted" = a hint before every turn."""
    sampling_seed: int = 1234
    """Sampling key of the evaluation (the same for every arm and seed)."""
    env_workers: int = 2
    """Threads running one turn's tool calls at once (rl_loop.env_workers)."""
    train_seeds: tuple[int, ...] = (0, 1, 2)
    """Training seeds per arm (the seed spread is reported apart)."""
    reread_heldout: bool = False
    """Each run's final evaluation reads the held-out tasks once (W/heldout_reads.json); True
    evaluates a run again whose heldout.jsonl was deleted (recorded, listed in the report)."""

    def __post_init__(self):
        if min(self.num_tasks, self.samples_per_task, self.max_new_tokens, self.env_workers) < 1:
            raise ValueError(
                "eval.num_tasks, samples_per_task, max_new_tokens and env_workers must be >= 1"
            )
        if not self.conditions or set(self.conditions) - set(CONDITIONS):
            raise ValueError(f"eval.conditions must be some of {CONDITIONS}, got {self.conditions}")
        if not self.train_seeds or len(set(self.train_seeds)) != len(self.train_seeds):
            raise ValueError(f"eval.train_seeds must be distinct, not empty: {self.train_seeds}")
        if self.temperature < 0 and self.temperature != -1:
            raise ValueError(
                f"eval.temperature must be >= 0 (-1 = rl.temperature), got {self.temperature}"
            )


def eval_temperature(config: Any) -> float:
    """The evaluations' sampling temperature: `eval.temperature`, or `rl.temperature` (1.0
    without an rl section) where it is -1, the default."""
    t = float(config.eval.temperature)
    return float(config.rl.temperature if "rl" in config else 1.0) if t == -1 else t
