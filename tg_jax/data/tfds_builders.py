"""TFDS builders for task datasets (array_record files, no TensorFlow needed).

Each example is ``{"task_id": str, "record": str}``, where ``record`` is the JSON of one task
record (the dict the environment package turns into a task with ``Task.from_record``). Splits:
``train`` and ``heldout``.

Two builders share one layout, ``<data_dir>/<builder>/<config_name>/<version>/``:

* ``TaskDataset``: examples from a Python callable ``generate(split) -> Iterable[dict]``, e.g.
  the procedural coding environment's task generator.
* ``JsonlTaskDataset``: user tasks from JSONL files (one JSON object per line); a bad line
  (invalid JSON, not an object, no ``task_id``, duplicate ``task_id``, or ``validate_fn``
  raising) is a ``TaskRecordError`` naming the file and the line number.

Why real TFDS builders work without TensorFlow here: with ``file_format="array_record"``,
tensorflow-datasets 4.9 serialises examples with its own numpy-backed feature encoders and
reads them back through ``builder.as_data_source()`` (random access via array_record), and
TFDS only imports TensorFlow lazily for ``as_dataset`` (tf.data), which we never call. Text
features come back as ``bytes``; ``decode_example`` turns an example into the record dict.

TFDS reuses a prepared dataset: the config name (plus builder version) must identify the
content, e.g. ``f"coding_seed{seed}_n{num_tasks}"``. Generation writes into a temporary
directory renamed at the end, so a failed generation never leaves a dataset that looks ready.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import tensorflow_datasets as tfds
from etils import epath
from tensorflow_datasets.core.utils import py_utils, tqdm_utils

from tg_jax import paths

SPLITS = ("train", "heldout")
FILE_FORMAT = "array_record"

ValidateFn = Callable[[dict], Any]
GenerateFn = Callable[[str], Iterable[dict]]


class TaskRecordError(ValueError):
    """A task record is malformed; the message says where (file:line, or split and index)."""


def _check_record(record: Any, validate_fn: ValidateFn | None, where: str) -> str:
    """Validates one record and returns its task_id; raises TaskRecordError naming ``where``."""
    if not isinstance(record, dict):
        raise TaskRecordError(
            f"{where}: task record must be a JSON object, got {type(record).__name__}"
        )
    task_id = record.get("task_id")
    if not isinstance(task_id, str) or not task_id:
        raise TaskRecordError(f"{where}: task record needs a non-empty string 'task_id'")
    if validate_fn is not None:
        try:
            validate_fn(record)
        except Exception as e:
            raise TaskRecordError(f"{where}: invalid task record: {e}") from e
    return task_id


def iter_jsonl_tasks(
    path: str | os.PathLike, validate_fn: ValidateFn | None = None
) -> Iterator[tuple[int, dict]]:
    """Yields ``(line_number, record)`` for each non-blank line of a JSONL task file.

    Raises:
      TaskRecordError: ``"<path>:<line>: <what is wrong>"`` for the first bad line (invalid
        JSON, not an object, no ``task_id``, duplicate ``task_id``, ``validate_fn`` raising).
    """
    path = os.fspath(path)
    seen: dict[str, int] = {}
    with paths.as_path(path).open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskRecordError(f"{where}: invalid JSON: {e}") from e
            task_id = _check_record(record, validate_fn, where)
            if task_id in seen:
                raise TaskRecordError(
                    f"{where}: duplicate task_id {task_id!r} (first on line {seen[task_id]})"
                )
            seen[task_id] = lineno
            yield lineno, record


def read_jsonl_tasks(path: str | os.PathLike, validate_fn: ValidateFn | None = None) -> list[dict]:
    """All task records of a JSONL file, validated (see ``iter_jsonl_tasks`` for errors)."""
    return [record for _, record in iter_jsonl_tasks(path, validate_fn)]


def decode_example(example: Mapping[str, Any]) -> dict:
    """The task record dict of a stored example (``record`` is bytes from the data source)."""
    record = example["record"]
    if isinstance(record, bytes):
        record = record.decode("utf-8")
    return json.loads(record)


class TaskDataset(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Task records from ``generate(split)``, stored as JSON strings in array_record files."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Task records as JSON strings with task ids."}
    # Registration is skipped so notebooks and tests can build many datasets in one process;
    # the builder is constructed directly rather than looked up by tfds.builder(name).

    @py_utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        # TFDS's own code_path touches `importlib_resources`, a package it only requires on
        # Python < 3.9, so it fails without it; the source file is all it needs here.
        return epath.Path(inspect.getfile(cls))

    def __init__(
        self,
        *,
        data_dir: str | os.PathLike,
        config_name: str = "default",
        generate: GenerateFn | None = None,
        validate_fn: ValidateFn | None = None,
        splits: Sequence[str] = SPLITS,
    ):
        """Args:
        data_dir: TFDS data directory (e.g. ``workdir/tfds``).
        config_name: names the content; a prepared dataset of that name is reused.
        generate: ``generate(split)`` yields task records; only needed to prepare.
        validate_fn: raises on a bad record (e.g. ``Task.from_record``).
        splits: split names to generate.
        """
        self._generate = generate
        self._validate_fn = validate_fn
        self._splits = tuple(splits)
        super().__init__(
            data_dir=os.fspath(data_dir),
            config=tfds.core.BuilderConfig(name=config_name, version=self.VERSION),
            file_format=FILE_FORMAT,
        )

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Agentic tasks: one JSON task record per example.",
            features=tfds.features.FeaturesDict(
                {"task_id": tfds.features.Text(), "record": tfds.features.Text()}
            ),
            # Keep generation order: index i is the i-th generated task of the split.
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        if self._generate is None:
            raise ValueError(
                f"dataset {self.name}/{self.builder_config.name} is not prepared in "
                f"{self.data_dir} and no generate function was given"
            )
        return {split: self._generate_examples(split) for split in self._splits}

    def _records(self, split: str) -> Iterator[tuple[str, dict]]:
        """(where, record) pairs for ``split``; ``where`` locates a record in error messages."""
        for index, record in enumerate(self._generate(split)):
            yield f"split {split!r} record {index}", record

    def _generate_examples(self, split: str):
        seen: set[str] = set()
        for index, (where, record) in enumerate(self._records(split)):
            task_id = _check_record(record, self._validate_fn, where)
            if task_id in seen:
                raise TaskRecordError(f"{where}: duplicate task_id {task_id!r}")
            seen.add(task_id)
            try:
                text = json.dumps(record, allow_nan=False, sort_keys=True)
            except (TypeError, ValueError) as e:
                raise TaskRecordError(f"{where}: task record is not JSON-serialisable: {e}") from e
            yield f"{index:09d}", {"task_id": task_id, "record": text}


class JsonlTaskDataset(TaskDataset, skip_registration=True):
    """User task records from JSONL files, one or more files per split."""

    def __init__(
        self,
        *,
        data_dir: str | os.PathLike,
        config_name: str,
        files: Mapping[str, str | os.PathLike | Sequence[str | os.PathLike]] | None = None,
        validate_fn: ValidateFn | None = None,
    ):
        """Args:
        data_dir: TFDS data directory.
        config_name: names the content (e.g. the task set's name and version).
        files: split -> JSONL path(s), e.g. ``{"train": [...], "heldout": "heldout.jsonl"}``;
          only needed to prepare. Exactly these splits are written.
        validate_fn: raises on a bad record (e.g. ``Task.from_record``).
        """
        self._files = None
        if files is not None:
            self._files = {
                split: [os.fspath(paths)]
                if isinstance(paths, str | os.PathLike)
                else [os.fspath(p) for p in paths]
                for split, paths in files.items()
            }
        super().__init__(
            data_dir=data_dir,
            config_name=config_name,
            validate_fn=validate_fn,
            splits=tuple(self._files or ()),
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        if self._files is None:
            raise ValueError(
                f"dataset {self.name}/{self.builder_config.name} is not prepared in "
                f"{self.data_dir} and no JSONL files were given"
            )
        # Read every file first so a bad line fails before TFDS writes anything.
        self._loaded = {
            split: [
                (f"{path}:{lineno}", record)
                for path in paths
                for lineno, record in iter_jsonl_tasks(path, self._validate_fn)
            ]
            for split, paths in self._files.items()
        }
        return {split: self._generate_examples(split) for split in self._splits}

    def _records(self, split: str) -> Iterator[tuple[str, dict]]:
        yield from self._loaded[split]


def prepare(builder: TaskDataset, *, quiet: bool = True) -> dict[str, Any]:
    """Generates ``builder``'s dataset if needed and returns ``{split: data source}``.

    Data sources support ``len`` and ``ds[i]``; ``decode_example(ds[i])`` gives the record.
    """
    active = tqdm_utils._active  # TFDS has no scoped switch for its progress bars
    if quiet:
        tfds.display_progress_bar(False)
    try:
        builder.download_and_prepare()
    finally:
        tfds.display_progress_bar(active)
    return builder.as_data_source()


def _check_local(data_dir: str | os.PathLike) -> None:
    if paths.is_url(data_dir):
        raise ValueError(
            f"cannot prepare task data in {os.fspath(data_dir)}: array_record writes local "
            "files only; use a local data directory"
        )


def prepare_task_dataset(
    data_dir: str | os.PathLike,
    *,
    config_name: str,
    generate: GenerateFn,
    validate_fn: ValidateFn | None = None,
    splits: Sequence[str] = SPLITS,
) -> dict[str, Any]:
    """Builds (or reuses) a ``TaskDataset`` from ``generate`` and returns its data sources."""
    _check_local(data_dir)
    builder = TaskDataset(
        data_dir=data_dir,
        config_name=config_name,
        generate=generate,
        validate_fn=validate_fn,
        splits=splits,
    )
    return prepare(builder)


def prepare_jsonl_task_dataset(
    data_dir: str | os.PathLike,
    *,
    config_name: str,
    files: Mapping[str, str | os.PathLike | Sequence[str | os.PathLike]],
    validate_fn: ValidateFn | None = None,
) -> dict[str, Any]:
    """Imports (or reuses) JSONL task files as a ``JsonlTaskDataset``; returns data sources."""
    _check_local(data_dir)
    builder = JsonlTaskDataset(
        data_dir=data_dir, config_name=config_name, files=files, validate_fn=validate_fn
    )
    return prepare(builder)
