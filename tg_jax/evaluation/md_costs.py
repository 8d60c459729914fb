"""report.md's costs section: each arm's wall times, tokens, teacher FLOPs and peak memory
(`COST_KEYS`, the `RunResult.costs` keys), whether each thinking-token arm had TG's
distilled-token budget, and the protocol's compute time."""

from __future__ import annotations

from typing import Any

from tg_jax.evaluation.md_cells import big, minutes, num, table

# Cost columns of the report, in this order (RunResult.costs keys).
COST_KEYS = (
    "wall_time_s",
    "eval_wall_time_s",
    "sampled_tokens",
    "teacher_forward_flops",
    "distilled_tokens",
    "peak_memory_bytes",
    "peak_memory_above_start_bytes",
)
# The thinking-token controls: each of THINKING_ARMS is compared with THINKING_BASE at their
# distilled-token costs (tg_think_budget, _hidden, _short: at most tg's budget per step).
THINKING_BASE = "tg"
THINKING_ARMS = ("tg_think", "tg_think_budget", "tg_think_hidden", "tg_think_short")


def costs_section(res: dict[str, Any]) -> list[str]:
    rows = []
    for arm, a in res["arms"].items():
        c = a["costs"]
        cells = []
        for k in COST_KEYS:
            if k not in c:
                cells.append("n/a")
            elif k.endswith("wall_time_s"):
                cells.append(f"{c[k]['mean']:.1f}")
            else:
                cells.append(big(c[k]["mean"]))
        rows.append([arm] + cells)
    lines = ["## Costs per arm (mean over seeds)", ""]
    header = [
        "arm",
        "RL wall time (s)",
        "held-out eval (s)",
        "sampled tokens",
        "teacher forward FLOPs",
        "distilled tokens",
        "peak memory (B, this run)",
        "above the run's start (B)",
    ]
    lines += table(header, rows) + [""]
    lines += [
        "Distilled tokens: student tokens under the TG KL mask, summed over the run. Peak "
        "memory: measured per run from its first step (device memory where the backend "
        "reports it, else host RSS), not the process's lifetime peak; what earlier runs of "
        "the same process left allocated is in it, and the last column is the run's own "
        "addition (peak minus the memory in use when it started).",
        "",
    ] + thinking_control(res)
    ct = res.get("compute_time") or {}
    if ct:
        eval_s = ct["eval_s"] if ct["eval_runs"] else None
        parts = [f"SFT {minutes(ct.get('sft_s'))}"]
        if ct.get("tune_s") is not None:
            parts.append(f"learning-rate trials {minutes(ct['tune_s'])}")
        parts += [f"RL {minutes(ct['rl_s'])}", f"held-out evaluation {minutes(eval_s)}"]
        timed = f"{ct['eval_runs']} of {ct['runs']} runs timed"
        lines += [
            "Compute time of the protocol (sum of the stages' wall times; a resumed stage sums "
            f"its sessions; start-up and data not counted): {' + '.join(parts)} = "
            f"**{'' if ct['complete'] else 'at least '}{minutes(ct['total_s'])}** (held-out "
            f"evaluation: {timed}).",
            "",
        ]
    return lines


def thinking_control(res: dict[str, Any]) -> list[str]:
    """Whether each thinking-token arm was compared with TG at an equal distilled budget."""
    lines = []
    base = res["arms"].get(THINKING_BASE, {}).get("costs", {}).get("distilled_tokens")
    for arm in THINKING_ARMS:
        think = res["arms"].get(arm, {}).get("costs", {}).get("distilled_tokens")
        if not base or not think:
            continue
        ratio = think["mean"] / base["mean"] if base["mean"] else float("nan")
        equal = abs(ratio - 1.0) <= 0.1
        lines += [
            f"Thinking-token control: `{arm}` distilled {big(think['mean'])} tokens, "
            f"`{THINKING_BASE}` {big(base['mean'])} (ratio {num(ratio)}): "
            + (
                "an equal distilled-token budget (within 10%), so their difference is the "
                "thinking tokens' effect."
                if equal
                else "NOT an equal distilled-token budget (more than 10% apart): part of their "
                "difference may be the amount of distillation, not the thinking tokens."
            ),
            "",
        ]
    return lines
