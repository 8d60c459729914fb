"""Base-model evaluation on held-out tasks: pass rate, unprompted and hinted compliance.

The episodes are played by `tg_jax.sampling.rollout.evaluate`, the same code that evaluates
the RL runs, so the base model's figures and the RL arms' are comparable. Modes: temperature
1 (`sft.eval.temperatures`, whatever `rl.temperature`) and greedy, each under the two
conditions of docs/design.md section 4: "plain" (prompts as in training: does it by
default?) and "hinted" (a hint for every requirement right before every assistant turn: can it
when reminded?).

With `forced=True` (the evaluation written to sft_eval.json, not the dev evaluations of SFT
selection), each requirement decided at a turn's first answer token (`Requirement.opening`:
the fence) gets one more temperature-1 mode, "t1.0/forced_<r>": plain prompts, the first
turn's answer opened with the requirement's opening right after the turn's thinking block
(`tg_jax.evaluation.prefill.PrefillSampler`, after_thinking), the rest the model's: where a TG
policy that has learnt to open the format stands, with no hint in context.
`format_cost/<r>` = pass_rate - forced_pass_rate/<r> is what writing the format costs the base
model before any RL: task skill a TG arm would have to win back and GRPO, which never writes
the format, would not.

Figures per mode (`summarize`):
  pass_rate: share of episodes whose hidden tests all pass.
  compliance/<r>: share of JUDGED TURNS that meet requirement r (all episodes pooled).
  episode_compliance/<r>: share of episodes with >= 1 judged turn where every judged turn
    meets r (the evaluation's episode-level definition).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from tg_jax.envs import Environment, env_factory, requirement_names
from tg_jax.models import ModelConfig, Transformer
from tg_jax.sampling import rollout
from tg_jax.sampling.episode import EpisodeRecord
from tg_jax.sampling.sampler import Sampler
from tg_jax.sampling.trajectory import Trajectory
from tg_jax.text import ChatRenderer

EVAL_FILE = "sft_eval.json"


def summarize(
    records: Sequence[EpisodeRecord],
    trajectories: Sequence[Trajectory],
    requirements: Sequence[str],
) -> dict[str, float]:
    """Pass rate, turn-level and episode-level compliance, and action counts of one mode."""
    out: dict[str, float] = {
        "pass_rate": float(np.mean([r.task_success for r in records])),
        "turns": float(np.mean([r.turns for r in records])),
        "malformed_per_episode": float(np.mean([r.actions.get("malformed", 0) for r in records])),
        "submitted": float(np.mean([r.actions.get("submit", 0) > 0 for r in records])),
        "num_episodes": len(records),
    }
    for name in requirements:
        turns = [v[name] for t in trajectories for v in t.turn_verdicts if v.get(name) is not None]
        judged = [
            r.compliance[name]
            for r, t in zip(records, trajectories, strict=True)
            if any(v.get(name) is not None for v in t.turn_verdicts)
        ]
        out[f"compliance/{name}"] = float(np.mean(turns)) if turns else 0.0
        out[f"episode_compliance/{name}"] = float(np.mean(judged)) if judged else 0.0
    return out


def evaluate_base_model(
    model: Transformer,
    params: Any,
    renderer: ChatRenderer,
    tasks: Sequence[Any],
    env_factory: Callable[[], Environment],
    eval_config: Any,
    max_len: int,
    *,
    forced: bool = False,
) -> dict[str, Any]:
    """Every mode of `eval_config.temperatures` x {plain, hinted} on `tasks`, one episode each,
    and with `forced` (and temperature 1 among them) a forced mode per requirement with an
    opening (module docstring).

    Returns:
      {"modes": {"t1.0/plain": summary, ...}} plus headline figures: "pass_rate",
      "unprompted_compliance/<r>" (temperature 1, plain) and "hinted_compliance/<r>"
      (temperature 1, hinted), with "_greedy" counterparts when 0.0 is a temperature;
      forced: "forced_pass_rate/<r>" and "format_cost/<r>".
    """
    from tg_jax.evaluation.prefill import PrefillSampler  # noqa: PLC0415

    sampler = Sampler(model, pad_id=renderer.tokenizer.pad_id)
    rng = jax.random.key(int(eval_config.seed))
    requirements = env_factory().requirements  # plug-ins under their own names
    names = [r.name for r in requirements]
    modes: dict[str, dict[str, float]] = {}
    for ti, temp in enumerate(eval_config.temperatures):
        cfg = rollout.RolloutConfig(
            max_new_tokens=int(eval_config.max_new_tokens),
            max_total_tokens=max_len,
            temperature=float(temp),
        )
        for ci, condition in enumerate(("plain", "hinted")):
            records, trajectories = rollout.evaluate(
                sampler,
                params,
                renderer,
                env_factory,
                tasks,
                config=cfg,
                rng=jax.random.fold_in(rng, 2 * ti + ci),
                condition=condition,
            )
            modes[f"t{float(temp)}/{condition}"] = summarize(records, trajectories, names)
            if not (forced and condition == "plain" and float(temp) == 1.0):
                continue
            for req in requirements:
                if req.opening is None:
                    continue
                # The plain mode's sampling key: the two differ by the opening only.
                records, trajectories = rollout.evaluate(
                    PrefillSampler(sampler, renderer, req.opening, after_thinking=True),
                    params,
                    renderer,
                    env_factory,
                    tasks,
                    config=cfg,
                    rng=jax.random.fold_in(rng, 2 * ti + ci),
                    condition=condition,
                )
                modes[f"t1.0/forced_{req.name}"] = summarize(records, trajectories, names)
    out: dict[str, Any] = {"modes": modes, "num_tasks": len(tasks)}
    for temp, suffix in ((1.0, ""), (0.0, "_greedy")):
        plain, hinted = modes.get(f"t{temp}/plain"), modes.get(f"t{temp}/hinted")
        if plain is None:
            continue
        out[f"pass_rate{suffix}"] = plain["pass_rate"]
        out[f"hinted_pass_rate{suffix}"] = hinted["pass_rate"]
        for r in names:
            out[f"unprompted_compliance/{r}{suffix}"] = plain[f"compliance/{r}"]
            out[f"hinted_compliance/{r}{suffix}"] = hinted[f"compliance/{r}"]
    for r in names:
        if f"t1.0/forced_{r}" in modes:
            forced_pass = modes[f"t1.0/forced_{r}"]["pass_rate"]
            out[f"forced_pass_rate/{r}"] = forced_pass
            out[f"format_cost/{r}"] = modes["t1.0/plain"]["pass_rate"] - forced_pass
    return out


def base_eval_tasks(config: Any) -> list[Any]:
    """The base model's evaluation tasks (sft_eval.json, the gates): `sft.eval.num_tasks` dev
    tasks (`task_data.dev_tasks`, seed `sft.eval.task_seed`). The gates are checked before any
    run, so they never read the held-out split, which only the final evaluation reads
    (`tg_jax.evaluation.heldout_reads`)."""
    from tg_jax.data import task_data  # noqa: PLC0415

    return task_data.dev_tasks(config, int(config.sft.eval.num_tasks), seed=_task_seed(config))


def _task_seed(config: Any) -> int:
    return int(config.sft.eval.get("task_seed", 8))


def measure(
    config: Any, model_cfg: ModelConfig, params: Any, renderer: ChatRenderer
) -> dict[str, Any]:
    """The figures of sft_eval.json for a base model: `evaluate_base_model` on its dev tasks
    (`base_eval_tasks`) with `config.sft.eval` (forced modes included), and what was measured:
    the tasks, the evaluation time, the requirements and the parameter count."""
    tasks = base_eval_tasks(config)
    t0 = time.time()
    result = evaluate_base_model(
        Transformer(model_cfg),
        params,
        renderer,
        tasks,
        env_factory(config.env, renderer.tool_format),
        config.sft.eval,
        max_len=model_cfg.max_seq_len,
        forced=True,
    )
    result["eval_s"] = time.time() - t0
    result["tasks"] = {"split": "dev", "seed": _task_seed(config)}
    result["requirements"] = list(requirement_names(config.env))
    result["num_params"] = model_cfg.num_params()
    return result
