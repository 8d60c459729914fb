"""The results ledger: what a registered attempt's verdict is computed from, committed beside
the registry so that it outlives the machine that ran it.

    <registry's dir>/ledger/<claim>/<attempt>/
        attempt.json          the registration: claim parts, arms, seeds, margin, level,
                              spend, floor, held-out draw (written at registration)
        <arm>_seed<s>.json    one finished (arm, seed): its held-out per-task outcomes (plain
                              prompts), the exported policy's weights sha256, commit, config
                              and machine
        base.json             the base model's held-out outcomes, when evaluated

A run file is written when its run's final evaluation ends (`record_run`), never rewritten.
An attempt may span sittings (machines, workdirs): each sitting registers the same attempt
(the same pre-registration finds its registry entry and draws the same tasks), runs its
(arm, seed) pairs, and commits their files; `python -m tg_jax.evaluation.verdict
--attempt=ID` computes the verdict from this directory alone once every pair is in
(`missing` lists the others).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from collections.abc import Sequence
from typing import Any

from tg_jax import paths
from tg_jax.errors import ConfigError

LEDGER_DIR = "ledger"
ATTEMPT_FILE = "attempt.json"
BASE_FILE = "base.json"
# An attempt's fields as registered (tg_jax.evaluation.protocol copies them from its entry).
REGISTERED_FIELDS = (
    "id",
    "claim",
    "attempt",
    "parts",
    "hypothesis",
    "config",
    "candidate",
    "baseline",
    "seeds",
    "margin",
    "level",
    "spend",
    "heldout",
    "earlier",
)
# The attempt fields attempt.json keeps (the task records stay in the workdir's attempt.json).
ATTEMPT_FIELDS = (*REGISTERED_FIELDS, "floor", "collapse_drop", "registry")


class LedgerError(ConfigError):
    """A ledger directory that cannot give a verdict (missing, malformed, mismatched runs)."""


def attempt_dir(registry: str, claim: str, attempt: int | str) -> str:
    """The ledger directory of attempt `attempt` of `claim`, beside `registry`."""
    root = os.path.dirname(os.fspath(registry)) or "."
    return os.path.join(root, LEDGER_DIR, str(claim), str(attempt))


def dir_of(registry: str, attempt_id: str) -> str:
    """The ledger directory of attempt id "<claim>#<k>"."""
    claim, sep, k = str(attempt_id).rpartition("#")
    if not sep or not claim or not k.isdigit():
        raise LedgerError(f"--attempt={attempt_id!r} is not an attempt id <claim>#<k>")
    return attempt_dir(registry, claim, int(k))


def write_attempt(attempt: dict[str, Any]) -> str:
    """Writes the attempt's attempt.json (once; a later sitting checks it is the same)."""
    out = attempt_dir(attempt["registry"], attempt["claim"], attempt["attempt"])
    path = os.path.join(out, ATTEMPT_FILE)
    rec = {k: attempt.get(k) for k in ATTEMPT_FIELDS}
    if os.path.exists(path):
        stored = _read(path)
        if stored.get("id") != rec["id"] or stored.get("config") != rec["config"]:
            raise LedgerError(f"{path} is attempt {stored.get('id')}, not {rec['id']}")
        return path
    os.makedirs(out, exist_ok=True)
    paths.write_json_atomic(path, rec, indent=1, sort_keys=True)
    return path


def run_file(directory: str, arm: str, seed: int | None) -> str:
    """The file of one (arm, seed); the base model (seed None) is base.json."""
    return os.path.join(directory, BASE_FILE if seed is None else f"{arm}_seed{int(seed)}.json")


def outcomes(records: Sequence[Any], condition: str = "plain") -> dict[str, dict[str, Any]]:
    """{task_id: {"cluster", "episodes", "wins" (task successes), "compliant": {requirement:
    episodes meeting it}}} of the episodes of `condition` (EpisodeRecords or their dicts)."""
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        r = r if isinstance(r, dict) else vars(r)
        if r.get("condition") != condition:
            continue
        cell = out.setdefault(
            str(r["task_id"]), {"cluster": "", "episodes": 0, "wins": 0, "compliant": {}}
        )
        cell["cluster"] = str(r.get("cluster_id") or r["task_id"])
        cell["episodes"] += 1
        cell["wins"] += int(bool(r["task_success"]))
        for req, ok in (r.get("compliance") or {}).items():
            cell["compliant"][req] = cell["compliant"].get(req, 0) + int(bool(ok))
    return dict(sorted(out.items()))


def episodes(run: dict[str, Any]) -> list[Any]:
    """A run file's outcomes as episode records again (task success and cluster; the i-th
    episode of a task with w wins succeeds iff i < w): every per-task mean, and so the
    verdict, is the evaluation's."""
    from tg_jax.sampling.episode import EpisodeRecord  # noqa: PLC0415

    out = []
    for task_id, cell in run["outcomes"].items():
        for i in range(int(cell["episodes"])):
            out.append(
                EpisodeRecord(
                    task_id=task_id,
                    condition="plain",
                    sample=i,
                    task_success=i < int(cell["wins"]),
                    compliance={},
                    actions={},
                    turns=0,
                    cluster_id=str(cell["cluster"]),
                )
            )
    return out


def write_run(
    attempt: dict[str, Any],
    arm: str,
    seed: int | None,
    per_task: dict[str, dict[str, Any]],
    *,
    policy_sha256: str,
    commit: str,
    config: dict[str, Any],
    machine: dict[str, Any],
) -> str:
    """Writes one finished (arm, seed) of `attempt` (not over an existing file: a run's
    outcomes are read once); returns its path.

    Raises:
      LedgerError: the file exists with other outcomes (a second evaluation of the run).
    """
    directory = attempt_dir(attempt["registry"], attempt["claim"], attempt["attempt"])
    path = run_file(directory, arm, seed)
    rec = {
        "attempt": attempt["id"],
        "arm": arm,
        "seed": seed,
        "outcomes": per_task,
        "policy_sha256": policy_sha256,
        "commit": commit,
        "config": config,
        "machine": machine,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    if os.path.exists(path):
        if _read(path).get("outcomes") != per_task:
            raise LedgerError(f"{path} holds other outcomes for {arm} seed {seed}: not rewritten")
        return path
    os.makedirs(directory, exist_ok=True)
    paths.write_json_atomic(path, rec, indent=1, sort_keys=True)
    return path


def git_commit() -> str:
    """HEAD of the checkout tg_jax runs from ("unknown" outside git), "+dirty" when its
    tracked files differ."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def read_attempt(directory: str) -> tuple[dict[str, Any], dict[tuple[str, int | None], dict]]:
    """(attempt.json, {(arm, seed): run file}) of a ledger directory (seed None: base.json).

    Raises:
      LedgerError: no attempt.json, or a file that is not a ledger file of this attempt.
    """
    path = os.path.join(directory, ATTEMPT_FILE)
    if not os.path.exists(path):
        raise LedgerError(f"{path}: no such ledger attempt (written when it was registered)")
    attempt = _read(path)
    runs: dict[tuple[str, int | None], dict] = {}
    for name in sorted(os.listdir(directory)):
        if name == ATTEMPT_FILE or not name.endswith(".json"):
            continue
        rec = _read(os.path.join(directory, name))
        if rec.get("attempt") != attempt.get("id") or "outcomes" not in rec:
            raise LedgerError(f"{directory}/{name}: not a run of attempt {attempt.get('id')}")
        runs[(str(rec["arm"]), rec.get("seed"))] = rec
    return attempt, runs


def missing(attempt: dict[str, Any], runs: dict) -> list[tuple[str, int]]:
    """The (arm, seed) pairs of the candidate and baseline that the ledger lacks."""
    return [
        (arm, int(s))
        for arm in (attempt["candidate"], attempt["baseline"])
        for s in attempt["seeds"]
        if (arm, int(s)) not in runs
    ]


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            out = json.load(f)
        if not isinstance(out, dict):
            raise TypeError("not a JSON object")
        return out
    except (OSError, ValueError, TypeError) as e:
        raise LedgerError(f"{path}: not a ledger file ({e})") from e
