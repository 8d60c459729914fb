"""Learning-rate selection with the same tuning budget for every arm, never on held-out tasks.

    chosen = tune_arms(config, workdir, arms_cfgs, base_params, sources, renderer=...)

With `pipeline.tune.lrs = (lr_1, ..., lr_k)` every arm trains k trial runs, one per learning
rate, all with the training seed `pipeline.tune.seed` (not one of `eval.train_seeds`), on the
train split minus its last `pipeline.tune.val_tasks` tasks. Those tasks are the validation
split: the trials never train on them, their periodic evaluation runs on them, and each trial
is scored on them once it is finished (plain prompts, `pipeline.tune.samples_per_task`
episodes per task, the held-out evaluation's sampling settings). The score is one yardstick
for every arm, the task-reward-only arms included: the mean over episodes of task success and
requirement compliance weighted by the config's `rl.reward_weights` (the base config's, not
the arm's). Each arm keeps the rate with the highest score (a tie keeps the one listed first)
and its `eval.train_seeds` runs train at it on the whole train split. The held-out split is
not read by any of this. `pipeline.tune.lrs = ()`: no trials, every arm runs at `optim.lr`.

Layout in the pipeline's workdir:
  tune/<arm>_lr<k>/            trial k of an arm (an RL run: checkpoints, metrics,
                               rl_summary.json) and its validation.jsonl / validation.json
  tune/tuning.json             every trial's score and each arm's choice (the report's table)

Trials are cached like the runs: a finished trial with its validation file is read back, an
unfinished one resumes from its checkpoint, so a preempted tuning stage loses nothing.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from tg_jax import checkpointing, config_files, paths
from tg_jax.data import tfds_builders
from tg_jax.envs import decode_task
from tg_jax.evaluation import heldout
from tg_jax.metrics import RL_SUMMARY_FILE
from tg_jax.train import rl

TUNE_DIR = "tune"
TUNING_FILE = "tuning.json"
VALIDATION_FILE = "validation.jsonl"
VALIDATION_SUMMARY_FILE = "validation.json"


class SourcePrefix:
    """The first `stop` records of a random-access source (grain reads it like the source)."""

    def __init__(self, source: Sequence[Any], stop: int):
        if not 0 < stop <= len(source):
            raise ValueError(f"a prefix of {stop} records of a source of {len(source)}")
        self._source, self._stop = source, int(stop)

    def __len__(self) -> int:
        return self._stop

    def __getitem__(self, index: int) -> Any:
        if not -self._stop <= index < self._stop:
            raise IndexError(f"record {index} of a prefix of {self._stop}")
        return self._source[index % self._stop]


def enabled(config: Any) -> bool:
    """Whether `config` asks for learning-rate trials (`pipeline.tune.lrs` not empty)."""
    tune = config.pipeline.get("tune") if "pipeline" in config else None
    return bool(tune is not None and tuple(tune.lrs))


def check_tune_config(config: Any) -> None:
    """Raises ValueError (before any work) on a tuning section that cannot run."""
    if not enabled(config):
        return
    tune = config.pipeline.tune
    lrs = [float(x) for x in tune.lrs]
    if any(not lr > 0 for lr in lrs) or len(set(lrs)) != len(lrs):
        raise ValueError(f"pipeline.tune.lrs must be distinct positive rates, got {lrs}")
    num_train, val = int(config.tasks.num_train), int(tune.val_tasks)
    per_step = int(config.rl_loop.groups_per_step)
    if not 0 < val <= num_train - per_step:
        raise ValueError(
            f"pipeline.tune.val_tasks = {val}: the validation split is taken from the "
            f"{num_train} train tasks and must leave at least a step's {per_step} tasks to "
            "train the trials on"
        )
    if int(tune.seed) in {int(s) for s in config.eval.train_seeds}:
        raise ValueError(
            f"pipeline.tune.seed = {int(tune.seed)} is one of eval.train_seeds "
            f"{list(config.eval.train_seeds)}: the trials need a seed of their own"
        )
    if int(tune.samples_per_task) < 1:
        raise ValueError(
            f"pipeline.tune.samples_per_task must be >= 1, got {tune.samples_per_task}"
        )


def split_train(sources: Mapping[str, Any], val_tasks: int) -> tuple[dict[str, Any], list[Any]]:
    """(the sources with "train" cut to all but its last `val_tasks` tasks, those tasks)."""
    train = sources["train"]
    n = len(train) - int(val_tasks)
    val = [decode_task(tfds_builders.decode_example(train[i])) for i in range(n, len(train))]
    return {**sources, "train": SourcePrefix(train, n)}, val


def score(config: Any, records: Sequence[Any]) -> float:
    """Mean over episodes of task success and per-requirement compliance, weighted by
    `config.rl.reward_weights` ("task" weighs task success, every other key its requirement)."""
    weights = {k: float(v) for k, v in config.rl.reward_weights.items()}
    if not records:
        raise ValueError("no validation episodes to score")
    total = 0.0
    for r in records:
        values = r.values()
        for key, w in weights.items():
            total += w * values.get("task_success" if key == "task" else f"compliance/{key}", 0.0)
    return total / len(records)


def trial_dir(workdir: str, arm: str, k: int) -> str:
    return os.path.join(workdir, TUNE_DIR, f"{arm}_lr{k}")


def _validate(config: Any, run_dir: str, params: Any, val: Sequence[Any], renderer: Any) -> dict:
    """The trial's validation records and wall time, cached in its directory."""
    records = heldout.evaluate_run(
        config,
        run_dir,
        params,
        val,
        records_file=VALIDATION_FILE,
        summary_file=VALIDATION_SUMMARY_FILE,
        conditions=("plain",),
        samples_per_task=int(config.pipeline.tune.samples_per_task),
        renderer=renderer,
    )
    summary = paths.read_json(paths.as_path(run_dir) / VALIDATION_SUMMARY_FILE)
    return {"records": records, "wall_s": float(summary["wall_s"])}


@dataclasses.dataclass(frozen=True)
class _Trials:
    """What every arm's trials share: the base config (its score), the rates, the seed, the
    trial split and its validation tasks, the starting params."""

    config: Any
    workdir: str
    lrs: list[float]
    seed: int
    sources: Mapping[str, Any]  # the train split minus the validation tasks
    val: list[Any]  # the validation tasks
    eval_tasks: list[Any]  # the periodic evaluation's: the first of `val`
    base_params: Any
    renderer: Any


def tune_arms(
    config: Any,
    workdir: str,
    arms_cfgs: Mapping[str, Any],
    base_params: Any,
    sources: Mapping[str, Any],
    *,
    renderer: Any = None,
) -> dict[str, Any]:
    """Runs (or reads back) every arm's trials; returns tuning.json's content:

      {"lrs", "seed", "val_tasks", "samples_per_task", "score", "wall_s" (the trials' RL and
       validation time summed), "arms": {arm: {"trials": [{"lr", "score", "task_success",
       "compliance", "rl_wall_s", "eval_wall_s"}], "chosen_lr"}}}

    Raises:
      checkpointing.Preempted: a trial stopped on a preemption request (its checkpoint saved;
        a rerun resumes it).
    """
    tune = config.pipeline.tune
    trial_sources, val = split_train(sources, int(tune.val_tasks))
    setup = _Trials(
        config=config,
        workdir=workdir,
        lrs=[float(x) for x in tune.lrs],
        seed=int(tune.seed),
        sources=trial_sources,
        val=val,
        eval_tasks=val[: int(config.rl_loop.eval_tasks)],
        base_params=base_params,
        renderer=renderer,
    )
    out = {
        "lrs": setup.lrs,
        "seed": setup.seed,
        "val_tasks": len(val),
        "samples_per_task": int(tune.samples_per_task),
        "score": "mean of "
        + " + ".join(
            f"{float(w):g} x {'task success' if k == 'task' else k + ' compliance'}"
            for k, w in config.rl.reward_weights.items()
        ),
        "arms": {},
    }
    wall = 0.0
    for arm, arm_cfg in arms_cfgs.items():
        trials = []
        for k in range(len(setup.lrs)):
            trials.append(_trial(setup, arm, arm_cfg, k))
            wall += trials[-1]["rl_wall_s"] + trials[-1]["eval_wall_s"]
        best = max(range(len(trials)), key=lambda i: (trials[i]["score"], -i))
        out["arms"][arm] = {"trials": trials, "chosen_lr": trials[best]["lr"]}
        print(f"tune: {arm} keeps lr {trials[best]['lr']:g}")
    out["wall_s"] = wall
    paths.write_json_atomic(
        paths.as_path(workdir) / TUNE_DIR / TUNING_FILE, out, indent=1, sort_keys=True
    )
    return out


def _trial(setup: _Trials, arm: str, arm_cfg: Any, k: int) -> dict[str, Any]:
    """Trial k of `arm`: its RL run at rate k (run, resumed or read back), validated; returns
    its row of tuning.json. Raises checkpointing.Preempted when the run stopped early."""
    lr = setup.lrs[k]
    cfg = config_files.apply_overrides(arm_cfg, {"optim.lr": lr})
    run_dir = trial_dir(setup.workdir, arm, k)
    print(f"tune: {arm} lr {lr:g} (trial {k + 1} of {len(setup.lrs)}, seed {setup.seed})")
    result = rl.run_rl(
        cfg,
        run_dir,
        setup.base_params,
        arm_name=arm,
        seed=setup.seed,
        sources=setup.sources,
        eval_tasks=setup.eval_tasks,
        renderer=setup.renderer,
    )
    if checkpointing.preemption_requested() or not result.finished:
        err = checkpointing.Preempted(f"tuning trial {arm} lr {lr:g}", run_dir)
        print(err.message)
        raise err
    v = _validate(cfg, run_dir, result.state.params, setup.val, setup.renderer)
    recs = v["records"]
    # The run's summary (as the report reads the runs'): a resumed run's costs too.
    summary = paths.read_json(paths.as_path(run_dir) / RL_SUMMARY_FILE)
    rl_s = float(summary["costs"].get("wall_time_s", 0.0))
    trial = {
        "lr": lr,
        "score": score(setup.config, recs),
        "task_success": sum(r.values()["task_success"] for r in recs) / len(recs),
        "compliance": sum(r.values()["compliance"] for r in recs) / len(recs),
        "rl_wall_s": rl_s,
        "eval_wall_s": v["wall_s"],
    }
    print(f"tune: {arm} lr {lr:g}: validation score {trial['score']:.3f}")
    return trial


def tuned_configs(arms_cfgs: Mapping[str, Any], tuning: Mapping[str, Any] | None) -> dict:
    """Each arm's config at its chosen learning rate (unchanged without tuning)."""
    if not tuning:
        return dict(arms_cfgs)
    return {
        arm: config_files.apply_overrides(cfg, {"optim.lr": tuning["arms"][arm]["chosen_lr"]})
        for arm, cfg in arms_cfgs.items()
    }
