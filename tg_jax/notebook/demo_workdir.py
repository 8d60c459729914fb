"""A small synthetic results workdir, shaped like a real one, for notebooks and tests.

`make_demo_workdir(path)` writes, for each arm and training seed, a run directory with a
metrics.jsonl (training-rollout and held-out curves, loss terms) and then the report of all
runs (report.md, results.json, curve PNGs, via `tg_jax.evaluation.report.write_report`):

    path/runs/<arm>_seed<k>/metrics.jsonl   (the layout of tg_jax.train.pipeline)
    path/report/{results.json, report.md, curve_compliance.png, curve_task_success.png}

EVERY NUMBER IN IT IS MADE UP: the curves follow the shape of the published reference result
(TG compliance rising to ~0.85 while GRPO stays near 0; equal task success ~0.33) plus noise,
and the held-out episodes are coin flips with those rates. It exists so that the results
notebook and its test run without a real run; never report it.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from tg_jax.evaluation import report
from tg_jax.metrics import MetricsWriter, last_per_step, read_metrics
from tg_jax.sampling.episode import EpisodeRecord

RUNS_DIR, REPORT_DIR = "runs", "report"


@dataclasses.dataclass(frozen=True)
class DemoArm:
    """Synthetic behaviour of one arm.

    Attributes:
      name: arm name.
      final_compliance: training-rollout compliance reached at the end (held-out plain too).
      task_success: task success rate (flat over training).
      tg: whether the arm has a TG term (tg_kl / tg_loss curves).
      group, description: as in `tg_jax.evaluation.report.RunResult`.
    """

    name: str
    final_compliance: float
    task_success: float
    tg: bool
    group: str = "main"
    description: str = ""


DEFAULT_ARMS = (
    DemoArm("grpo", 0.0, 0.33, tg=False, description="GRPO, all rewards on"),
    DemoArm("tg", 0.85, 0.33, tg=True, description="GRPO + TG on failed turns"),
)


def _run_records(arm: DemoArm, steps: int, eval_every: int, rng) -> list[dict]:
    """Per-step metrics of one synthetic run (what `tg_jax.train.rl` logs, a few keys)."""
    out = []
    for step in range(1, steps + 1):
        ramp = 1.0 / (1.0 + np.exp(-10.0 * (step / steps - 0.35)))
        comp = float(np.clip(arm.final_compliance * ramp + rng.normal(0, 0.05), 0, 1))
        succ = float(np.clip(arm.task_success + rng.normal(0, 0.06), 0, 1))
        tg_kl = 0.4 * (1.0 - ramp) + 0.05 + abs(rng.normal(0, 0.02)) if arm.tg else 0.0
        rec = {
            "rollout/compliance": comp,
            "rollout/task_success": succ,
            "rollout/joint": comp * succ,
            "tg_kl": tg_kl,
            "tg_loss": tg_kl,
            "pg_loss": float(rng.normal(0, 0.02)),
            "entropy": 1.2 - 0.3 * step / steps + float(rng.normal(0, 0.02)),
        }
        rec["loss"] = rec["pg_loss"] + rec["tg_loss"]
        out.append(("train", step, rec))
        if step % eval_every == 0 or step == steps:
            held = {
                "heldout/compliance": float(np.clip(comp + rng.normal(0, 0.03), 0, 1)),
                "heldout/task_success": float(np.clip(succ + rng.normal(0, 0.03), 0, 1)),
            }
            held["heldout/joint"] = held["heldout/compliance"] * held["heldout/task_success"]
            out.append(("eval", step, held))
    return out


def _episodes(arm: DemoArm, num_tasks: int, rng, difficulty: np.ndarray) -> list[EpisodeRecord]:
    """Held-out episodes: plain at the arm's rates, hinted almost always compliant."""
    out = []
    for cond, comply in (("plain", arm.final_compliance), ("hinted", 0.95)):
        for i in range(num_tasks):
            success = rng.random() < np.clip(arm.task_success + difficulty[i], 0, 1)
            out.append(
                EpisodeRecord(
                    task_id=f"heldout/{i}",
                    condition=cond,
                    sample=0,
                    task_success=bool(success),
                    compliance={"fence": bool(rng.random() < comply)},
                    actions={"run_tests": int(rng.integers(0, 3)), "submit": 1, "malformed": 0},
                    turns=int(rng.integers(1, 4)),
                )
            )
    return out


def make_demo_workdir(
    path: str | os.PathLike,
    *,
    arms: tuple[DemoArm, ...] = DEFAULT_ARMS,
    seeds: tuple[int, ...] = (0, 1),
    steps: int = 40,
    eval_every: int = 10,
    num_tasks: int = 32,
    n_boot: int = 1000,
    seed: int = 0,
) -> str:
    """Writes a synthetic workdir (see the module docstring) and returns its path.

    Args:
      path: directory to create (may exist; files in it are overwritten, metrics appended to).
      arms: the arms; the first one is the report's baseline, the second its candidate.
      seeds: training seeds per arm.
      steps: training steps per run.
      eval_every: held-out evaluation interval in steps.
      num_tasks: held-out tasks.
      n_boot: bootstrap replicates of the report.
      seed: numpy seed of all the made-up numbers.

    Returns:
      `path` as a string.
    """
    path = os.fspath(path)
    rng = np.random.default_rng(seed)
    difficulty = rng.normal(0, 0.2, num_tasks)
    runs = []
    for arm in arms:
        for s in seeds:
            run_dir = os.path.join(path, RUNS_DIR, f"{arm.name}_seed{s}")
            with MetricsWriter(run_dir, use_tensorboard=False, enabled=True) as writer:
                for stage, step, rec in _run_records(arm, steps, eval_every, rng):
                    writer.write(step, rec, stage=stage)
            costs = {
                "wall_time_s": float(60 + 10 * arm.tg + rng.normal(0, 2)),
                "sampled_tokens": float(steps * 64 * 150),
                "teacher_forward_flops": float(steps * 1.5e11 if arm.tg else 0.0),
                "peak_memory_bytes": float(1.2e9 + 2e8 * arm.tg),
            }
            runs.append(
                report.RunResult(
                    arm=arm.name,
                    seed=s,
                    heldout=_episodes(arm, num_tasks, rng, difficulty),
                    train_records=last_per_step(read_metrics(run_dir)),
                    costs=costs,
                    group=arm.group,
                    description=arm.description,
                )
            )
    settings = report.ReportSettings(
        baseline=arms[0].name,
        candidate=arms[1].name if len(arms) > 1 else arms[0].name,
        n_boot=n_boot,
        last_k=max(1, steps // 4),
    )
    # write_report draws its PNGs with the Agg backend; give a notebook its own backend back.
    import matplotlib  # noqa: PLC0415

    backend = matplotlib.get_backend()
    try:
        report.write_report(os.path.join(path, REPORT_DIR), runs, settings)
    finally:
        matplotlib.use(backend)
    return path
