"""Model selection during SFT on the dev split of the tasks (functions used nowhere else).

The SFT trajectory of a tiny byte model is chaotic: the same recipe lands at very different
pass rates for different seeds, and a float-rounding-level change (another CPU's reduction
order) moves it as much as a seed does. The final step is therefore a poor choice of base
model. Instead, every `sft.select.every` steps from `sft.select.start` on, the model plays
`sft.select.num_tasks` dev tasks (the "dev" split of `tg_jax.envs.tasks`: functions that
neither SFT, RL nor the held-out evaluation use, so the dev pass rate estimates the held-out
one without touching it) at temperature 1, plain and hinted, and the best checkpoint so far is
kept in `workdir/sft/best/`:

  eligible: unprompted compliance <= `unprompted_max` and hinted compliance >= `hinted_min`
    for every requirement, and pass rate <= `pass_rate_max`;
  best: the eligible evaluation with the highest pass rate (ties: the later step); when none
    is eligible, a compliant one before others, then the highest pass rate (the base-model
    gates after SFT then decide whether it is good enough).

`workdir/sft/selection.json` records every dev evaluation and the chosen step, so a resumed
SFT continues the selection where it stopped and the report can show the trajectory.

Extension (`sft.extend`): at step `sft.steps`, after its evaluation, a run whose best eligible
dev pass rate is under `extend.min_pass_rate` (or that has no eligible evaluation) trains
`extend.steps` more steps (`decide_extension`; the decision is recorded in selection.json);
its last step is then `final_step`, evaluated like the others.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import ml_collections

from tg_jax import checkpointing, paths
from tg_jax.envs import requirement_names
from tg_jax.envs.coding import CodingEnv, coding_env_config
from tg_jax.envs.tasks import generate_tasks
from tg_jax.text import ChatRenderer
from tg_jax.train import sft_eval
from tg_jax.train.sft_settings import ExtendConfig, SelectConfig

SELECTION_FILE = "selection.json"
BEST_DIR = "best"


def extend_config(config: Any) -> ExtendConfig:
    """`config.sft.extend`, checked: an extension needs dev selection to decide on."""
    ext = ExtendConfig.from_config(config.sft.extend)
    if ext.steps and not config.sft.select.enabled:
        raise ValueError(
            f"sft.extend.steps={ext.steps} needs sft.select.enabled (the extension is decided "
            "on the dev evaluation at sft.steps); set sft.extend.steps=0 or enable selection"
        )
    return ext


def decide_extension(entries: list[dict[str, Any]], base_steps: int, ext: ExtendConfig) -> dict:
    """The extension decision at step `base_steps` from the dev evaluations up to it; none
    (select.start > sft.steps, e.g. a short run forced for a test) -> not extended."""
    evaluated = [e for e in entries if e["step"] <= base_steps]
    eligible = [e for e in evaluated if e["eligible"]]
    best = max((e["figures"]["pass_rate"] for e in eligible), default=None)
    extended = bool(evaluated) and (best is None or best < ext.min_pass_rate)
    return {
        "at_step": base_steps,
        "best_eligible_pass_rate": best,
        "evaluations": len(evaluated),
        "min_pass_rate": ext.min_pass_rate,
        "extended": extended,
        "steps": ext.steps if extended else 0,
    }


def final_step(config: Any, sft_dir: str) -> int | None:
    """The last SFT step of this run: sft.steps, plus the extension when it was decided; None
    while an extension is possible but not yet decided."""
    base = int(config.sft.steps)
    if not extend_config(config).steps:
        return base
    path = paths.as_path(sft_dir) / SELECTION_FILE
    decision = read_selection(sft_dir).get("extension") if path.exists() else None
    return None if decision is None else base + int(decision["steps"])


def dev_figures(result: dict[str, Any], requirements: tuple[str, ...]) -> dict[str, float]:
    """The three figures selection reads, from an `sft_eval.evaluate_base_model` result."""
    plain, hinted = result["modes"]["t1.0/plain"], result["modes"]["t1.0/hinted"]
    out = {"pass_rate": plain["pass_rate"], "hinted_pass_rate": hinted["pass_rate"]}
    out["unprompted_max"] = max(plain[f"compliance/{r}"] for r in requirements)
    out["hinted_min"] = min(hinted[f"compliance/{r}"] for r in requirements)
    return out


def compliant(figures: dict[str, float], cfg: SelectConfig) -> bool:
    return (
        figures["unprompted_max"] <= cfg.unprompted_max and figures["hinted_min"] >= cfg.hinted_min
    )


def _score(entry: dict[str, Any]) -> tuple:
    # Eligible first, then compliant, then the pass rate, then the later step.
    return (entry["eligible"], entry["compliant"], entry["figures"]["pass_rate"], entry["step"])


def choose(entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The best dev evaluation (see the module docstring); None when there is none."""
    return max(entries, key=_score) if entries else None


def describe(entry: dict[str, Any]) -> str:
    """One line for the terminal: a dev evaluation's figures."""
    f = entry["figures"]
    tag = "eligible" if entry["eligible"] else ("compliant" if entry["compliant"] else "-")
    return (
        f"sft dev step {entry['step']}: pass {f['pass_rate']:.2f} (hinted "
        f"{f['hinted_pass_rate']:.2f}), unprompted compliance <= {f['unprompted_max']:.2f}, "
        f"hinted >= {f['hinted_min']:.2f} [{tag}]"
    )


def describe_extension(decision: dict[str, Any]) -> str:
    """One line for the terminal: the extension decision at sft.steps."""
    best = decision["best_eligible_pass_rate"]
    if not decision["evaluations"]:
        return f"sft: no dev evaluation up to step {decision['at_step']}: not extended"
    got = "no eligible evaluation" if best is None else f"best eligible dev pass {best:.2f}"
    if not decision["extended"]:
        return f"sft: {got} >= {decision['min_pass_rate']:.2f} at step {decision['at_step']}"
    return (
        f"sft: {got} < {decision['min_pass_rate']:.2f} at step {decision['at_step']}: "
        f"extending by {decision['steps']} steps (sft.extend)"
    )


class DevSelector:
    """Evaluates SFT checkpoints on dev tasks and keeps the best in `workdir/sft/best`."""

    def __init__(self, config: Any, sft_dir: str, model, renderer: ChatRenderer):
        self.cfg = SelectConfig.from_config(config.sft.select)
        self.ext = extend_config(config)
        self.num_steps = int(config.sft.steps)
        self.config = config
        self.model = model
        self.renderer = renderer
        self.path = os.path.join(sft_dir, SELECTION_FILE)
        self.best_dir = os.path.join(sft_dir, BEST_DIR)
        exists = paths.as_path(self.path).exists()
        record = read_selection(sft_dir) if exists else {}
        self.entries = record.get("evaluations", [])
        self.extension = record.get("extension")  # the decision at sft.steps, once made
        self._tasks = None

    @property
    def final_step(self) -> int:
        """The run's last step as known now (sft.steps until an extension is decided)."""
        return self.num_steps + (int(self.extension["steps"]) if self.extension else 0)

    def maybe_decide_extension(self, step: int) -> dict[str, Any] | None:
        """At step sft.steps (once): decides and records the extension; the decision when
        it was made by this call, else None."""
        if not self.ext.steps or step != self.num_steps or self.extension is not None:
            return None
        self.extension = decide_extension(self.entries, self.num_steps, self.ext)
        self._write()
        return self.extension

    def tasks(self):
        if self._tasks is None:
            self._tasks = generate_tasks(
                "dev",
                self.cfg.num_tasks,
                seed=self.cfg.seed,
                families=self.config.tasks.families,
            )
        return self._tasks

    def maybe_evaluate(self, step: int, state) -> dict[str, Any] | None:
        """Evaluates `state` if `step` is due (and not done already); returns the entry."""
        due = self.cfg.due(step, self.num_steps) or self.cfg.due(step, self.final_step)
        if not due or any(e["step"] == step for e in self.entries):
            return None
        env_cfg = coding_env_config(self.config.env)
        eval_cfg = {
            "seed": self.cfg.seed,
            "temperatures": (1.0,),
            "max_new_tokens": self.cfg.max_new_tokens,
        }
        result = sft_eval.evaluate_base_model(
            self.model,
            state.params,
            self.renderer,
            self.tasks(),
            lambda: CodingEnv(env_cfg),
            ml_collections.ConfigDict(eval_cfg),
            max_len=self.model.config.max_seq_len,
        )
        figures = dev_figures(result, requirement_names(self.config.env))
        ok = compliant(figures, self.cfg)
        entry = {
            "step": step,
            "figures": figures,
            "compliant": ok,
            "eligible": ok and figures["pass_rate"] <= self.cfg.pass_rate_max,
        }
        self.entries.append(entry)
        if choose(self.entries) is entry:  # a new best: keep its checkpoint
            with checkpointing.TrainingCheckpointer(self.best_dir, max_to_keep=1) as ckpt:
                ckpt.save(step, state, metadata={"stage": "sft_best", "step": step}, force=True)
        self._write()
        return entry

    def _write(self) -> None:
        best = choose(self.entries)
        out = {
            "config": dataclasses.asdict(self.cfg),
            "evaluations": self.entries,
            "best_step": None if best is None else best["step"],
            "best_eligible": None if best is None else best["eligible"],
        }
        if self.extension is not None:
            out["extension"] = self.extension
        paths.write_json_atomic(self.path, out, indent=2)


def read_selection(sft_dir: str) -> dict[str, Any]:
    """selection.json of an SFT directory; a clear error when it is not valid JSON."""
    path = paths.as_path(sft_dir) / SELECTION_FILE
    try:
        out = paths.read_json(path)
        out["evaluations"]  # noqa: B018 (the key must be there)
        return out
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path} is not a valid SFT selection record ({e}); delete {path.parent} to redo SFT"
        ) from e
