"""The SFT sections (`config.sft.select`, `extend`, `require`, `eval`), declared once
(`tg_jax.config_schema`); what they drive: `tg_jax.train.sft_select`, `sft_gates`, `sft_eval`."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from tg_jax.config_schema import Section


@dataclasses.dataclass(frozen=True)
class SelectConfig(Section):
    """`config.sft.select`: model selection during SFT on tasks of the dev split."""

    section: ClassVar[str] = "sft.select"

    enabled: bool = True
    """Select the base model on the dev split (False: the last SFT step is the model)."""
    every: int = 250
    """Steps between dev evaluations."""
    start: int = 1000
    """First step evaluated (earlier checkpoints are never chosen)."""
    num_tasks: int = 64
    """Dev tasks per evaluation (dev-split functions: not trained, not tested)."""
    seed: int = 7
    """Seed of the dev tasks and their sampling."""
    max_new_tokens: int = 128
    """Decode budget per assistant turn."""
    pass_rate_max: float = 0.6
    """Eligible only up to this temperature-1 dev pass rate."""
    unprompted_max: float = 0.02
    """Eligible only if unprompted compliance <= this, every requirement."""
    hinted_min: float = 0.95
    """Eligible only if hinted compliance >= this, every requirement."""

    def __post_init__(self):
        if self.every < 1 or self.num_tasks < 1:
            raise ValueError(f"sft.select: every and num_tasks must be >= 1, got {self}")
        if not 0.0 <= self.unprompted_max <= 1.0 or not 0.0 <= self.hinted_min <= 1.0:
            raise ValueError(f"sft.select: compliance bounds must be in [0, 1], got {self}")

    def due(self, step: int, num_steps: int) -> bool:
        """Whether step `step` (1-based count of steps done) is evaluated."""
        return self.enabled and step >= self.start and (step % self.every == 0 or step == num_steps)


@dataclasses.dataclass(frozen=True)
class ExtendConfig(Section):
    """`config.sft.extend`: SFT steps after `sft.steps` for a run that has not learnt the
    tasks by then.

    At step `sft.steps` (after its dev evaluation) the run is extended iff no eligible dev
    evaluation reached `min_pass_rate`; the extension is a second cosine over `steps` steps,
    from `lr_fraction` x sft.optim.lr down to the main cosine's end value. A run that is not
    extended is step for step the run without this option. Needs `sft.select` (the dev
    figures); the decision is recorded in sft/selection.json, so a resumed run keeps it.
    """

    section: ClassVar[str] = "sft.extend"

    steps: int = 0
    """Extra steps (0 = never extend)."""
    min_pass_rate: float = 0.25
    """Extend when the best eligible dev pass rate is under this."""
    lr_fraction: float = 0.2
    """The extension's peak lr, as a fraction of sft.optim.lr."""

    def __post_init__(self):
        if self.steps < 0 or not 0.0 < self.lr_fraction <= 1.0:
            raise ValueError(f"sft.extend: steps >= 0 and lr_fraction in (0, 1], got {self}")


@dataclasses.dataclass(frozen=True)
class RequireConfig(Section):
    """`config.sft.require`: gates on the base model's sft_eval.json (`tg_jax.train.sft_gates`),
    checked before any RL; bounds no base model can meet are an error at start-up."""

    section: ClassVar[str] = "sft.require"

    enabled: bool = True
    """False: no gates (the tiny test configs)."""
    pass_rate: tuple[float, ...] = (0.2, 0.6)
    """Allowed range (low, high) of the temperature-1 dev pass rate."""
    max_unprompted_compliance: float = 0.02
    """Per requirement RL judges, plain prompts, at most."""
    min_hinted_compliance: float = 0.95
    """Per requirement RL judges, hinted prompts, at least."""
    max_format_cost: float = 1.0
    """Per requirement RL judges with an opening (the fence), at most: plain pass rate minus the
    pass rate with the first answer opened in the format (sft_eval's format_cost); 1.0 = off."""

    def __post_init__(self):
        s = self.section
        if len(self.pass_rate) != 2:
            raise ValueError(f"{s}.pass_rate must be two numbers (low, high), not {self.pass_rate}")
        low, high = self.pass_rate
        if not 0.0 <= low <= high <= 1.0:
            raise ValueError(f"{s}.pass_rate ({low}, {high}) must satisfy 0 <= low <= high <= 1")
        for key in ("max_unprompted_compliance", "min_hinted_compliance"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"{s}.{key} must be in [0, 1], not {getattr(self, key)}")
        if not self.max_format_cost >= -1.0:  # a pass-rate difference is >= -1; NaN fails too
            raise ValueError(
                f"{s}.max_format_cost must be >= -1 (a pass-rate difference; >= 1 turns the "
                f"gate off), not {self.max_format_cost}"
            )


@dataclasses.dataclass(frozen=True)
class SftEvalConfig(Section):
    """`config.sft.eval`: the base model's evaluation (pass rate, unprompted and hinted
    compliance), written to sft_eval.json and gated by `sft.require`."""

    section: ClassVar[str] = "sft.eval"

    num_tasks: int = 128
    """Dev tasks per evaluation mode (`task_data.dev_tasks`, never the held-out ones: the gates
    are checked before any run, and only the final evaluation reads held-out tasks)."""
    task_seed: int = 8
    """Their generation seed (sft.select's dev tasks use sft.select.seed)."""
    seed: int = 0
    """Sampling seed."""
    temperatures: tuple[float, ...] = (1.0, 0.0)
    """1.0 = the RL sampling temperature, 0.0 = greedy."""
    max_new_tokens: int = 128
    """Decode budget per assistant turn."""

    def __post_init__(self):
        if self.num_tasks < 1 or self.max_new_tokens < 1 or not self.temperatures:
            raise ValueError(
                f"sft.eval: num_tasks, max_new_tokens >= 1 and some temperatures, got {self}"
            )
