"""Importing user SWE tasks: a JSONL file (one task per line) or a directory per task.

Accepted fields (aliases in brackets) of a raw task, normalised into a `SweTask` record:

  task_id [id, instance_id], files, instruction [problem_statement], test_command [test_cmd],
  hidden_tests, hidden_command, fail_to_pass [FAIL_TO_PASS], pass_to_pass [PASS_TO_PASS],
  split, family, template, needs_overwrite, approved, solution.

FAIL_TO_PASS / PASS_TO_PASS may be lists or, as SWE-bench stores them, JSON strings of lists.

A directory of tasks holds one subdirectory per task: `task.json` (the fields other than the
files), `repo/` (the repository: `files`) and optionally `hidden/` (test files added for the
hidden run, at the same relative paths: `hidden_tests`).

A bad record is a `TaskImportError` naming the file and line ("tasks.jsonl:7: ...") or the
task directory's task.json.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tg_jax import paths
from tg_jax.envs.swe.task import KIND, SweTask

_ALIASES = {
    "id": "task_id",
    "instance_id": "task_id",
    "problem_statement": "instruction",
    "test_cmd": "test_command",
    "FAIL_TO_PASS": "fail_to_pass",
    "PASS_TO_PASS": "pass_to_pass",
}


class TaskImportError(ValueError):
    """A user task is malformed; the message says where."""


def normalize_record(raw: Any, split: str | None = None) -> dict:
    """A validated SweTask record from a raw task (aliases resolved, kind set).

    Args:
      raw: the raw task object.
      split: the split to assign when the raw task names none.

    Raises:
      ValueError: naming the bad field.
    """
    if not isinstance(raw, dict):
        raise ValueError(f"a task must be a JSON object, got {type(raw).__name__}")
    rec: dict[str, Any] = {}
    for key, value in raw.items():
        key = _ALIASES.get(key, key)
        if key in rec:
            raise ValueError(f"field {key!r} is given twice (under an alias)")
        rec[key] = value
    for key in ("fail_to_pass", "pass_to_pass"):
        if isinstance(rec.get(key), str):
            try:
                rec[key] = json.loads(rec[key])
            except ValueError as e:
                raise ValueError(f"field {key!r}: not a JSON list of test ids: {e}") from e
    if split is not None and "split" not in rec:
        rec["split"] = split
    rec["kind"] = KIND
    return SweTask.from_record(rec).to_record()


def read_jsonl(path: str | os.PathLike, split: str | None = None) -> list[dict]:
    """The task records of a JSONL file; a bad line is a TaskImportError 'path:line: ...'."""
    out, seen = [], {}
    with paths.as_path(path).open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{os.fspath(path)}:{lineno}"
            try:
                rec = normalize_record(json.loads(line), split)
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                raise TaskImportError(f"{where}: {e}") from e
            if rec["task_id"] in seen:
                first = seen[rec["task_id"]]
                raise TaskImportError(f"{where}: duplicate task_id (first on line {first})")
            seen[rec["task_id"]] = lineno
            out.append(rec)
    return out


def _read_tree(root, prefix: str = "") -> dict[str, str]:
    """{relative path: text} of every file under `root` (walked level by level: epath's
    rglob refuses remote paths)."""
    files = {}
    for p in sorted(root.iterdir()):
        if p.is_dir() and p.name != "__pycache__":
            files.update(_read_tree(p, f"{prefix}{p.name}/"))
        elif p.is_file():
            files[f"{prefix}{p.name}"] = p.read_text()
    return files


def read_task_dir(path: str | os.PathLike, split: str | None = None) -> list[dict]:
    """The task records of a directory with one subdirectory per task (sorted by name)."""
    root = paths.as_path(path)
    out = []
    for task_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        meta = task_dir / "task.json"
        where = os.fspath(meta)
        try:
            raw = json.loads(meta.read_text())
        except FileNotFoundError as e:
            raise TaskImportError(f"{where}: missing (every task directory needs one)") from e
        except json.JSONDecodeError as e:
            raise TaskImportError(f"{where}:{e.lineno}: invalid JSON: {e.msg}") from e
        if not isinstance(raw, dict):
            raise TaskImportError(f"{where}: a task must be a JSON object")
        raw.setdefault("task_id", task_dir.name)
        if (task_dir / "repo").is_dir():
            raw["files"] = _read_tree(task_dir / "repo")
        if (task_dir / "hidden").is_dir():
            raw["hidden_tests"] = _read_tree(task_dir / "hidden")
        try:
            out.append(normalize_record(raw, split))
        except ValueError as e:
            raise TaskImportError(f"{where}: {e}") from e
    return out


def load_swe_tasks(path: str | os.PathLike, split: str | None = None) -> list[dict]:
    """Task records from a JSONL file or a directory of task directories."""
    if paths.as_path(path).is_dir():
        return read_task_dir(path, split)
    return read_jsonl(path, split)
