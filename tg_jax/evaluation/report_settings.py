"""How the report compares arms: the report's fields of the `eval` section, declared once
(`tg_jax.config_schema`); the report is `tg_jax.evaluation.report`."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from tg_jax.config_schema import Section
from tg_jax.evaluation.registry import corrected_level


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
    ni_interval: str = "two_level"
    """The interval deciding non-inferiority: two_level (training seeds, then clusters of
    tasks; "exploratory" under stats.MIN_SEEDS seeds) | paired_bootstrap (tasks, seeds
    pooled) | seed_t (evaluation.stats)."""
    floor: float = 0.1
    """Baseline task success under which the verdict is "not meaningful"."""
    level: float = 0.95
    """Two-sided coverage of every interval."""
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
    """The ids of the registry's earlier attempts of `hypothesis`, every one of them: the
    verdict's error rate is split over them and this attempt (Bonferroni)."""

    def verdict_level(self) -> float:
        """The level of the verdict's interval: `level`, split over the registered attempts."""
        return corrected_level(self.level, len(self.earlier)) if self.hypothesis else self.level
