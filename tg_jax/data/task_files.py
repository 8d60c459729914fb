"""A user's task files: a JSONL file (one task per line) or a directory of one JSON file per
task, with the user's field names mapped onto the environment's.

`tasks.train_source` / `tasks.heldout_source` name them (for the coding environment and for
plug-in environments, `tg_jax.envs.plugins`; the SWE environment has its own importer,
`tg_jax.envs.swe.importer`), and `tasks.fields` maps the file's names onto the record's, one
"ours=theirs" entry each, e.g. `("task_id=id", "prompt=question")`: the field `theirs` of each
task is stored as `ours`; fields not named are kept as they are. Every record needs a
non-empty "task_id" (after the mapping), unique in its file.

A bad task is a `TaskFileError` naming where: "tasks.jsonl:7: ..." or "tasks/t3.json: ...".
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from tg_jax import paths
from tg_jax.errors import ConfigError


class TaskFileError(ConfigError):
    """A task file or one of its tasks is malformed; the message says where."""


def field_map(fields: Sequence[str]) -> dict[str, str]:
    """{theirs: ours} of `tasks.fields` ("ours=theirs" entries).

    Raises:
      TaskFileError: an entry without "=", an empty name, or a name mapped twice.
    """
    out: dict[str, str] = {}
    for entry in fields:
        ours, sep, theirs = str(entry).partition("=")
        ours, theirs = ours.strip(), theirs.strip()
        if not sep or not ours or not theirs:
            raise TaskFileError(f"tasks.fields entry {entry!r}: expected 'ours=theirs'")
        if theirs in out or ours in out.values():
            raise TaskFileError(f"tasks.fields entry {entry!r}: a name mapped twice in {fields}")
        out[theirs] = ours
    return out


def _mapped(raw: Any, mapping: dict[str, str], where: str) -> dict:
    if not isinstance(raw, dict):
        raise TaskFileError(f"{where}: a task must be a JSON object, got {type(raw).__name__}")
    record: dict[str, Any] = {}
    for key, value in raw.items():
        new = mapping.get(key, key)
        if new in record:
            raise TaskFileError(f"{where}: field {new!r} twice (a mapped name and its own)")
        record[new] = value
    if not isinstance(record.get("task_id"), str | int) or record.get("task_id") in ("", None):
        raise TaskFileError(
            f"{where}: no 'task_id' (map one of the task's fields onto it with tasks.fields, "
            f"e.g. 'task_id=id'); its fields: {sorted(raw)}"
        )
    record["task_id"] = str(record["task_id"])
    return record


def read_task_source(source: str, fields: Sequence[str] = ()) -> Iterator[dict]:
    """The task records of a JSONL file or a directory of *.json files, fields mapped.

    Raises:
      TaskFileError: no such file or directory, invalid JSON, a task that is not an object,
        no task_id, a duplicate task_id.
    """
    mapping = field_map(fields)
    path = paths.as_path(source)
    if not path.exists():
        raise TaskFileError(f"task source {source!r}: no such file or directory")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.name.endswith(".json"))
        if not files:
            raise TaskFileError(f"task source {source!r}: a directory without *.json tasks")
        items = ((f"{source}/{p.name}", p.read_text()) for p in files)
    else:
        lines = path.read_text().splitlines()
        items = ((f"{source}:{i}", ln) for i, ln in enumerate(lines, 1) if ln.strip())
    seen: dict[str, str] = {}
    for where, text in items:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise TaskFileError(f"{where}: invalid JSON: {e}") from e
        record = _mapped(raw, mapping, where)
        task_id = record["task_id"]
        if task_id in seen:
            raise TaskFileError(f"{where}: duplicate task_id {task_id!r} (first: {seen[task_id]})")
        seen[task_id] = where
        yield record
