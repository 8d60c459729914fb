"""The held-out tasks are read once per run, and a ledger proves it.

Everything decided before the final evaluation reads other tasks: SFT selection and the
base-model gates the dev split (`tg_jax.data.task_data.dev_tasks`), the periodic RL evaluation
the dev split too, learning-rate tuning the validation split (`tg_jax.train.tuning`). The
held-out tasks are opened by the final evaluation of each run (`FINAL`), once per run: its
episodes are cached in the run's heldout.jsonl, so a rerun reads them back instead.

The read ledger is an append-only JSONL file, one line when a read starts and one when it
ends:

    {"read": "<id>", "event": "start", "purpose": "final evaluation", "run": "tg_seed0",
     "tasks": 128, "asked": false, "attempt": "<claim>#<k>" or "", "workdir": ..., "date"}
    {"read": "<id>", "event": "end", "date": ...}

A run of a registered attempt (workdir/attempt.json, `protocol.attempt_of`) writes it beside
the registry (`ledger_path`: docs/heldout_reads.jsonl for the project's), shared by every
workdir and sitting of the attempt; another run writes workdir/heldout_reads.jsonl. A read
with a start and no end (a crash, a preemption, a killed evaluation) is still a read: it is
listed as "not finished", and a second read of the same run is a second look.

`check_read` refuses a read that would be a second look: the final evaluation of a run that
was already evaluated (its heldout.jsonl deleted, e.g. to evaluate again after a change, or
in another workdir of the same attempt), an evaluation-only read (`EVAL_ONLY`, the eval
stage) once the ledger holds any read of the held-out tasks, or any other purpose (an
analysis such as `tg_jax.evaluation.prefill`), unless the caller asks for it
(`eval.reread_heldout`, or the tool's `--reread_heldout`); an asked read is recorded with
`asked: true` and the report lists it.
"""

from __future__ import annotations

import datetime
import json
import os
import uuid
from typing import Any

from tg_jax import multihost, paths
from tg_jax.errors import RunError

READS_FILE = "heldout_reads.jsonl"
LEGACY_READS_FILE = "heldout_reads.json"  # completed reads, as workdirs before the JSONL kept
FINAL = "final evaluation"
EVAL_ONLY = "evaluation only"  # --config.stage=eval (tg_jax.train.eval_stage): a look too


class HeldoutReadError(RunError):
    """A second read of the held-out split that nobody asked for."""


def _attempt(workdir: str) -> dict[str, Any] | None:
    from tg_jax.evaluation import protocol  # noqa: PLC0415

    return protocol.attempt_of(workdir)


def ledger_path(workdir: str) -> str:
    """The read ledger of `workdir`'s runs: beside the registry for a registered attempt's
    runs (across workdirs), else in the workdir."""
    attempt = _attempt(workdir)
    if attempt and attempt.get("registry"):
        return os.path.join(os.path.dirname(os.fspath(attempt["registry"])) or ".", READS_FILE)
    return os.fspath(paths.as_path(workdir) / READS_FILE)


def _scope(workdir: str) -> tuple[str, str]:
    """(attempt id or "", workdir): which ledger lines are this workdir's runs' reads."""
    attempt = _attempt(workdir)
    return (str(attempt["id"]) if attempt else ""), os.fspath(workdir)


def read_ledger(path: str) -> list[dict[str, Any]]:
    """Every read of a ledger file, merged by id, in order of start: each with "finished"
    (an end line came) and "ended" (its date, or None)."""
    p = paths.as_path(path)
    if not p.exists():
        return []
    out: dict[str, dict[str, Any]] = {}
    for n, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            key, event = rec["read"], rec["event"]
        except (ValueError, KeyError, TypeError) as e:
            raise HeldoutReadError(f"{path}:{n}: not a held-out read ledger line ({e})") from e
        if event == "start":
            out[key] = {
                **{k: v for k, v in rec.items() if k != "event"},
                "finished": False,
                "ended": None,
            }
        elif key in out:
            out[key].update(finished=True, ended=rec.get("date"))
    return list(out.values())


def reads(workdir: str) -> list[dict[str, Any]]:
    """The recorded reads of `workdir`'s runs ([] when none): its attempt's reads in every
    workdir for a registered attempt, else the workdir's (and a legacy heldout_reads.json's,
    all finished)."""
    attempt, where = _scope(workdir)
    entries = read_ledger(ledger_path(workdir))
    if attempt:
        return [r for r in entries if r.get("attempt") == attempt]
    legacy = paths.as_path(workdir) / LEGACY_READS_FILE
    old: list[dict[str, Any]] = []
    if legacy.exists():
        try:
            old = [
                {**r, "finished": True, "ended": r.get("date")}
                for r in json.loads(legacy.read_text())["reads"]
            ]
        except (ValueError, KeyError, TypeError) as e:
            raise HeldoutReadError(f"{legacy}: not a held-out read ledger ({e})") from e
    return old + [r for r in entries if r.get("workdir", where) == where]


def check_read(workdir: str, purpose: str, run: str = "", *, again: bool = False) -> bool:
    """Whether reading the held-out split for (`purpose`, `run`) is a second look (module
    docstring), allowed because `again`; records nothing.

    Raises:
      HeldoutReadError: a second look and not `again`.
    """
    where = ledger_path(workdir)
    if purpose == EVAL_ONLY and (looked := reads(workdir)):
        if again:
            return True
        raise HeldoutReadError(
            f"the held-out tasks of {workdir} were already read ({len(looked)} read(s), the "
            f"first: {looked[0].get('purpose')} of {looked[0].get('run') or '-'} on "
            f"{looked[0].get('date')}; {where}): evaluating {run} on them is another look; set "
            "--config.eval.reread_heldout=True to evaluate anyway (the read is recorded and "
            "the report lists it)"
        )
    if purpose == EVAL_ONLY:
        return False
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
        how = "" if done[0].get("finished") else " (started, not finished)"
        raise HeldoutReadError(
            f"run {run} was already evaluated on the held-out tasks ({done[0].get('date')}"
            f"{how}, in {done[0].get('workdir', workdir)}; {where}) and its heldout.jsonl is "
            "not here: a second evaluation is a second look; restore the file, or set "
            "--config.eval.reread_heldout=True to evaluate again (the read is recorded and "
            "the report lists it)"
        )
    return False


def agreed_check(workdir: str, purpose: str, run: str = "", *, again: bool = False) -> bool:
    """`check_read` by process 0, its verdict on every process (a collective): a process
    that read the ledger itself could find process 0's start line of this very read and
    refuse it as a second look (a 2 x 4 local pod's process 1 did, and process 0 waited in the
    evaluation's gather).

    Raises:
      HeldoutReadError: process 0's check refused the read (on every process)."""
    verdict: tuple[bool, str] = (False, "")
    if multihost.is_primary():
        try:
            verdict = (check_read(workdir, purpose, run, again=again), "")
        except HeldoutReadError as e:
            verdict = (False, str(e))
    second, refused = multihost.agreed(verdict)
    if refused:
        raise HeldoutReadError(refused)
    return second


def final_evaluation(
    cfg, workdir, run_name, run_dir, params, tasks, renderer, *, purpose=FINAL, traces=None
) -> list[Any]:
    """Run `run_name`'s final evaluation on the held-out `tasks` (`heldout.evaluate_run` in
    `run_dir`, `traces` passed on), the one read of them per run: checked against
    (`agreed_check`, asking again with `eval.reread_heldout`), recorded when it starts and when
    it ends; a cached heldout.jsonl is read back, which is no read. `purpose` EVAL_ONLY: the
    eval stage's read of a checkpoint (`tg_jax.train.eval_stage`)."""
    from tg_jax.evaluation import heldout  # noqa: PLC0415 (jax: only when a run evaluates)

    cached = multihost.agreed((paths.as_path(run_dir) / heldout.HELDOUT_FILE).exists())
    again = bool(cfg.eval.get("reread_heldout", False))
    read = None
    if not cached:
        second = agreed_check(workdir, purpose, run_name, again=again)
        read = start_read(workdir, purpose, run_name, tasks=len(tasks), asked=second)
    records = heldout.evaluate_run(cfg, run_dir, params, tasks, renderer=renderer, traces=traces)
    if read is not None:
        finish_read(workdir, read["read"])
    return records


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def start_read(
    workdir: str, purpose: str, run: str = "", *, tasks: int, asked: bool = False
) -> dict[str, Any]:
    """Appends the start of a read to the ledger (the primary process writes) before any task
    is read; returns the entry (its "read" id ends it: `finish_read`)."""
    attempt, where = _scope(workdir)
    entry = {
        "read": uuid.uuid4().hex[:12],
        "event": "start",
        "purpose": purpose,
        "run": run,
        "tasks": int(tasks),
        "asked": bool(asked),
        "attempt": attempt,
        "workdir": where,
        "date": _now(),
    }
    if multihost.is_primary():
        _append(ledger_path(workdir), entry)
    return entry


def finish_read(workdir: str, read_id: str) -> None:
    """Appends that read `read_id` ended."""
    if multihost.is_primary():
        _append(ledger_path(workdir), {"read": read_id, "event": "end", "date": _now()})


def record_read(
    workdir: str, purpose: str, run: str = "", *, tasks: int, asked: bool = False
) -> dict[str, Any]:
    """A read started and ended at once (an analysis tool's loading of the tasks)."""
    entry = start_read(workdir, purpose, run, tasks=tasks, asked=asked)
    finish_read(workdir, entry["read"])
    return entry


def _append(path: str, rec: dict[str, Any]) -> None:
    p = paths.as_path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(rec, sort_keys=True) + "\n"
    if not paths.is_url(os.fspath(path)):
        with open(p, "a", encoding="utf-8") as f:  # one write: concurrent workdirs interleave
            f.write(line)  # whole lines
        return
    text = p.read_text() if p.exists() else ""
    p.write_text(text + line)


def summary(workdir: str) -> dict[str, Any]:
    """For the report: {"reads": [...], "runs_read_once": bool, "extra": [the reads beyond
    each run's one final evaluation], "unfinished": [reads started and not ended],
    "ledger": its path}."""
    entries = reads(workdir)
    seen: set[str] = set()
    extra = []
    for r in entries:
        if r.get("purpose") == FINAL and r.get("run") not in seen and not r.get("asked"):
            seen.add(str(r.get("run")))
        else:
            extra.append(r)
    unfinished = [r for r in entries if not r.get("finished", True)]
    return {
        "reads": entries,
        "runs_read_once": not extra,
        "extra": extra,
        "unfinished": unfinished,
        "ledger": ledger_path(workdir),
    }


def describe(s: dict[str, Any]) -> str:
    """One line for report.md, from a `summary`."""
    runs = sum(1 for r in s["reads"] if r.get("purpose") == FINAL and r not in s["extra"])
    where = os.path.basename(s.get("ledger") or READS_FILE)
    line = f"Held-out reads ({where}): the final evaluation of {runs} run(s), once each"
    unfinished = s.get("unfinished") or []
    if unfinished:
        line += "; **not finished**: " + "; ".join(
            f"{r.get('purpose')}{' of ' + r['run'] if r.get('run') else ''} started {r.get('date')}"
            for r in unfinished
        )
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
    parser.add_argument(
        "--split",
        choices=("dev", "heldout"),
        default="dev",
        help="dev tasks (default), or the held-out tasks of --workdir: a "
        "second read, refused unless --reread_heldout",
    )
    parser.add_argument(
        "--reread_heldout",
        action="store_true",
        help="read the held-out tasks after the final evaluation did "
        "(recorded in the workdir's heldout_reads.json)",
    )


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
