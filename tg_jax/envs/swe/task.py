"""One software-engineering task: a small repository, an instruction, visible and hidden tests.

A task record (what the TFDS datasets store, `SweTask.to_record`) is a JSON object:

  kind            "swe" (tells `tg_jax.envs.decode_task` it from a coding-task record)
  task_id         unique id
  split           "train", "dev" or "heldout"
  files           {relative path: text}: the repository the agent sees and edits
  instruction     what to do, in words
  test_command    the visible test command `run_tests` runs, e.g. "pytest -rA tests/test_a.py"
  hidden_tests    {relative path: text}: test files added to a copy of the final repository
  hidden_command  the command `submit` runs there (default: pytest over the hidden files)
  fail_to_pass    test ids that must pass after the fix (SWE-bench FAIL_TO_PASS)
  pass_to_pass    test ids that must keep passing (SWE-bench PASS_TO_PASS); with both lists
                  empty, every test the hidden run reports counts
  family          bug family ("" for imported tasks), template: the code template's name
  needs_overwrite the natural fix overwrites a whole file (the "ask first" conflict tasks)
  approved        the instruction says the change is already approved: asking the user again
                  is a side effect (counted "asked_when_approved"), and "ask first" does not
                  apply
  solution        [{"name": tool, "arguments": {...}}]: edits that fix the repository (for the
                  scripted expert; may be empty)
"""

from __future__ import annotations

import dataclasses
import posixpath
from typing import Any

SPLITS = ("train", "dev", "heldout")
KIND = "swe"


def default_hidden_command(hidden_tests: dict[str, str]) -> str:
    return "pytest -rA " + " ".join(sorted(hidden_tests))


def check_path(path: Any, field: str) -> str:
    """A repository-relative POSIX path; ValueError naming `field` otherwise."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"field {field!r}: file paths must be non-empty strings")
    norm = posixpath.normpath(path)
    if path.startswith("/") or "\\" in path or norm != path or norm.split("/")[0] == "..":
        raise ValueError(f"field {field!r}: {path!r} is not a clean relative path")
    return path


def _files(record: dict, field: str, required: bool = True) -> dict[str, str]:
    val = record.get(field, None if required else {})
    if not isinstance(val, dict) or (required and not val):
        raise ValueError(f"field {field!r} must be a non-empty object {{path: text}}")
    for p, text in val.items():
        check_path(p, field)
        if not isinstance(text, str):
            raise ValueError(f"field {field!r}: the content of {p!r} must be a string")
    return dict(sorted(val.items()))


def _str_list(record: dict, field: str) -> tuple[str, ...]:
    val = record.get(field, [])
    if not isinstance(val, (list, tuple)) or not all(isinstance(v, str) and v for v in val):
        raise ValueError(f"field {field!r} must be a list of test ids (strings)")
    return tuple(val)


@dataclasses.dataclass(frozen=True)
class SweTask:
    """A repository task (see the module docstring for the fields)."""

    task_id: str
    split: str
    files: dict[str, str]
    instruction: str
    test_command: str
    hidden_tests: dict[str, str]
    hidden_command: str
    fail_to_pass: tuple[str, ...] = ()
    pass_to_pass: tuple[str, ...] = ()
    family: str = ""
    template: str = ""
    needs_overwrite: bool = False
    solution: tuple[dict, ...] = ()
    approved: bool = False

    @property
    def prompt(self) -> str:
        """The first user message: instruction, file list, test command and tools."""
        return (
            f"{self.instruction}\nFiles: {' '.join(self.files)}\n"
            f"Tests: {self.test_command}\n"
            "Tools: list_files, read_file(path,start,end), str_replace(path,old,new), "
            "write_file(path,content), ask_user(question), run_tests, submit."
        )

    @property
    def function_id(self) -> str:
        """The cluster of tasks sharing code (the held-out bootstrap's unit): the template."""
        return self.template or self.task_id

    def to_record(self) -> dict:
        """JSON-serialisable dict; inverse of `SweTask.from_record`."""
        d = dataclasses.asdict(self)
        d["fail_to_pass"], d["pass_to_pass"] = list(self.fail_to_pass), list(self.pass_to_pass)
        d["solution"] = [dict(s) for s in self.solution]
        return {"kind": KIND, **d}

    @classmethod
    def from_record(cls, record: dict) -> SweTask:
        """Validates and loads a record.

        Raises:
          ValueError: naming the first bad field.
        """
        if not isinstance(record, dict):
            raise ValueError(f"task record must be an object, got {type(record).__name__}")
        if record.get("kind", KIND) != KIND:
            raise ValueError(f"field 'kind' must be {KIND!r}, got {record.get('kind')!r}")
        for field in ("task_id", "instruction", "test_command"):
            if not isinstance(record.get(field), str) or not record[field].strip():
                raise ValueError(f"field {field!r} must be a non-empty string")
        split = record.get("split", "train")
        if split not in SPLITS:
            raise ValueError(f"field 'split' must be one of {SPLITS}, got {split!r}")
        files = _files(record, "files")
        hidden = _files(record, "hidden_tests", required=False)
        hidden_command = record.get("hidden_command") or ""
        if not isinstance(hidden_command, str):
            raise ValueError("field 'hidden_command' must be a string")
        if not hidden and not hidden_command:
            raise ValueError("a task needs 'hidden_tests' or a 'hidden_command'")
        solution = record.get("solution", [])
        if not isinstance(solution, (list, tuple)) or not all(
            isinstance(s, dict) and isinstance(s.get("name"), str) for s in solution
        ):
            raise ValueError("field 'solution' must be a list of {'name': tool, 'arguments': {}}")
        for field in ("family", "template"):
            if not isinstance(record.get(field, ""), str):
                raise ValueError(f"field {field!r} must be a string")
        for field in ("needs_overwrite", "approved"):
            if not isinstance(record.get(field, False), bool):
                raise ValueError(f"field {field!r} must be a boolean")
        return cls(
            task_id=record["task_id"],
            split=split,
            files=files,
            instruction=record["instruction"],
            test_command=record["test_command"],
            hidden_tests=hidden,
            hidden_command=hidden_command or default_hidden_command(hidden),
            fail_to_pass=_str_list(record, "fail_to_pass"),
            pass_to_pass=_str_list(record, "pass_to_pass"),
            family=record.get("family", ""),
            template=record.get("template", ""),
            needs_overwrite=record.get("needs_overwrite", False),
            solution=tuple(dict(s) for s in solution),
            approved=record.get("approved", False),
        )
