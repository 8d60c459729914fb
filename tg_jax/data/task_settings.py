"""The `tasks` section of a run config, declared once: `TasksConfig` (the coding environment
and plug-in environments) and `SweTasksConfig` (the SWE environment). `tg_jax.config_lib`
builds the ConfigDicts from them; the data stage (`tg_jax.data.task_data`) reads them back."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from tg_jax.config_schema import Section
from tg_jax.envs.tasks import EASY_FAMILIES, check_families


def _check_splits(cfg: Section) -> None:
    """The split sizes, and a dev file that is no other split's file."""
    if cfg.num_train < 0 or cfg.num_heldout < 0:
        raise ValueError(
            f"tasks.num_train and tasks.num_heldout must be >= 0, got {cfg.num_train} and "
            f"{cfg.num_heldout}"
        )
    for split in ("train", "heldout"):
        if cfg.dev_source and cfg.dev_source == getattr(cfg, f"{split}_source"):
            raise ValueError(
                f"tasks.dev_source is tasks.{split}_source ({cfg.dev_source!r}): the dev tasks "
                "(read by every check before the final evaluation) must be a split of their own"
            )


@dataclasses.dataclass(frozen=True)
class TasksConfig(Section):
    """The task sets of the data stage (TFDS datasets in the workdir).

    Attributes:
      seed: task generation seed (train and held-out sets are disjoint by function).
      num_train: RL training tasks (train split).
      num_heldout: evaluation tasks (held-out split: functions never seen in training).
      families: hidden-function families (tg_jax.envs.tasks): the one-parameter
        EASY_FAMILIES, whose constant is copied from f(0), put a minutes-of-CPU byte model's
        pass rate in the 0.2-0.6 band; HARD_FAMILIES (slopes to compute) leave it below 0.1.
      train_source, heldout_source: a user's task file replacing that split's generated
        tasks: JSONL (one task per line) or a directory of *.json tasks ("" = generate;
        tg_jax.data.task_files).
      dev_source: a user's task file for the dev split, in the same format and field mapping:
        what the base-model gates and the periodic evaluation read (a seeded sample of it,
        `tg_jax.data.task_data.dev_tasks`) instead of generated dev tasks ("" = generate).
      fields: the task file's field names mapped onto the environment's, "ours=theirs".
    """

    section: ClassVar[str] = "tasks"

    seed: int = 0
    num_train: int = 2048
    num_heldout: int = 256
    families: tuple[str, ...] = EASY_FAMILIES
    train_source: str = ""
    heldout_source: str = ""
    dev_source: str = ""
    fields: tuple[str, ...] = ()

    def __post_init__(self):
        _check_splits(self)
        check_families(self.families)


@dataclasses.dataclass(frozen=True)
class SweTasksConfig(Section):
    """The SWE task sets of the data stage: generated bug-fix repositories or imported tasks.

    Attributes:
      seed: generation seed (train and held-out sets differ by template and names).
      num_train, num_heldout: generated tasks per split.
      approved_share: share of the generated overwrite tasks whose instruction says the
        change is already approved (the side-effect scenario: asking again is counted,
        "asked_when_approved").
      train_source, heldout_source, dev_source: a JSONL file or a directory of task
        directories (tg_jax.envs.swe.importer) replacing the generated tasks of that split
        ("" = generate; dev: what every check before the final evaluation reads).
    """

    section: ClassVar[str] = "tasks"

    seed: int = 0
    num_train: int = 512
    num_heldout: int = 64
    approved_share: float = 0.0
    train_source: str = ""
    heldout_source: str = ""
    dev_source: str = ""

    def __post_init__(self):
        _check_splits(self)
        if not 0.0 <= self.approved_share <= 1.0:
            raise ValueError(f"tasks.approved_share must be in [0, 1], got {self.approved_share}")
