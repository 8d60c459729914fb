"""A dumped RL step in a notebook: one row's turns, verdicts, hints and per-token D_t.

`find_dumps(workdir)` lists the dump files of a workdir's runs (`rl_loop.dump_rollouts`),
`load_step(path)` reads one step's records and, where `python -m tg_jax.replay` ran on it, the
replay's per-token arrays; `row_html(tokenizer, step, row)` draws a row: a table of its turns
(verdicts per requirement, the hint placed before the turn) and its tokens by role, M
outlined, coloured by the replayed D_t where there is a replay.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import Any

import numpy as np

from tg_jax.notebook.html_render import table_html, tokens_html
from tg_jax.train import rollout_dump


@dataclasses.dataclass
class DumpedStep:
    """One step's dump: `records` (rollout_dump's, in row order) and the replay's per-token
    arrays (`replay` keys: logprob_BxT, entropy_BxT, divergence_BxT, ...; None without one)."""

    path: str
    records: list[dict[str, Any]]
    replay: dict[str, np.ndarray] | None


def find_dumps(workdir: str) -> list[str]:
    """The dump files under workdir/runs/*/rollouts (or a run's own rollouts/), sorted."""
    pattern = os.path.join(rollout_dump.DUMP_DIR, "step_*.array_record")
    found = glob.glob(os.path.join(workdir, "runs", "*", pattern))
    found += glob.glob(os.path.join(workdir, pattern))
    return sorted(found)


def load_step(path: str) -> DumpedStep:
    """The records of a dump file and its replay's arrays where there is one."""
    npz = rollout_dump.beside(path, rollout_dump.REPLAY_SUFFIXES[0])
    replay = dict(np.load(npz)) if os.path.exists(npz) else None
    return DumpedStep(path, rollout_dump.read_dump(path), replay)


def failed_rows(step: DumpedStep) -> list[int]:
    """Indices into `step.records` of the rows with a broken requirement, most TG tokens
    first."""
    failed = [i for i, r in enumerate(step.records) if (np.asarray(r["verdicts_KxR"]) == 0).any()]
    return sorted(failed, key=lambda i: -int(np.asarray(step.records[i]["tg_mask_T"]).sum()))


def turn_rows(record: dict[str, Any], tokenizer: Any) -> list[dict[str, Any]]:
    """Per assistant turn of a record: its verdicts by requirement and the hint placed before
    it (decoded), from the record's requirement ids."""
    names = list(record["requirement_names"])
    turns, req = np.asarray(record["turn_ids_T"]), np.asarray(record["requirement_ids_T"])
    rows = []
    for k, verdicts in enumerate(np.asarray(record["verdicts_KxR"]).tolist()):
        ids = req[np.roll(turns, -1) == k]  # position t predicts token t + 1
        hinted = sorted({names[i] for i in ids.tolist() if i >= 0})
        hint = " / ".join(
            tokenizer.decode(np.asarray(record["hints"][n]).tolist())
            for n in hinted
            if n in record["hints"]
        )
        shown = {
            n: {1: "met", 0: "BROKEN", -1: "-"}[v] for n, v in zip(names, verdicts, strict=True)
        }
        rows.append({"turn": k, **shown, "hint before": hint})
    return rows


def row_html(tokenizer: Any, step: DumpedStep, row: int) -> str:
    """Row `row` of `step.records` (module docstring)."""
    rec = step.records[row]
    n = len(rec["tokens_T"])
    # The record's per-target arrays describe token t + 1 at position t: shift onto tokens.
    mask = np.concatenate([[False], np.asarray(rec["tg_mask_T"], bool)[:-1]])
    values = None
    if step.replay is not None:
        d = step.replay["divergence_BxT"][int(rec["row"]), :n]
        values = np.where(mask, np.concatenate([[0.0], d[:-1]]), np.nan)
    title = (
        f"step {rec['step']} row {rec['row']}: task {rec['task_id']}, group {rec['group_id']}, "
        f"policy version {rec['policy_version']}, reward {rec['reward']:.3g} {rec['rewards']}"
    )
    return table_html(turn_rows(rec, tokenizer), title=title) + tokens_html(
        tokenizer,
        rec["tokens_T"],
        roles=rec["roles_T"],
        mask=mask,
        values=values,
        value_name="D_t (replay)",
    )
