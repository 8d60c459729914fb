"""report.md from `tg_jax.evaluation.report.compute_results` output, one helper per section."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tg_jax.evaluation import heldout_reads, stats
from tg_jax.evaluation.md_budget import budget_section
from tg_jax.evaluation.md_cells import big, ci, minutes, num, pm, table
from tg_jax.evaluation.plots import (
    ACTIONS_FIGURE,
    CURVE_METRICS,
    FOREST_FILE,
    action_names,
    curve_file,
    curve_groups,
)

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


def _arm_rows(res: dict[str, Any], group: str) -> list[str]:
    return [a for a, v in res["arms"].items() if v["group"] == group]


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


def _verdict_section(res: dict[str, Any]) -> list[str]:
    st, ni = res["settings"], res.get("noninferiority")
    if res.get("single_arm"):
        return [
            f"**One arm, no comparison.** The baseline arm `{st['baseline']}` was not run "
            "(`pipeline.arms`), so there is no non-inferiority verdict; run both arms (e.g. "
            "`--config.pipeline.arms=\"('grpo','tg')\"`; a bare grpo,tg is one arm name) to "
            "test it.",
            "",
        ]
    if not ni:
        return []
    pct = round(100 * st["level"])
    if ni["verdict"] == "not meaningful" and ni.get("collapsed_baseline_seeds"):
        return [
            f"**Non-inferiority of `{st['candidate']}` vs `{st['baseline']}` on held-out task "
            f"success: NOT MEANINGFUL.** The {ni['why']} in that run: a drop measured against "
            "a run that lost its skill says nothing about skill kept, so neither pass nor fail "
            "is reported. "
            f"(Difference {num(ni['mean'], 3)}, lower bound {num(ni['lower'], 3)} vs margin "
            f"{num(ni['margin'], 3)}.)",
            "",
        ]
    if ni["verdict"] == "not meaningful":
        return [
            f"**Non-inferiority of `{st['candidate']}` vs `{st['baseline']}` on held-out task "
            f"success: NOT MEANINGFUL.** The baseline's held-out task success "
            f"{num(ni.get('baseline_success'), 3)} is under the floor {num(ni['floor'], 3)}: "
            "an arm that solves (almost) nothing cannot show a drop, so neither pass nor fail "
            f"is reported. (Difference {num(ni['mean'], 3)}, lower bound "
            f"{num(ni['lower'], 3)} vs margin {num(ni['margin'], 3)}.)",
            "",
        ]
    if ni["verdict"] == "exploratory":
        return [
            f"**Non-inferiority of `{st['candidate']}` vs `{st['baseline']}` on held-out task "
            f"success: EXPLORATORY ({ni.get('why', '')}).** A verdict needs "
            f"{stats.MIN_SEEDS} training seeds per arm (`--config.eval.train_seeds`): the "
            "training seed is the unit of the interval, and its spread is estimated only from "
            f"several seeds. Difference {num(ni['mean'], 3)}, lower bound of the two-sided "
            f"{pct}% interval {num(ni['lower'], 3)} vs margin {num(ni['margin'], 3)}.",
            "",
        ] + _behaviour_cost(res)
    return [
        f"**Non-inferiority of `{st['candidate']}` vs `{st['baseline']}` on held-out task "
        f"success: {ni['verdict'].upper()}.** Difference {num(ni['mean'], 3)}, lower bound "
        f"of the two-sided {pct}% interval over training seeds ({ni['interval']}) "
        f"{num(ni['lower'], 3)} vs margin {num(ni['margin'], 3)} (fixed in the config "
        "before the run; pass iff lower bound >= margin; meaningful iff the baseline's task "
        f"success >= floor {num(st['floor'], 3)}).",
        "",
    ] + _behaviour_cost(res)


def _behaviour_cost(res: dict[str, Any]) -> list[str]:
    """What following the requirement already cost the base model (its hinted vs plain pass
    rate, sft_eval.json): part of a task-success gap between an arm that complies and one
    that does not can be the behaviour's own cost, not lost skill."""
    base = (res.get("context") or {}).get("base_model") or {}
    plain, hinted = base.get("pass_rate"), base.get("hinted_pass_rate")
    if plain is None or hinted is None:
        return []
    return [
        f"At the base model (sft_eval.json, temperature 1), hinted prompts (the requirement "
        f"followed) solve {num(hinted)} of the held-out tasks vs {num(plain)} plain: the "
        f"behaviour's own cost there is {num(hinted - plain, 3)}, to read beside the "
        "difference above. It includes reading a hint before every turn; the format alone, "
        "forced without a hint: `python -m tg_jax.evaluation.prefill`.",
        "",
    ]


def _context_section(res: dict[str, Any]) -> list[str]:
    """Machine, pre-registration, base model and SFT attempts (what the numbers stand on)."""
    ctx = res.get("context") or {}
    lines = ["## Setting", ""]
    m = ctx.get("machine")
    if m:
        family = (
            f" (family {m['cpu_family']} model {m.get('cpu_model_number', 'n/a')})"
            if m.get("cpu_family") not in (None, "unknown")
            else ""
        )
        lines.append(
            f"* Machine: {m.get('cpu_model', 'n/a')}{family}, {m.get('cpu_count', 'n/a')} cores; "
            f"jax {m.get('jax', 'n/a')}, jaxlib {m.get('jaxlib', 'n/a')}; XLA_FLAGS "
            f"`{m.get('xla_flags') or '(unset)'}`."
        )
    pre = ctx.get("preregistration")
    if pre:
        lines.append(
            f"* Pre-registration: `{pre['path']}`, sha256 `{pre['sha256']}` (margin, floor, "
            "arms and their full configs, written before the first RL step)."
        )
    reg = ctx.get("registry")
    if reg:
        earlier = "; ".join(f"{e['id']} {e['verdict'] or 'no verdict'}" for e in reg["earlier"])
        lines.append(
            f"* Registered as `{reg['id']}` in `{reg['registry']}`; earlier attempts of "
            f"`{reg['hypothesis']}`: {earlier or 'none'}. The verdict's interval is two-sided "
            f"{num(100 * reg['level'], 2)}% (this attempt's share of the claim's error "
            "budget)."
        )
    if ctx.get("heldout_draw"):
        lines.append(f"* {ctx['heldout_draw']}")
    base = ctx.get("base_model")
    shipped = ctx.get("shipped_base")
    if shipped:
        machine = (shipped.get("machine") or {}).get("cpu_model", "n/a")
        lines.append(
            f"* Base model: shipped `{shipped.get('name')}`, weights sha256 "
            f"`{shipped.get('sha256')}`, made by `{shipped.get('command')}` at commit "
            f"{shipped.get('commit')} on {machine} (tg_jax/bases/{shipped.get('name')}/"
            "provenance.json)."
        )
    if base:
        figures = ", ".join(f"{k} {num(v)}" for k, v in base.items())
        where = "recorded when it was made" if shipped else "SFT, sft_eval.json"
        tasks = ctx.get("base_tasks") or {}  # older sft_eval.json files: held-out tasks
        where += (
            f", dev tasks of seed {tasks.get('seed')}"
            if tasks.get("split") == "dev"
            else ", held-out tasks"
        )
        lines.append(f"* Base model ({where}): {figures}.")
    remeasured = ctx.get("base_remeasured")
    if remeasured:
        beyond = [k for k, c in remeasured.items() if c["beyond"]]
        figures = ", ".join(
            f"{k} {num(c['measured'])} (recorded {num(c['recorded'])}, 95% interval of the "
            f"difference +-{num(c['interval'])})"
            for k, c in remeasured.items()
            if "greedy" not in k
        )
        verdict = (
            ("differences beyond the sampling interval: " + ", ".join(beyond))
            if beyond
            else "every difference within the sampling interval"
        )
        lines.append(
            f"* Base model (re-measured on this machine, sft_eval.json): {figures}; {verdict}."
        )
    if ctx.get("heldout_reads"):
        lines.append(f"* {heldout_reads.describe(ctx['heldout_reads'])}")
    for a in ctx.get("sft_attempts") or []:
        lines.append(
            f"* SFT attempt {a['attempt']} (seed {a['seed']}, data_seed {a['data_seed']}, "
            f"`{a['workdir']}`): {a['verdict']}."
        )
    return lines + [""] if len(lines) > 2 else []


def _train_section(res: dict[str, Any]) -> list[str]:
    k = res["settings"]["last_k"]
    lines = [
        f"## Training-time results (Table 1 style, last {k} steps)",
        "",
        f"Mean +- std over the last {k} training steps of the training rollouts "
        "(seeds pooled). **The +- is step-to-step spread, not a confidence interval.**",
        "",
    ]
    rows = []
    for arm in _arm_rows(res, "main"):
        t = res["arms"][arm]["train_last_k"]
        rows.append([arm] + [pm(t[m]) for m in stats.RATE_METRICS])
    return lines + table(["arm", "compliance", "task success", "joint"], rows) + [""]


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


def _heldout_section(res: dict[str, Any]) -> list[str]:
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
    return lines + table(header, _heldout_rows(res, _arm_rows(res, "main"), pct)) + [""]


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


def _requirements_section(res: dict[str, Any]) -> list[str]:
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


def _references_section(res: dict[str, Any]) -> list[str]:
    """The candidate's verdict against each pre-registered reference (`eval.references`)."""
    refs, st = res.get("references") or {}, res["settings"]
    if not st.get("references"):
        return []
    pct = round(100 * st["level"])
    lines = [
        f"## Non-inferiority of `{st['candidate']}` against each reference",
        "",
        f"Each reference pre-registered beside the baseline (`eval.references`); the headline "
        f"verdict above is the one against `{st['baseline']}`. Held-out task success, "
        f"interval over training seeds ({pct}%, two-sided), margin "
        f"{num(st['margin'], 3)}. `base` is the base model, evaluated once: its episodes stand "
        "for every training seed.",
        "",
    ]
    rows = []
    for ref, ni in refs.items():
        if ni.get("verdict") == "not run":
            rows.append([ref, "n/a", "n/a", "not run"])
        else:
            rows.append([ref, num(ni["mean"], 3), num(ni["lower"], 3), ni["verdict"]])
    return lines + table(["reference", "difference", "lower bound", "verdict"], rows) + [""]


def _differences_section(res: dict[str, Any]) -> list[str]:
    st = res["settings"]
    if not res["comparisons"]:
        return []
    lines = [
        f"## Differences vs `{st['baseline']}`",
        "",
        "Paired by training seed and held-out task; the interval's unit is the training seed "
        "(`stats.noninferiority_interval`: the wider of the t-interval over seeds and the "
        "seeds-plus-clusters interval). Its level is the verdict's: the registered share of "
        "this attempt. Per-seed differences of task success follow.",
        "",
    ]
    rows = []
    for arm, c in res["comparisons"].items():
        d, per_seed = c["difference"], c["per_seed"].get("task_success", {})
        rows.append(
            [arm, res["arms"][arm]["group"]]
            + [ci(d.get(m), 3) for m in stats.RATE_METRICS]
            + [", ".join(f"{s}: {num(v, 3)}" for s, v in per_seed.items()) or "-"]
            + [c["noninferiority"]["verdict"]]
        )
    header = [
        "arm",
        "group",
        "d compliance",
        "d task success",
        "d joint",
        "d task success per seed",
        f"non-inferior (margin {st['margin']})",
    ]
    return lines + table(header, rows) + [""]


def _diagnostic_section(res: dict[str, Any]) -> list[str]:
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


def _side_effects_section(res: dict[str, Any]) -> list[str]:
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


def _costs_section(res: dict[str, Any]) -> list[str]:
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
    ] + _thinking_control(res)
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


def _thinking_control(res: dict[str, Any]) -> list[str]:
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


def _stability_section(res: dict[str, Any]) -> list[str]:
    rows = []
    for arm, a in res["arms"].items():
        st = a.get("stability") or {}
        b = a["heldout"].get("plain", {}).get("bootstrap", {})
        rows.append(
            [
                arm,
                pm(st.get("oscillation"), 3),
                pm(st.get("malformed_train")),
                ci(b.get("actions/malformed")),
            ]
        )
    if not rows:
        return []
    steps = next(iter(res["arms"].values())).get("stability", {}).get("steps", "n/a")
    lines = [
        "## Stability",
        "",
        f"Oscillation: std of the training compliance over each run's last {steps} steps "
        "(0 = learned and kept; up to 0.5 = flipping), mean +- std over training seeds. "
        f"Malformed turns per episode: training (last {steps} steps, mean +- std over seeds) "
        f"and held-out ({round(100 * res['settings']['level'])}% cluster bootstrap CI).",
        "",
    ]
    header = ["arm", "oscillation", "malformed / episode (train)", "malformed / episode (held-out)"]
    return lines + table(header, rows) + [""]


def _leakage_section(res: dict[str, Any]) -> list[str]:
    rows = []
    for arm, a in res["arms"].items():
        st, h = a.get("stability") or {}, a["heldout"]
        boots = [h.get(c, {}).get("bootstrap", {}) for c in ("plain", "hinted")]
        cells = [ci(b.get("hint_leakage")) for b in boots]
        rows.append([arm, pm(st.get("hint_leakage_train"), 3)] + cells)
    if all(r[1:] == ["n/a"] * 3 for r in rows):
        return []
    lines = [
        "## Privilege-drift guard: hint leakage",
        "",
        "Share of assistant turns that reproduce a 6-word n-gram of a hint (lowercased words, "
        "punctuation dropped; references: every requirement's own hint and, in training, the "
        "hint the teacher was shown for that turn). The student never sees a hint in training "
        "or on plain prompts, so leakage there means it learned the teacher's privileged "
        "context; on hinted prompts the hint is in its context.",
        "",
    ]
    header = [
        "arm",
        "train (last steps, mean +- std over seeds)",
        "held-out plain",
        "held-out hinted",
    ]
    return lines + table(header, rows) + [""]


def _group_sections(res: dict[str, Any]) -> list[str]:
    st, lines = res["settings"], []
    sections = (("stress", "Stress tests (imperfect feedback)"), ("ablation", "Ablations"))
    for group, title in sections:
        arms = _arm_rows(res, group)
        if not arms:
            continue
        lines += [f"## {title}", ""]
        rows = []
        for arm in arms:
            a = res["arms"][arm]
            b = a["heldout"].get("plain", {}).get("bootstrap", {})
            c = res["comparisons"].get(arm)
            rows.append(
                [arm, a["description"] or "-", pm(a["train_last_k"]["compliance"])]
                + [ci(b.get(m)) for m in ("compliance", "task_success")]
                + [ci(c["difference"].get("task_success"), 3) if c else "n/a"]
                + [c["noninferiority"]["verdict"] if c else "n/a"]
            )
        header = [
            "arm",
            "what changes",
            "train compliance (last K, not a CI)",
            "held-out compliance",
            "held-out task success",
            f"d task success vs {st['baseline']}",
            "non-inferior",
        ]
        lines += table(header, rows) + [""]
    return lines


def _plots_section(res: dict[str, Any]) -> list[str]:
    lines = []
    if res.get("comparisons"):
        lines += [
            f"## Differences vs `{res['settings']['baseline']}` (plot)",
            "",
            f"![{FOREST_FILE}]({FOREST_FILE})",
            "",
        ]
    lines += ["## Training curves", ""]
    for group in curve_groups(res):
        plots = [curve_file(m, group) for m in CURVE_METRICS]
        if action_names(res):
            plots.append(curve_file(ACTIONS_FIGURE, group))
        if group != "main":
            lines += [f"{group.capitalize()} arms, with the reference arms dashed:", ""]
        lines += [f"![{p}]({p})" for p in plots] + [""]
    return lines


def render_markdown(res: dict[str, Any]) -> str:
    """report.md from `compute_results` output, section by section."""
    sections = (
        _verdict_section,
        _references_section,
        _context_section,
        _train_section,
        _heldout_section,
        _requirements_section,
        _differences_section,
        _diagnostic_section,
        _side_effects_section,
        _costs_section,
        _stability_section,
        _leakage_section,
        budget_section,
        _group_sections,
        _plots_section,
    )
    lines = ["# GRPO vs targeted guidance: report", ""]
    for section in sections:
        lines += section(res)
    return "\n".join(lines)
