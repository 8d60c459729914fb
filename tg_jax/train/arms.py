"""The RL arms of the main job (`pipeline.arms`): each differs from the shared config only by
its overrides here (docs/design.md section 4); `tg_jax.train.pipeline` runs them."""

from __future__ import annotations

import dataclasses
from typing import Any

from tg_jax import config_files


@dataclasses.dataclass(frozen=True)
class Arm:
    """One RL arm: config overrides on top of the shared config, a report group, a line."""

    overrides: dict[str, Any]
    group: str  # "main" | "ablation" | "stress" (tg_jax.evaluation.report.GROUPS)
    description: str


# Every requirement-reward weight (every rl.reward_weights key but "task"), in an override.
EVERY_REQUIREMENT_WEIGHT = "rl.reward_weights.*"


@dataclasses.dataclass(frozen=True)
class Scale:
    """An override value relative to the config's own: that value times `factor` (so an
    ablation of lambda_tg stays x4 / 4 of whatever lambda the config sets)."""

    factor: float


# Every arm differs from the shared config only by these overrides (docs/design.md section 4:
# same data, sampling budget and tuning budget for all of them).
ARMS: dict[str, Arm] = {
    "grpo": Arm({"tg.enabled": False}, "main", "GRPO with task and requirement rewards, no hints"),
    "grpo_task_only": Arm(
        {"tg.enabled": False, EVERY_REQUIREMENT_WEIGHT: 0.0},
        "ablation",
        "GRPO with the task reward only (requirement reward weights 0), no hints",
    ),
    "tg": Arm(
        {"tg.enabled": True},
        "main",
        "GRPO + targeted guidance (hinted teacher, failed turns, answer tokens)",
    ),
    "tg_think": Arm(
        {"tg.enabled": True, "tg.include_thinking": True},
        "main",
        "TG that also distils the <think> tokens of failed turns (compare with tg at their "
        "distilled-token costs)",
    ),
    "tg_think_budget": Arm(
        {"tg.enabled": True, "tg.include_thinking": True, "tg.distill_budget": "answer_tokens"},
        "main",
        "TG that distils <think> and answer tokens of failed turns, per step at most as many as "
        "their answer tokens (tg's distilled-token budget; tg_jax.rl.tg.distill_budget)",
    ),
    "tg_think_hidden": Arm(
        {
            "tg.enabled": True,
            "tg.include_thinking": True,
            "tg.distill_budget": "answer_tokens",
            "rl_loop.hide_thinking": True,
        },
        "ablation",
        "tg_think_budget with hidden planning text: no turn sees an earlier turn's <think> "
        "block, in training and evaluation (tg_jax.rl.hidden_thinking)",
    ),
    "tg_think_short": Arm(
        {
            "tg.enabled": True,
            "tg.include_thinking": True,
            "tg.distill_budget": "answer_tokens",
            "rl_loop.think_budget": 2,
        },
        "ablation",
        "tg_think_budget with a reasoning-length budget of 2 tokens per <think> block (its tag "
        "and one token; the rollout closes it), in training and evaluation",
    ),
    "tg_all_turns": Arm(
        {"tg.enabled": True, "tg.gate": "all_turns"},
        "ablation",
        "TG on every turn, failed or not (gate ablation)",
    ),
    "tg_no_req_reward": Arm(
        {"tg.enabled": True, EVERY_REQUIREMENT_WEIGHT: 0.0},
        "ablation",
        "TG with the requirement rewards removed (task reward only; pairs with grpo_task_only)",
    ),
    "tg_lambda_high": Arm(
        {"tg.enabled": True, "tg.lambda_tg": Scale(4.0)}, "ablation", "TG with lambda_tg x4"
    ),
    "tg_lambda_low": Arm(
        {"tg.enabled": True, "tg.lambda_tg": Scale(0.25)}, "ablation", "TG with lambda_tg / 4"
    ),
    # Peers' methods on the same teacher path (tg.method, tg_jax.rl.peers): same steps,
    # rollouts and sampled tokens as tg; only the loss differs.
    "sdpo": Arm(
        {"tg.enabled": True, "tg.method": "sdpo", "tg.gate": "all_turns"},
        "ablation",
        "Peer SDPO: (1 - w) GRPO + w self-distillation, hinted teacher on every turn "
        "(tg.peer_weight, tg.peer_estimator)",
    ),
    "opsd": Arm(
        {"tg.enabled": True, "tg.method": "opsd", "tg.gate": "all_turns"},
        "ablation",
        "Peer OPSD (pi-Distill): GRPO + lambda KL to the privileged-context teacher on every "
        "turn (= TG with the all-turns gate)",
    ),
    "sdar": Arm(
        {"tg.enabled": True, "tg.method": "sdar", "tg.gate": "all_turns"},
        "ablation",
        "Peer SDAR: GRPO + lambda KL gated per token by sigmoid(beta (teacher-student gap - tau))",
    ),
    "sgcd": Arm(
        {"tg.enabled": True, "tg.method": "sgcd", "tg.gate": "all_turns"},
        "ablation",
        "Peer SGCD: no KL; advantages reweighted per token by tanh(teacher-student gap), "
        "clipped to 1 +- c",
    ),
    "tg_stress": Arm(
        {
            "tg.enabled": True,
            "rl_loop.feedback.correct": 0.5,
            "rl_loop.feedback.irrelevant": 0.25,
            "rl_loop.feedback.wrong": 0.25,
        },
        "stress",
        "TG with imperfect feedback: 50% correct, 25% irrelevant, 25% wrong hints",
    ),
    "tg_wrong_judge": Arm(
        {
            "tg.enabled": True,
            "rl_loop.feedback.false_positive": 0.2,
            "rl_loop.feedback.false_negative": 0.2,
        },
        "stress",
        "TG with a judge that errs: 20% of failed turns judged met, 20% of met turns judged "
        "failed (training only; held-out judged truly)",
    ),
}


# Other names of arms: `pipeline.arms` may use them (runs, report and preregistration are
# then under the name given).
ARM_ALIASES: dict[str, str] = {"tg_task_only": "tg_no_req_reward"}


def get_arm(name: str) -> Arm:
    """The arm `name` (or an alias of it, `ARM_ALIASES`)."""
    arm = ARMS.get(ARM_ALIASES.get(name, name))
    if arm is None:
        raise ValueError(f"unknown arm {name!r}; known: {sorted(ARMS)} (aliases {ARM_ALIASES})")
    return arm


def arm_overrides(config: Any, arm: str) -> dict[str, Any]:
    """The concrete overrides of `arm` on `config`: `EVERY_REQUIREMENT_WEIGHT` becomes one
    key per requirement weight of the config, a `Scale` the config's value times its factor,
    and a requirement-reward override for a requirement the config does not reward is left
    out."""
    weights = [k for k in config.rl.reward_weights if k != "task"]
    out = {}
    for k, v in get_arm(arm).overrides.items():
        if isinstance(v, Scale):
            node = config
            for part in k.split("."):
                node = node[part]
            out[k] = float(node) * v.factor
        elif k == EVERY_REQUIREMENT_WEIGHT:
            out.update({f"rl.reward_weights.{w}": v for w in weights})
        elif not k.startswith("rl.reward_weights.") or k.rsplit(".", 1)[1] in weights + ["task"]:
            out[k] = v
    return out


def arm_config(config: Any, arm: str) -> Any:
    """`config` with the overrides of `arm` (`arm_overrides`; a new config, the original is
    untouched). Any unknown key raises."""
    return config_files.apply_overrides(config, arm_overrides(config, arm))
