"""The SFT sections (`config.sft.select`, `extend`, `require`, `eval`), declared once
(`tg_jax.config_schema`); what they drive: `tg_jax.train.sft_select`, `sft_gates`, `sft_eval`."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from tg_jax.config_schema import Section
from tg_jax.envs.transcripts import TranscriptConfig
from tg_jax.rl.step_config import OptimConfig
from tg_jax.train.shipped_base import check_source


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
    """The base model's modes: 1.0 = temperature 1 (the figures the gates and the report
    read; fixed, whatever `rl.temperature`), 0.0 = greedy."""
    max_new_tokens: int = 128
    """Decode budget per assistant turn."""

    def __post_init__(self):
        if self.num_tasks < 1 or self.max_new_tokens < 1 or not self.temperatures:
            raise ValueError(
                f"sft.eval: num_tasks, max_new_tokens >= 1 and some temperatures, got {self}"
            )


_SFT_OPTIM = OptimConfig(
    lr=5e-3,
    weight_decay=0.01,
    schedule="warmup_cosine",
    warmup_steps=50,
    end_lr_fraction=0.05,
    total_steps=3000,
)


TOKENIZERS = ("byte", "bpe")  # sft.tokenizer's choices


def check_tokenizer(kind: str) -> str:
    """`sft.tokenizer` as given, or a ValueError naming the choices (the section's check, and
    the reader of saved configs `tg_jax.train.sft.tokenizer_kind`)."""
    if kind not in TOKENIZERS:
        raise ValueError(f"sft.tokenizer {kind!r} is not one of {TOKENIZERS}")
    return kind


@dataclasses.dataclass(frozen=True)
class SftConfig(Section):
    """`config.sft`: SFT of the base model (data, batches, optimizer, checkpoints, evaluation,
    gates, selection), or where a shipped base comes from.

    Why many small steps: after learning the format the byte model plateaus until attention
    learns to copy numbers out of the prompt, and that takes optimizer steps, not tokens.
    """

    section: ClassVar[str] = "sft"

    steps: int = 3000
    """Train steps."""
    batch_size: int = 2
    """Packed rows per step (a multiple of the mesh's batch split)."""
    seq_len: int = 512
    """Tokens per packed row (<= model.max_seq_len); attention cost grows with it, and longer
    transcripts (< 0.5% at max_chars 800) are left out."""
    num_transcripts: int = 12_000
    """Expert transcripts, one per drawn train task (~1 epoch)."""
    data_seed: int = 1
    """Seed of the SFT tasks, transcripts, packing and batch order."""
    init: str = ""
    """The weights SFT starts from: "" = a random init of `seed`; else a shipped base (a name
    under tg_jax/bases, or its directory) that SFT continues (sft.tokenizer "byte")."""
    hint_requirements: tuple[str, ...] = ()
    """Requirements whose hints appear in the SFT transcripts (the hints the base model learns
    to follow); empty = env.requirements. RL judges and teaches env.requirements only; the
    gates (sft.require) check those of env.requirements hinted here."""
    transcripts: TranscriptConfig = TranscriptConfig()
    """The synthetic expert's knobs."""
    tokenizer: str = "byte"
    """The base model's tokenizer: "byte" (ByteTokenizer) or "bpe" (a byte-level BPE trained on
    the train-split transcripts, tg_jax.text.bpe; model.vocab_size then follows it)."""
    bpe_vocab_size: int = 512
    """"bpe": ids at most (bytes, specials, fences, merges)."""
    optim: OptimConfig = _SFT_OPTIM
    """AdamW + warmup-cosine; `total_steps` follows `steps` (config_lib.sft_config)."""
    log_every: int = 100
    """Progress-line interval when not on a TTY."""
    checkpoint_every: int = 500
    """Checkpoint interval in steps (the last step is always saved)."""
    eval: SftEvalConfig = SftEvalConfig()
    """The base-model evaluation written to sft_eval.json."""
    require: RequireConfig = RequireConfig()
    """Gates on the base model, checked before any RL."""
    select: SelectConfig = SelectConfig()
    """Model selection on dev tasks (`tg_jax.train.sft_select`); its compliance bounds follow
    the gates' (config_lib.sft_config)."""
    extend: ExtendConfig = ExtendConfig()
    """More steps for a run still low on dev at `steps`."""
    retry_seeds: int = 0
    """On a gate failure retry SFT with seed+1, data_seed+1, this many times."""
    source: str = "train"
    """Where the base model comes from: train (SFT in the run, as above) | shipped (the base
    `base` under tg_jax/bases, trained once, the same file on every machine; the gates apply to
    its recorded figures; tg_jax.train.shipped_base)."""
    base: str = ""
    """The shipped base: a name under tg_jax/bases, or a directory."""

    def __post_init__(self):
        positive = (
            "batch_size",
            "seq_len",
            "num_transcripts",
            "log_every",
            "checkpoint_every",
            "bpe_vocab_size",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"sft.{name} must be >= 1, got {getattr(self, name)}")
        if self.steps < 0 or self.retry_seeds < 0:
            raise ValueError(f"sft.steps and sft.retry_seeds must be >= 0, got {self}")
        check_tokenizer(self.tokenizer)
        check_source(self.source)
