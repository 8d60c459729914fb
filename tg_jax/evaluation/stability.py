"""Stability and privilege-drift guards of an arm, and the arms' shared tuning budget.

Stability is measured, not eyeballed from the curves (the paper's claim is that TG learns the
behaviour *stably*):

* oscillation = the std (ddof=0) of a run's training compliance (`rollout/compliance`)
  over its last `OSCILLATION_STEPS` (16) logged steps, one number per training seed; the
  arm's figure is the mean over seeds (with the t-interval over seeds). A run that learned
  the behaviour and kept it has ~0; one that flips between compliant and not has up to 0.5.
* malformed turns per episode, in training (`rollout/actions/malformed` over the same last
  steps, mean per seed) and held-out (the `actions/malformed` episode value).
* hint leakage (tg_jax.envs.leakage), in training (`rollout/hint_leakage`, same window)
  and held-out (the `hint_leakage` episode value): turns that reproduce the hint's words.

`tuning_budget(config)` states what every arm shares (the protocol's equal tuning budget).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tg_jax.evaluation import stats

OSCILLATION_STEPS = 16
TRAIN_STD_LABEL = "mean +- std over the last K training steps (step-to-step spread, not a CI)"
# Training metrics averaged per seed over the last OSCILLATION_STEPS steps.
TRAIN_WINDOW_METRICS = {
    "malformed_train": "rollout/actions/malformed",
    "hint_leakage_train": "rollout/hint_leakage",
}


# -- training-time numbers (Table 1 style): the last K steps of a run ----------------------


def last_k_values(
    records: Sequence[Mapping[str, Any]], key: str, k: int, *, stage: str = "train"
) -> tuple[list[int], np.ndarray]:
    """The last k logged steps of `key` and their values (after a resume the last record of
    each step wins)."""
    latest: dict[int, float] = {}
    for r in records:
        if r.get("stage", stage) == stage and key in r:
            latest[int(r["step"])] = float(r[key])
    steps = sorted(latest)[-k:] if k > 0 else []
    return steps, np.array([latest[s] for s in steps], np.float64)


def last_k_mean_std(
    runs: Sequence[Sequence[Mapping[str, Any]]] | Sequence[Mapping[str, Any]],
    key: str,
    k: int,
    *,
    stage: str = "train",
) -> dict[str, Any]:
    """Mean +- std (ddof=0) of `key` over the last k logged steps (Table 1 style; NOT a CI).

    Args:
      runs: metrics.jsonl records of one run (`tg_jax.metrics.read_metrics`), or a list of
        such lists (several training seeds: their last-k values are pooled).
      key: metric name.
      k: how many of the last steps of each run.
      stage: which stage's records.

    Returns:
      {"mean", "std", "n", "first_step", "last_step", "label"}; NaN mean/std if no step has key.
    """
    if runs and isinstance(runs[0], Mapping):
        runs = [runs]
    parts = [last_k_values(r, key, k, stage=stage) for r in runs]
    vals = np.concatenate([v for _, v in parts]) if parts else np.zeros(0)
    steps = [s for st, _ in parts for s in st]
    return {
        "mean": float(vals.mean()) if vals.size else float("nan"),
        "std": float(vals.std()) if vals.size else float("nan"),
        "n": int(vals.size),
        "first_step": min(steps) if steps else None,
        "last_step": max(steps) if steps else None,
        "label": TRAIN_STD_LABEL,
    }


def oscillation(
    records: Sequence[Mapping[str, Any]],
    key: str = "rollout/compliance",
    k: int = OSCILLATION_STEPS,
) -> float:
    """Std (ddof=0) of `key` over the last k logged train steps of one run; NaN under 2."""
    _, vals = last_k_values(records, key, k)
    return float(vals.std()) if vals.size >= 2 else float("nan")


def window_mean(records: Sequence[Mapping[str, Any]], key: str, k: int = OSCILLATION_STEPS):
    """Mean of `key` over the last k logged train steps of one run; None if never logged."""
    _, vals = last_k_values(records, key, k)
    return float(vals.mean()) if vals.size else None


def arm_stability(
    train_runs: Sequence[Sequence[Mapping[str, Any]]], *, level: float = 0.95
) -> dict[str, Any]:
    """Stability of one arm over its seeds' metrics.jsonl records.

    Returns:
      {"steps": OSCILLATION_STEPS, "oscillation": seed_interval dict (or None without two
      logged steps), "per_seed_oscillation": [...], and per `TRAIN_WINDOW_METRICS` name a
      seed_interval dict of the per-seed window means (None where never logged)}.
    """
    per_seed = [oscillation(r) for r in train_runs]
    finite = [v for v in per_seed if np.isfinite(v)]
    out: dict[str, Any] = {
        "steps": OSCILLATION_STEPS,
        "per_seed_oscillation": per_seed,
        "oscillation": stats.seed_interval(finite, level=level) if finite else None,
    }
    for name, key in TRAIN_WINDOW_METRICS.items():
        means = [m for m in (window_mean(r, key) for r in train_runs) if m is not None]
        out[name] = stats.seed_interval(means, level=level) if means else None
    return out


def _tune(config: Any) -> Any:
    pipeline = config.get("pipeline") if hasattr(config, "get") else None
    tune = pipeline.get("tune") if pipeline is not None else None
    return tune if tune is not None else {}


def tuning_budget(config: Any) -> dict[str, Any]:
    """What every arm of `config` shares: RL steps, groups, rollouts, token budgets, the
    optimizer, training seeds and held-out tasks (JSON-ready; the report states it)."""
    lc, ev = config.rl_loop, config.eval
    max_turns = int(config.env.max_turns)
    per_episode = int(lc.max_new_tokens) * max_turns if max_turns > 0 else None
    episodes = int(lc.steps) * int(lc.groups_per_step) * int(lc.rollouts_per_group)
    return {
        "steps": int(lc.steps),
        "groups_per_step": int(lc.groups_per_step),
        "rollouts_per_group": int(lc.rollouts_per_group),
        "episodes": episodes,
        "max_new_tokens_per_turn": int(lc.max_new_tokens),
        "max_turns": max_turns,
        # Upper bound on the tokens an arm may sample (None: turns left to the environment).
        "sampled_token_budget": None if per_episode is None else episodes * per_episode,
        "lr": float(config.optim.lr),
        "lr_schedule": str(config.optim.schedule),
        "train_seeds": [int(s) for s in ev.train_seeds],
        "heldout_tasks": int(ev.num_tasks),
        # Learning-rate trials per arm on a validation split of the train tasks
        # (tg_jax.train.tuning; 1 = none, the config's rate). What read the held-out tasks
        # is the ledger's to say (tg_jax.evaluation.heldout_reads), not a field here.
        "lr_trials": max(1, len(tuple(_tune(config).get("lrs", ())))),
    }
