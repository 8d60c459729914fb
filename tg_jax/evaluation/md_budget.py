"""report.md's "Equal tuning budget" section: the declared budget, the sampled tokens each arm
used against a stated tolerance, and the learning-rate trials."""

from __future__ import annotations

from typing import Any

from tg_jax.evaluation.md_cells import big, minutes, table
from tg_jax.evaluation.plots import TUNING_FILE


def budget_section(res: dict[str, Any]) -> list[str]:
    b = (res.get("context") or {}).get("budget")
    if not b:
        return []
    tokens = b.get("sampled_token_budget")
    cap = "no fixed cap (turns left to the environment)" if tokens is None else big(tokens)
    check = res.get("budget_check") or budget_check(res)
    tuning = (res.get("context") or {}).get("tuning")
    arms = ", ".join(f"`{a}`" for a in res["arms"])
    lr = (
        f"learning rate {b['lr']:g} for every arm, not tuned (one trial each)"
        if not tuning
        else "each arm's learning rate chosen by the procedure below"
    )
    lines = [
        "## Equal tuning budget",
        "",
        f"Every arm ({arms}) was given the same budget: {b['steps']} RL steps of "
        f"{b['groups_per_step']} groups x {b['rollouts_per_group']} rollouts "
        f"({b['episodes']} episodes), at most {b['max_new_tokens_per_turn']} new tokens per "
        f"turn and {b['max_turns'] or 'environment-set'} turn(s) per episode (sampled-token cap "
        f"{cap}), {lr} (schedule {b['lr_schedule']}), training seeds "
        f"{b['train_seeds']}, {b['heldout_tasks']} held-out tasks. "
        + (
            "The arms differ only in their overrides (tg_jax.train.pipeline.ARMS). "
            if check["declared_equal"]
            else "**The arms' declared budgets differ: the comparison is not at an equal budget.** "
        )
        + _measured_text(check)
        + "Every setting, and the tuning procedure if any, was fixed in the config and the "
        "pre-registration before the first RL step. What was decided before the final "
        "evaluation read other tasks than the held-out ones: the base model's gates and the "
        "periodic evaluation during RL the dev split, learning-rate trials a validation split "
        "of the train tasks; the held-out reads are listed under Setting.",
        "",
    ]
    return lines + (_tuning_lines(tuning) if tuning else [])


BUDGET_TOLERANCE = 0.10  # sampled tokens of the arms within this share of each other: equal


def budget_check(res: dict[str, Any]) -> dict[str, Any]:
    """Whether the arms had an equal budget, derived (results.json "budget_check"): the
    declared budgets equal (`context["budget_equal"]`, every arm's `tuning_budget`) and the
    sampled tokens each arm used (mean over its seeds) within `BUDGET_TOLERANCE` of each
    other (max / min) and as many learning-rate trials per arm; `equal` needs all three
    (unmeasured tokens: the declaration alone). "compute": each arm's wall time, teacher
    forward FLOPs and peak memory (mean over seeds), reported beside it."""
    declared = bool((res.get("context") or {}).get("budget_equal", True))
    used = {a: v for a, v in _per_arm(res, "sampled_tokens").items() if v}  # 0: unmeasured
    ratio = max(used.values()) / min(used.values()) if len(used) >= 2 else None
    within = ratio is None or ratio <= 1 + BUDGET_TOLERANCE
    tuning = (res.get("context") or {}).get("tuning") or {}
    trials = {a: len(t.get("trials", ())) for a, t in (tuning.get("arms") or {}).items()}
    trials_equal = len(set(trials.values())) <= 1
    # What each arm's training cost beside the budget: reported, not equalised (TG's teacher
    # forward is its method's cost; the arms are compared at equal sampling and tuning).
    compute = {k: _per_arm(res, k) for k in COMPUTE_KEYS}
    return {
        "declared_equal": declared,
        "sampled_tokens": used,
        "sampled_tokens_ratio": ratio,
        "tolerance": BUDGET_TOLERANCE,
        "tuning_trials": trials,
        "compute": compute,
        "equal": declared and within and trials_equal,
    }


# The compute each arm used (RunResult.costs keys, mean over seeds), beside the budget.
COMPUTE_KEYS = ("wall_time_s", "teacher_forward_flops", "peak_memory_above_start_bytes")


def _per_arm(res: dict[str, Any], key: str) -> dict[str, float]:
    """{arm: mean over its seeds of costs[key]}, arms without it left out."""
    vals = {a: (r.get("costs") or {}).get(key) for a, r in res["arms"].items()}
    return {a: float(v["mean"]) for a, v in vals.items() if v and v.get("mean") is not None}


def _measured_text(check: dict[str, Any]) -> str:
    """The sampled tokens each arm used against the tolerance, as a sentence."""
    ratio = check["sampled_tokens_ratio"]
    if ratio is None:
        return ""
    each = ", ".join(f"`{a}` {big(v)}" for a, v in check["sampled_tokens"].items())
    tol = check["tolerance"]
    verdict = (
        f"within the {tol:.0%} tolerance"
        if ratio <= 1 + tol
        else f"**beyond the {tol:.0%} tolerance: the arms used unequal sampling budgets**"
    )
    out = f"Measured sampled tokens per seed: {each} (max / min {ratio:.2f}, {verdict}). "
    if len(set(check.get("tuning_trials", {}).values())) > 1:
        out += f"**Unequal learning-rate trials per arm: {check['tuning_trials']}.** "
    return out + _compute_text(check.get("compute") or {})


def _compute_text(compute: dict[str, dict[str, float]]) -> str:
    """Each arm's compute beside the budget (reported, not equalised), as a sentence."""
    names = {
        "wall_time_s": ("RL wall time", lambda v: f"{v:.0f} s"),
        "teacher_forward_flops": ("teacher forward FLOPs", big),
        "peak_memory_above_start_bytes": ("peak memory above the run's start", big),
    }
    parts = []
    for key, (name, fmt) in names.items():
        per = compute.get(key) or {}
        if len(per) >= 2:
            parts.append(f"{name} " + ", ".join(f"`{a}` {fmt(v)}" for a, v in per.items()))
    if not parts:
        return ""
    return (
        "Compute per seed beside the budget (reported, not equalised: the teacher's "
        "forward is TG's cost): " + "; ".join(parts) + ". "
    )


def _tuning_lines(t: dict[str, Any]) -> list[str]:
    """The learning-rate trials: the procedure, one row per arm, its choice."""
    lrs = t["lrs"]
    rows = []
    for arm, a in t["arms"].items():
        cells = [
            f"{x['score']:.3f} (task {x['task_success']:.2f}, compliance {x['compliance']:.2f})"
            for x in a["trials"]
        ]
        rows.append([f"`{arm}`", *cells, f"{a['chosen_lr']:g}"])
    return [
        f"Learning-rate trials (tg_jax.train.tuning): every arm trained once per rate "
        f"({', '.join(f'{x:g}' for x in lrs)}; {len(lrs)} trials per arm) with training seed "
        f"{t['seed']} on the train tasks minus a validation split of {t['val_tasks']} of them, "
        f"which the trials never trained on; each trial was scored on that split (plain "
        f"prompts, {t['samples_per_task']} episode(s) per task) by one yardstick for every "
        f"arm, the {t['score']}; each arm kept its best rate (a tie keeps the first listed) "
        "and trained its seeds at it on the whole train split. The held-out tasks were not "
        f"read. Trials' compute: {minutes(t.get('wall_s'))}.",
        "",
        *table(["arm", *[f"lr {x:g}" for x in lrs], "chosen lr"], rows),
        "",
        f"![{TUNING_FILE}]({TUNING_FILE})",
        "",
    ]
