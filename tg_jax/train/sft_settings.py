"""The SFT selection and extension sections (`config.sft.select`, `config.sft.extend`),
declared once (`tg_jax.config_schema`); what they drive is `tg_jax.train.sft_select`."""

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
