"""report.md's "Setting" section: what the numbers stand on (the machine, the
pre-registration and registry entry, the base model, recorded and re-measured, the held-out
reads and the SFT attempts), from `compute_results`' `context`."""

from __future__ import annotations

from typing import Any

from tg_jax.evaluation import heldout_reads
from tg_jax.evaluation.md_cells import num


def context_section(res: dict[str, Any]) -> list[str]:
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
