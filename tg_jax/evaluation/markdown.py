"""report.md from `tg_jax.evaluation.report.compute_results` output, one helper per section.

`render_markdown` puts the sections in order. Here: the non-inferiority verdict and what it
is compared against (the references, the differences vs the baseline, the stress and
ablation rows), the training-time table, stability, the hint-leakage guard and the plots.
Elsewhere: the setting (`md_setting`), the held-out tables (`md_heldout`), the costs
(`md_costs`), the tuning budget (`md_budget`); cells and tables: `md_cells`.
"""

from __future__ import annotations

from typing import Any

from tg_jax.evaluation import stats
from tg_jax.evaluation.md_budget import budget_section
from tg_jax.evaluation.md_cells import arm_rows, ci, num, pm, table
from tg_jax.evaluation.md_costs import costs_section
from tg_jax.evaluation.md_heldout import (
    diagnostic_section,
    heldout_section,
    requirements_section,
    side_effects_section,
)
from tg_jax.evaluation.md_setting import context_section
from tg_jax.evaluation.plots import (
    ACTIONS_FIGURE,
    CURVE_METRICS,
    FOREST_FILE,
    action_names,
    curve_file,
    curve_groups,
)
from tg_jax.evaluation.step_phases import phases_section


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


def _group_sections(res: dict[str, Any]) -> list[str]:
    st, lines = res["settings"], []
    sections = (("stress", "Stress tests (imperfect feedback)"), ("ablation", "Ablations"))
    for group, title in sections:
        arms = arm_rows(res, group)
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
    for arm in arm_rows(res, "main"):
        t = res["arms"][arm]["train_last_k"]
        rows.append([arm] + [pm(t[m]) for m in stats.RATE_METRICS])
    return lines + table(["arm", "compliance", "task success", "joint"], rows) + [""]


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
        context_section,
        _train_section,
        heldout_section,
        requirements_section,
        _differences_section,
        diagnostic_section,
        side_effects_section,
        costs_section,
        phases_section,
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
