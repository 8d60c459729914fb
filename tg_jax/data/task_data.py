"""The data stage: the task sets as TFDS datasets in the workdir.

`prepare_tasks(config, workdir)` writes `config.tasks.num_train` train-split and
`config.tasks.num_heldout` held-out-split tasks (`tg_jax.envs.tasks.generate_tasks`) as a
TFDS dataset under `workdir/tfds` (array_record; see `tg_jax.data.tfds_builders`). The
dataset's name encodes everything that determines its content, so a prepared dataset is
reused as is and a changed config builds a new one. The RL loop reads the train split
through grain (`tg_jax.data.pipeline.TaskIterator`); evaluations read the held-out split.

With `config.env.kind == "swe"` the records are SWE tasks (`tg_jax.envs.swe`): generated
bug-fix repositories (`tg_jax.envs.swe.generator`), or per split a user's JSONL file or
directory of tasks (`config.tasks.train_source` / `heldout_source`, imported by
`tg_jax.envs.swe.importer`); with a plug-in environment (`env.kind` = "module:Class",
`tg_jax.envs.plugins`) they are its class's `generate_tasks(split, num, seed)` records;
`tg_jax.envs.decode_task` decodes records of any kind.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np

from tg_jax import paths
from tg_jax.data import tfds_builders
from tg_jax.data.task_files import read_task_source
from tg_jax.data.task_settings import SweTasksConfig, TasksConfig
from tg_jax.envs import decode_task, env_kind
from tg_jax.envs.plugins import PLUGIN_TASK_KIND, environment_class, is_plugin
from tg_jax.envs.tasks import check_families, generate_tasks
from tg_jax.errors import ConfigError

TFDS_DIR = "tfds"


def task_settings(config: Any) -> TasksConfig | SweTasksConfig:
    """`config.tasks` read back into its dataclass (SweTasksConfig for the SWE environment)."""
    cls = SweTasksConfig if env_kind(config.env) == "swe" else TasksConfig
    return cls.from_config(config.tasks)


def tasks_dataset_name(config: Any) -> str:
    """The TFDS config name of `config.tasks`: it identifies the dataset's content."""
    t = task_settings(config)
    kind = env_kind(config.env)
    if kind == "swe":
        return _swe_dataset_name(t)
    if is_plugin(kind):  # the class's import path, readable, and a hash that keeps it unique
        digest = hashlib.sha256(kind.encode()).hexdigest()[:8]
        slug = re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_")[-40:]
        sizes = f"seed{int(t.seed)}_train{int(t.num_train)}_heldout{int(t.num_heldout)}"
        return f"plugin_{slug}_{digest}_{sizes}{_files_suffix(t)}"
    families = "-".join(check_families(t.families))
    return (
        f"coding_{families}_seed{int(t.seed)}_train{int(t.num_train)}_heldout{int(t.num_heldout)}"
        + _files_suffix(t)
    )


def _task_files(t: Any) -> dict[str, str]:
    """{split: `tasks.<split>_source`} of the splits read from a user's task file."""
    sources = {"train": t.train_source, "heldout": t.heldout_source}
    return {s: src for s, src in sources.items() if src}


def _files_suffix(t: Any) -> str:
    """ "" without task files, else "_files" and a hash of their mapped records (the dataset's
    name follows the files' content)."""
    files = _task_files(t)
    if not files:
        return ""
    h = hashlib.sha256()
    for split, src in sorted(files.items()):
        h.update(split.encode())
        for record in read_task_source(src, t.fields):
            h.update(json.dumps(record, sort_keys=True).encode())
    return f"_files{h.hexdigest()[:12]}"


def _swe_dataset_name(t: Any) -> str:
    name = f"swe_v1_seed{int(t.seed)}_train{int(t.num_train)}_heldout{int(t.num_heldout)}"
    if t.approved_share:
        name += f"_approved{round(1000 * t.approved_share)}pm"  # per mille
    sources = [str(t.train_source), str(t.heldout_source)]
    if any(sources):
        # Imported tasks: the name carries a hash of the source contents.
        from tg_jax.envs.swe.importer import load_swe_tasks  # noqa: PLC0415

        h = hashlib.sha256()
        for src in sources:
            h.update(repr(load_swe_tasks(src) if src else None).encode())
        name += f"_import{h.hexdigest()[:12]}"
    return name


def _file_records(config: Any, source: str, split: str) -> Iterator[dict]:
    """The task records of a user's task file for `split` (any split, dev included), as the
    environment stores them: SWE tasks imported (`tg_jax.envs.swe.importer`) and tagged with
    the split; coding and plug-in records read through `tasks.fields` (task_files), a plug-in's
    tagged with its kind and the split, a coding task's split left as its function's (which
    `Task.from_record` checks)."""
    kind = env_kind(config.env)
    if kind == "swe":
        from tg_jax.envs.swe.importer import load_swe_tasks  # noqa: PLC0415

        for record in load_swe_tasks(source):
            yield {**record, "split": split}
        return
    records = read_task_source(source, task_settings(config).fields)
    if is_plugin(kind):
        for record in records:
            yield {**record, "kind": PLUGIN_TASK_KIND, "split": split}
    else:
        yield from records


def _generate_swe(config: Any):
    from tg_jax.envs.swe.generator import generate_swe_tasks  # noqa: PLC0415

    t = task_settings(config)
    sizes = {"train": t.num_train, "heldout": t.num_heldout}
    sources = {"train": str(t.train_source), "heldout": str(t.heldout_source)}

    def generate(split: str) -> Iterator[dict]:
        if sources[split]:
            yield from _file_records(config, sources[split], split)
        else:
            for task in generate_swe_tasks(split, sizes[split], t.seed, t.approved_share):
                yield task.to_record()

    return generate


def _generate_plugin(config: Any, kind: str):
    cls = environment_class(kind)
    t = task_settings(config)
    sizes = {"train": t.num_train, "heldout": t.num_heldout}
    files = _task_files(t)

    def generate(split: str) -> Iterator[dict]:
        if split in files:
            yield from _file_records(config, files[split], split)
            return
        if not callable(getattr(cls, "generate_tasks", None)):
            raise ConfigError(
                f"env.kind {kind!r}: no tasks for the {split} split: {cls.__name__} has no "
                f"generate_tasks(split, num, seed) classmethod and tasks.{split}_source is empty"
            )
        seen: set[str] = set()
        for i, record in enumerate(cls.generate_tasks(split, sizes[split], int(t.seed))):
            if not isinstance(record, dict) or "task_id" not in record:
                raise ConfigError(
                    f"{kind}.generate_tasks({split!r}, ...) record {i} is not a dict with a "
                    f"'task_id': {record!r:.200}"
                )
            if str(record["task_id"]) in seen:
                raise ConfigError(f"{kind}.generate_tasks: task_id {record['task_id']!r} twice")
            seen.add(str(record["task_id"]))
            yield {**record, "kind": PLUGIN_TASK_KIND, "split": split}

    return generate


def _generate(config: Any):
    kind = env_kind(config.env)
    if kind == "swe":
        return _generate_swe(config)
    if is_plugin(kind):
        return _generate_plugin(config, kind)
    t = task_settings(config)
    sizes = {"train": t.num_train, "heldout": t.num_heldout}
    files = _task_files(t)

    def generate(split: str) -> Iterator[dict]:
        if split in files:  # coding tasks from a file: Task records (validated on writing)
            yield from _file_records(config, files[split], split)
            return
        for task in generate_tasks(split, sizes[split], seed=t.seed, families=t.families):
            yield task.to_record()

    return generate


def tasks_dir(workdir: str) -> str:
    """Where the task datasets live: `workdir/tfds`, or for a gs:// workdir a local directory
    (array_record writes local files only; the datasets are regenerated from the config)."""
    if paths.is_url(workdir):
        return os.path.join(tempfile.gettempdir(), "tg_jax", TFDS_DIR)
    return os.path.join(workdir, TFDS_DIR)


def check_epochs(loop_config: Any, num_train: int) -> None:
    """`rl_loop.epochs` (when set) against the run's length: steps x groups_per_step tasks are
    drawn in all (the task iterator repeats the train split, reshuffled each pass). The value's own
    check (>= 0) is LoopConfig's, at start-up."""
    epochs = float(loop_config.get("epochs", 0.0))
    if epochs <= 0:
        return
    drawn = int(loop_config.steps) * int(loop_config.groups_per_step)
    if abs(drawn - epochs * num_train) > 1e-6 * drawn:
        raise ConfigError(
            f"rl_loop.epochs={epochs:g} over {num_train} train tasks is "
            f"{epochs * num_train:g} tasks, but rl_loop.steps={loop_config.steps} x "
            f"groups_per_step={loop_config.groups_per_step} draws {drawn} "
            f"({drawn / num_train:.3g} epochs); change the steps or the tasks, or set "
            "rl_loop.epochs=0 to leave it unchecked"
        )


def prepare_tasks(config: Any, workdir: str) -> dict[str, Any]:
    """Builds (or reuses) the task datasets; returns `{"train": source, "heldout": source}`.

    Sources support `len` and `source[i]`; `tfds_builders.decode_example(source[i])` is the
    task record (`tg_jax.envs.decode_task` validates it).
    """
    sources = tfds_builders.prepare_task_dataset(
        tasks_dir(workdir),
        config_name=tasks_dataset_name(config),
        generate=_generate(config),
        validate_fn=decode_task,
    )
    if "rl_loop" in config:  # a task file's count is known only now
        check_epochs(config.rl_loop, len(sources["train"]))
    return sources


def check_dev_tasks(config: Any, reader: str, fix: str = "") -> None:
    """ConfigError when there are no dev tasks for `reader` to read: a plug-in environment
    whose class has no `generate_tasks` and no `tasks.dev_source`; `fix` ends the message."""
    kind = env_kind(config.env)
    if not is_plugin(kind) or ("tasks" in config and task_settings(config).dev_source):
        return
    cls = environment_class(kind)
    if not callable(getattr(cls, "generate_tasks", None)):
        raise ConfigError(
            f"env.kind {kind!r}: {reader} reads dev tasks, and {cls.__name__} has no "
            f"generate_tasks(split, num, seed) classmethod and tasks.dev_source is empty{fix}"
        )


def check_dev_source(config: Any) -> None:
    """Reads `tasks.dev_source`, when set, once at start-up: a missing, unreadable, malformed or
    empty file is a ConfigError before any stage runs, not when the first check reads it
    (the base model's gates or the first periodic evaluation, minutes later)."""
    t = task_settings(config)
    if not t.dev_source:
        return
    try:
        dev_tasks(config, 1, seed=0)
    except OSError as e:  # the SWE importer's own file errors
        raise ConfigError(f"tasks.dev_source {t.dev_source!r}: {e}") from e


def dev_tasks(config: Any, n: int, seed: int) -> list[Any]:
    """`n` tasks of the dev split, generated (never stored): functions, templates or words that
    neither training nor the held-out evaluation uses. Every check made before the final
    evaluation reads these (the base-model gates, the periodic RL evaluation), so the held-out
    split is opened by the final evaluation only (`tg_jax.evaluation.heldout_reads`).

    With `tasks.dev_source` (a user's task file, the format of the other splits' files) they
    are a sample of `n` of its tasks drawn with `seed` (all of them when it holds fewer).
    Otherwise coding tasks come from `tg_jax.envs.tasks` (also beside train / held-out task
    files), SWE tasks from its generator, a plug-in environment's from its class's
    `generate_tasks("dev", n, seed)`.

    Raises:
      ConfigError: a plug-in environment whose class generates no tasks, without a dev file.
    """
    kind = env_kind(config.env)
    t = task_settings(config)
    if t.dev_source:
        records = list(_file_records(config, t.dev_source, "dev"))
        if not records:
            raise ConfigError(f"tasks.dev_source {t.dev_source!r} holds no tasks")
        picked = np.random.default_rng(seed).permutation(len(records))[: max(int(n), 0)]
        return [decode_task(records[i]) for i in picked]
    if kind == "swe":
        from tg_jax.envs.swe.generator import generate_swe_tasks  # noqa: PLC0415

        return list(generate_swe_tasks("dev", n, seed))
    if is_plugin(kind):
        check_dev_tasks(config, "the checks before the final evaluation")
        records = list(environment_class(kind).generate_tasks("dev", n, seed))[:n]
        return [decode_task({**r, "kind": PLUGIN_TASK_KIND, "split": "dev"}) for r in records]
    return generate_tasks("dev", n, seed=seed, families=t.families)


def load_tasks(sources: dict[str, Any], split: str, limit: int | None = None) -> list[Any]:
    """The first `limit` (default: all) tasks of a split, in generation order."""
    source = sources[split]
    n = len(source) if limit is None else min(int(limit), len(source))
    return [decode_task(tfds_builders.decode_example(source[i])) for i in range(n)]
