"""The held-out split is read once: by the final evaluation of each run, and a ledger proves it.

Everything decided before the final evaluation reads other tasks: SFT selection and the
base-model gates the dev split (`tg_jax.data.task_data.dev_tasks`), the periodic RL evaluation
the dev split too, learning-rate tuning the validation split (`tg_jax.train.tuning`). The
held-out tasks are opened by the final evaluation of each run (`FINAL`), once per run: its
episodes are cached in the run's heldout.jsonl, so a rerun reads them back instead.

`W/heldout_reads.json` records every completed read of the held-out split in workdir W:

    {"reads": [{"purpose": "final evaluation", "run": "tg_seed0", "tasks": 128,
                "date": "...", "asked": false}, ...]}

`check_read` refuses a read that would be a second look: the final evaluation of a run that
was already evaluated (its heldout.jsonl deleted, e.g. to evaluate again after a change), or
any other purpose (an analysis such as `tg_jax.evaluation.prefill`), unless the caller asks
for it (`eval.reread_heldout`, or the tool's `--reread_heldout`); an asked read is recorded
with `asked: true` and the report lists it.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from tg_jax import multihost, paths
from tg_jax.errors import RunError

READS_FILE = "heldout_reads.json"
FINAL = "final evaluation"


class HeldoutReadError(RunError):
    """A second read of the held-out split that nobody asked for."""


def reads(workdir: str) -> list[dict[str, Any]]:
    """The recorded reads of `workdir` ([] when none)."""
    path = paths.as_path(workdir) / READS_FILE
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
        out = data["reads"]
        if not isinstance(out, list):
            raise TypeError("reads is not a list")
    except (ValueError, KeyError, TypeError) as e:
        raise HeldoutReadError(f"{path}: not a held-out read ledger ({e})") from e
    return out


def check_read(workdir: str, purpose: str, run: str = "", *, again: bool = False) -> bool:
    """Whether reading the held-out split for (`purpose`, `run`) is a second look (module
    docstring), allowed because `again`; records nothing.

    Raises:
      HeldoutReadError: a second look and not `again`.
    """
    where = paths.as_path(workdir) / READS_FILE
    if purpose != FINAL:
        if again:
            return True
        raise HeldoutReadError(
            f"{purpose} would read the held-out tasks of {workdir}, which only the final "
            f"evaluation reads ({where}); pass --reread_heldout to read them anyway (the "
            "read is recorded and the report lists it)"
        )
    done = [r for r in reads(workdir) if r.get("purpose") == FINAL and r.get("run") == run]
    if done and again:
        return True
    if done:
        raise HeldoutReadError(
            f"run {run} was already evaluated on the held-out tasks ({done[0].get('date')}, "
            f"{where}) and its heldout.jsonl is gone: a second evaluation is a second look; "
            "restore the file, or set --config.eval.reread_heldout=True to evaluate again "
            "(the read is recorded and the report lists it)"
        )
    return False


def final_evaluation(cfg, workdir, run_name, run_dir, params, tasks, renderer) -> list[Any]:
    """Run `run_name`'s final evaluation on the held-out `tasks` (`heldout.evaluate_run` in
    `run_dir`), the one read of them per run: checked against (`check_read`, asking again
    with `eval.reread_heldout`) and recorded in `workdir`'s ledger when it runs; a cached
    heldout.jsonl is read back, which is no read."""
    from tg_jax.evaluation import heldout  # noqa: PLC0415 (jax: only when a run evaluates)

    cached = multihost.agreed((paths.as_path(run_dir) / heldout.HELDOUT_FILE).exists())
    again = bool(cfg.eval.get("reread_heldout", False))
    second = not cached and check_read(workdir, FINAL, run_name, again=again)
    records = heldout.evaluate_run(cfg, run_dir, params, tasks, renderer=renderer)
    if not cached:
        record_read(workdir, FINAL, run_name, tasks=len(tasks), asked=second)
    return records


def record_read(
    workdir: str, purpose: str, run: str = "", *, tasks: int, asked: bool = False
) -> dict[str, Any]:
    """Appends a completed read to `workdir/heldout_reads.json` (the primary process writes);
    returns the entry."""
    entry = {
        "purpose": purpose, "run": run, "tasks": int(tasks), "asked": bool(asked),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }  # fmt: skip
    if multihost.is_primary():
        path = paths.as_path(workdir) / READS_FILE
        paths.write_json_atomic(path, {"reads": [*reads(workdir), entry]})
    return entry


def summary(workdir: str) -> dict[str, Any]:
    """For the report: {"reads": [...], "runs_read_once": bool, "extra": [the reads beyond
    each run's one final evaluation]}."""
    entries = reads(workdir)
    seen: set[str] = set()
    extra = []
    for r in entries:
        if r.get("purpose") == FINAL and r.get("run") not in seen and not r.get("asked"):
            seen.add(str(r.get("run")))
        else:
            extra.append(r)
    return {"reads": entries, "runs_read_once": not extra, "extra": extra}


def describe(s: dict[str, Any]) -> str:
    """One line for report.md, from a `summary`."""
    runs = sum(1 for r in s["reads"] if r.get("purpose") == FINAL and r not in s["extra"])
    line = f"Held-out reads ({READS_FILE}): the final evaluation of {runs} run(s), once each"
    if not s["extra"]:
        return line + "; nothing else read the held-out tasks."
    listed = "; ".join(
        f"{r.get('purpose')}{' of ' + r['run'] if r.get('run') else ''} on {r.get('date')}"
        f"{' (asked)' if r.get('asked') else ''}"
        for r in s["extra"]
    )
    return line + f"; **{len(s['extra'])} more read(s)**: {listed}."


ANALYSIS_DEV_SEED = 10  # the dev tasks of the analysis tools (not the gates' or the curves')


def add_split_flags(parser: Any) -> None:
    """`--split` and `--reread_heldout` of an analysis tool (`analysis_tasks`)."""
    parser.add_argument("--split", choices=("dev", "heldout"), default="dev",
                        help="dev tasks (default), or the held-out tasks of --workdir: a "
                        "second read, refused unless --reread_heldout")  # fmt: skip
    parser.add_argument("--reread_heldout", action="store_true",
                        help="read the held-out tasks after the final evaluation did "
                        "(recorded in the workdir's heldout_reads.json)")  # fmt: skip


def analysis_tasks(config: Any, workdir: str, args: Any, n: int, tool: str) -> list[Any]:
    """The tasks of an analysis tool: `n` dev tasks, or with `--split heldout` the first `n`
    held-out tasks of `workdir` after `check_read` (a second read: `--reread_heldout`), the
    read recorded.

    Raises:
      HeldoutReadError: held-out tasks without --reread_heldout.
    """
    from tg_jax.data import task_data  # noqa: PLC0415

    if args.split == "dev":
        return task_data.dev_tasks(config, n, seed=ANALYSIS_DEV_SEED)
    asked = check_read(workdir, tool, again=args.reread_heldout)
    tasks = task_data.load_tasks(task_data.prepare_tasks(config, workdir), "heldout", n)
    record_read(workdir, tool, tasks=len(tasks), asked=asked)
    return tasks
