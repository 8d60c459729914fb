"""Gates on the SFT base model, checked after SFT and before any RL (`sft.require`).

The RL comparison only means something on a base model in a known regime: it solves some but
not all held-out tasks at the RL temperature (room to lose and to gain), never meets the
requirement unprompted (there is something to teach) and follows its hint (the TG teacher
works); with `sft.require.max_format_cost` < 1, it also solves about as many tasks once made
to write the format (sft_eval's format_cost), so that TG's task success is not measured against
a handicap GRPO never meets. `check_base_model` reads those figures from sft_eval.json and
returns the failures.
"""

from __future__ import annotations

from typing import Any

from tg_jax.envs import make_env, requirement_names
from tg_jax.train.sft_settings import RequireConfig, SftEvalConfig

# What to change when a gate fails (shown in the error).
KNOBS = (
    "sft.steps (longer / shorter SFT)",
    "seed and sft.data_seed (another init and data order; or sft.retry_seeds=N to retry)",
    "sft.optim.lr",
    "sft.transcripts.p_correct / p_hinted (the expert data)",
    "sft.transcripts.p_forced (a format_cost: transcripts written in the format unhinted)",
    "sft.require.* (the gates themselves, if the regime you want is another)",
)


class BaseModelGateError(RuntimeError):
    """The SFT base model is outside the gates of `sft.require`; nothing downstream ran."""


# The per-requirement figures the gates read from sft_eval.json ("<kind>/<requirement>").
REQUIREMENT_KINDS = ("unprompted_compliance", "hinted_compliance")
FORMAT_COST = "format_cost"


def _format_cost_bound(req: Any) -> float | None:
    """`sft.require.max_format_cost`, or None when that gate is off (>= 1)."""
    bound = float(req.get("max_format_cost", 1.0))
    return bound if bound < 1.0 else None


def _gated_kinds(config: Any) -> dict[str, tuple[str, ...]]:
    """The gated kinds of each gated requirement (in the environment's order; the environment
    is built once): the format cost too when its gate is on and the requirement has an opening.

    Gated: the requirements of env.requirements that the base model was made to be taught,
    those its SFT transcripts hint (`sft.hint_requirements`; every one when that is empty). A
    requirement RL judges that the transcripts always meet (configs/swe.py: the tool protocol)
    is met unprompted by design, and nothing there is TG's to teach."""
    gate_on = _format_cost_bound(config.sft.require) is not None
    hinted = set(config.sft.get("hint_requirements", ()) or ())
    return {
        r.name: (*REQUIREMENT_KINDS, FORMAT_COST)
        if gate_on and r.opening is not None
        else REQUIREMENT_KINDS
        for r in make_env(config.env).requirements
        if not hinted or r.name in hinted
    }


def gate_figures(config: Any, result: dict[str, Any]) -> dict[str, float | None]:
    """The gated figures of an sft_eval.json result (None = not measured)."""
    out: dict[str, float | None] = {"pass_rate": result.get("pass_rate")}
    for r, kinds in _gated_kinds(config).items():
        for kind in kinds:
            out[f"{kind}/{r}"] = result.get(f"{kind}/{r}")
    return out


def unmeasured_requirements(config: Any, result: dict[str, Any]) -> list[str]:
    """The requirements of `config.env.requirements` whose gated figures an sft_eval.json
    result lacks (a base model evaluated for other requirements, e.g. the demo's base copied
    into a fence workdir)."""
    return [
        r
        for r, kinds in _gated_kinds(config).items()
        if any(result.get(f"{kind}/{r}") is None for kind in kinds)
    ]


def check_require_config(config: Any) -> None:
    """Raises ValueError for `sft.require` bounds no base model can meet or that are not
    numbers, and for a bad `sft.eval` (checked before data and SFT, so a typo does not cost an
    SFT run; the checks: `sft_settings.RequireConfig`, `SftEvalConfig`)."""
    RequireConfig.from_config(config.sft.require)
    if "eval" in config.sft:
        SftEvalConfig.from_config(config.sft.eval)


def check_base_model(config: Any, result: dict[str, Any]) -> list[str]:
    """The gate failures of a base model (empty = every gate passes or gates are off)."""
    req = config.sft.require
    if not req.enabled:
        return []
    low, high = (float(v) for v in req.pass_rate)
    failures = []
    for key, value in gate_figures(config, result).items():
        if value is None:
            failures.append(f"{key} not in sft_eval.json")
        elif key == "pass_rate" and not low <= value <= high:
            failures.append(f"pass_rate {value:.3f} outside [{low}, {high}]")
        elif key.startswith("unprompted") and value > float(req.max_unprompted_compliance):
            failures.append(f"{key} {value:.3f} > {req.max_unprompted_compliance}")
        elif key.startswith("hinted") and value < float(req.min_hinted_compliance):
            failures.append(f"{key} {value:.3f} < {req.min_hinted_compliance}")
        elif key.startswith(FORMAT_COST) and value > float(req.max_format_cost):
            failures.append(f"{key} {value:.3f} > {req.max_format_cost}")
    return failures


def gate_error(config: Any, attempts: list[dict[str, Any]]) -> BaseModelGateError:
    """The error for base models that all failed their gates (one entry per SFT attempt)."""
    req = config.sft.require
    lines = ["the SFT base model is outside the gates of sft.require; no RL was run."]
    for a in attempts:
        figures = ", ".join(
            f"{k} {'n/a' if v is None else f'{v:.3f}'}" for k, v in a["figures"].items()
        )
        lines.append(
            f"  attempt {a['attempt']} (seed {a['seed']}, sft.data_seed {a['data_seed']}, "
            f"{a['workdir']}): {figures}"
        )
        lines += [f"    FAIL {f}" for f in a["failures"]]
    gates = [
        f"pass_rate in {list(req.pass_rate)}",
        f"unprompted compliance <= {req.max_unprompted_compliance}",
        f"hinted compliance >= {req.min_hinted_compliance}",
    ]
    if (bound := _format_cost_bound(req)) is not None:
        gates.append(f"format cost <= {bound}")
    lines.append(
        f"gates: {', '.join(gates)} (per requirement of env.requirements "
        f"{list(requirement_names(config.env))} the SFT transcripts hint: "
        f"{list(_gated_kinds(config))})"
    )
    lines.append("knobs to turn: " + "; ".join(KNOBS))
    return BaseModelGateError("\n".join(lines))
