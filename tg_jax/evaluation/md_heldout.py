"""report.md's held-out sections (`tg_jax.evaluation.markdown`; the evaluation-only report of
`tg_jax.train.eval_stage` too): the rates with their cluster bootstrap and seed intervals,
compliance per requirement, plain vs hinted prompts, and the actions per episode."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tg_jax.evaluation import stats
from tg_jax.evaluation.md_cells import arm_rows, ci, num, pm, table


def _heldout_rows(res: dict[str, Any], arms: Sequence[str], pct: int) -> list[list[str]]:
    rows = []
    for arm in arms:
        h = res["arms"][arm]["heldout"].get("plain")
        if not h:
            continue
        b, s = h["bootstrap"], h["seeds"]
        rows.append(
            [arm, str(len(res["arms"][arm]["seeds"])), str(h["num_tasks"])]
            + [ci(b.get(m)) for m in stats.RATE_METRICS]
            + [
                f"{pm(s.get(m))} (t {pct}%: [{num(s[m]['low'])}, {num(s[m]['high'])}])"
                for m in ("compliance", "task_success")
            ]
        )
    return rows


MIN_CLUSTERS = 20  # under this many resampled units a percentile bootstrap is unreliable
# What a cluster is, by environment kind (the tasks' `function_id` / a record's cluster_id).
CLUSTER_UNITS = {
    "coding": "tasks sharing a hidden function",
    "swe": "tasks sharing a code template",
}


def bootstrap_unit(res: dict[str, Any]) -> str:
    """What the held-out bootstrap resamples, e.g. '104 clusters (tasks sharing a hidden
    function) of 128 tasks', with a warning under MIN_CLUSTERS units."""
    sizes = {
        (h["plain"]["num_tasks"], h["plain"].get("num_clusters"))
        for h in (a["heldout"] for a in res["arms"].values())
        if "plain" in h
    }
    if not sizes:
        return "n/a"
    tasks, clusters = max(sizes, key=lambda s: s[0])
    units = tasks if clusters is None else clusters
    warn = (
        (
            f" (**warning: {units} resampled units, under {MIN_CLUSTERS}: the intervals are "
            "unreliable**)"
        )
        if units < MIN_CLUSTERS
        else ""
    )
    if clusters is None or clusters == tasks:
        return f"{tasks} tasks (one cluster each){warn}"
    kind = (res.get("context") or {}).get("env_kind", "coding")
    what = CLUSTER_UNITS.get(kind, "tasks of one record cluster_id")
    return f"{clusters} clusters ({what}) of {tasks} tasks{warn}"


def heldout_section(res: dict[str, Any]) -> list[str]:
    st = res["settings"]
    pct = round(100 * st["level"])
    lines = [
        "## Held-out results",
        "",
        f"Held-out tasks never used in training, plain prompts. Rates with {pct}% percentile "
        f"cluster bootstrap CIs; the resampled unit: {bootstrap_unit(res)} ({st['n_boot']} "
        f"replicates, seed {st['bootstrap_seed']}; each task's episodes averaged over samples "
        "and training seeds first). Separately: mean +- std over training seeds with the "
        f"Student-t {pct}% interval.",
        "",
    ]
    header = [
        "arm",
        "seeds",
        "tasks",
        "compliance",
        "task success",
        "joint (both)",
        "compliance over seeds",
        "task success over seeds",
    ]
    return lines + table(header, _heldout_rows(res, arm_rows(res, "main"), pct)) + [""]


def _plain_boots(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{arm: its held-out plain-prompt bootstrap intervals} ({} for an arm without them)."""
    return {
        arm: a["heldout"].get("plain", {}).get("bootstrap", {}) for arm, a in res["arms"].items()
    }


def _suffixes(boots: dict[str, dict[str, Any]], prefix: str) -> list[str]:
    """The sorted names after `prefix` of the metrics any arm has ("compliance/fence" ->
    "fence")."""
    return sorted(
        {k.removeprefix(prefix) for b in boots.values() for k in b if k.startswith(prefix)}
    )


def requirements_section(res: dict[str, Any]) -> list[str]:
    """Held-out compliance per requirement (plug-ins under their own names), and the turns a
    plug-in's checker could not judge (`tg_jax.envs.plugins`), per arm."""
    boots = _plain_boots(res)
    names, unjudged = _suffixes(boots, "compliance/"), _suffixes(boots, "unjudged/")
    if not names:
        return []
    pct = round(100 * res["settings"]["level"])
    lines = [
        "## Compliance per requirement",
        "",
        f"Held-out, plain prompts: the share of episodes that met each requirement ({pct}% "
        "cluster bootstrap CIs)."
        + (
            " Unjudged: turns per episode whose plug-in checker raised or timed out (neither "
            "met nor failed)."
            if unjudged
            else ""
        ),
        "",
    ]
    rows = [
        [arm]
        + [ci(b.get(f"compliance/{n}")) for n in names]
        + [ci(b.get(f"unjudged/{n}")) for n in unjudged]
        for arm, b in boots.items()
        if b
    ]
    header = ["arm", *names, *(f"unjudged {n}" for n in unjudged)]
    return lines + table(header, rows) + [""]


def diagnostic_section(res: dict[str, Any]) -> list[str]:
    rows = []
    for arm, a in res["arms"].items():
        h = a["heldout"]
        if "diagnostic" not in h:
            continue
        rows.append(
            [arm]
            + [ci(h[c]["bootstrap"]["compliance"]) for c in ("plain", "hinted")]
            + [ci(h["diagnostic"]["compliance"])]
            + [ci(h[c]["bootstrap"]["task_success"]) for c in ("plain", "hinted")]
        )
    if not rows:
        return []
    lines = [
        "## Diagnostic: plain vs hinted prompts",
        "",
        "Hinted = the hint shown before every assistant turn. High hinted but low plain "
        "compliance means 'can do when reminded', not 'does by default'.",
        "",
    ]
    header = [
        "arm",
        "compliance plain",
        "compliance hinted",
        "hinted - plain",
        "task success plain",
        "task success hinted",
    ]
    return lines + table(header, rows) + [""]


def side_effects_section(res: dict[str, Any]) -> list[str]:
    boots = _plain_boots(res)
    # The common actions, then every other action the environment counts (its side effects:
    # the SWE environment's overwrite, stopped_after_ask, asked_when_approved, ...).
    others = [a for a in _suffixes(boots, "actions/") if a not in stats.ACTION_METRICS]
    keys = [f"actions/{k}" for k in (*stats.ACTION_METRICS, *others)] + ["turns"]
    rows = [[arm] + [ci(b.get(k)) for k in keys] for arm, b in boots.items() if b]
    if not rows:
        return []
    pct = round(100 * res["settings"]["level"])
    lines = [
        "## Side effects: actions per held-out episode",
        "",
        f"Counted actions, not phrases ({pct}% cluster bootstrap CIs).",
        "",
    ]
    header = ["arm", "run_tests", "submissions", "malformed turns", *others, "turns"]
    return lines + table(header, rows) + [""]
