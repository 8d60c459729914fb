"""Where an RL step's time goes: each arm's phase shares, from its runs' train metrics.

Each step of `tg_jax.train.rl` logs host wall times with the device's work finished
(`jax.block_until_ready` after the train step): time/sample_wait_s (waiting for the step's
rollout group; with synchronous sampling, the whole rollout; with async sampling, only what
the trainer waits), time/build_batch_s, time/train_s (the jitted step and the weights'
publication to the sampler) and time/step_s (the whole step). A phase's share is its sum over
every step of every seed divided by the sum of time/step_s; "other" is the rest (metrics,
costs). The rollout's own wall time (time/rollout_s, overlapping training when sampling is
async) and, with the built-in or vLLM engine, its split (time/rollout_engine_s in the engine's
prefill and decode; time/rollout_tool_wait_s with no engine work while the environments run
their tools) and the engine's weight sync (time/weight_sync_s) are given as shares of the
step time beside them. Checkpoints and periodic evaluations fall between steps
and are in none of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tg_jax.evaluation.md_cells import table
from tg_jax.evaluation.plots import PHASES_FILE

# (name in results and plots, metric summed), in the order a step runs them.
PHASES = (
    ("waiting for rollouts", "time/sample_wait_s"),
    ("building the batch", "time/build_batch_s"),
    ("train step", "time/train_s"),
)
ASIDE = (
    ("rollout wall time", "time/rollout_s"),
    ("engine prefill + decode", "time/rollout_engine_s"),
    ("engine idle on tools", "time/rollout_tool_wait_s"),
    ("engine weight sync", "time/weight_sync_s"),
)


def phase_shares(train_records: Sequence[Sequence[dict[str, Any]]]) -> dict[str, Any]:
    """{"steps", "step_s" (mean seconds per step), "shares" {phase: share, "other": rest},
    "aside" {name: share}} over the train records of an arm's runs; {} without timed steps."""
    rows = [r for recs in train_records for r in recs if r.get("stage") == "train"]
    rows = [r for r in rows if r.get("time/step_s") is not None]
    total = float(sum(r["time/step_s"] for r in rows))
    if not rows or total <= 0:
        return {}

    def share(metric: str) -> float:
        return float(sum(r.get(metric, 0.0) for r in rows)) / total

    shares = {name: share(metric) for name, metric in PHASES}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    return {
        "steps": len(rows),
        "step_s": total / len(rows),
        "shares": shares,
        "aside": {name: share(metric) for name, metric in ASIDE},
    }


def phases_section(res: dict[str, Any]) -> list[str]:
    """report.md's table of each arm's phase shares, and the plot (`plots.plot_phases`)."""
    arms = {a: v["step_phases"] for a, v in res["arms"].items() if v.get("step_phases")}
    if not arms:
        return []
    names = [n for n, _ in PHASES] + ["other"]
    rows = [
        [arm, f"{p['step_s']:.2f}", str(p["steps"])]
        + [f"{100 * p['shares'][n]:.0f}%" for n in names]
        + [f"{100 * p['aside'][n]:.0f}%" for n, _ in ASIDE]
        for arm, p in arms.items()
    ]
    header = ["arm", "step (s)", "steps"] + names + [n for n, _ in ASIDE]
    return (
        ["## Where an RL step's time goes (share of the step, seeds pooled)", ""]
        + table(header, rows)
        + [
            "",
            "Host wall times with the device's work finished; with async sampling the wait is "
            "what the trainer waits, and the rollout's own wall time overlaps training "
            "(`tg_jax.evaluation.step_phases`). Checkpoints and periodic evaluations fall "
            "between steps.",
            "",
            f"![{PHASES_FILE}]({PHASES_FILE})",
            "",
        ]
    )
