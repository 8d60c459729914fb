"""The main job: data -> SFT base model -> RL arms x seeds -> held-out evaluation -> report.

    run_pipeline(config, workdir)

Layout of `workdir`:
  tfds/                      the task datasets (data stage)
  sft/, sft_eval.json        the base model's checkpoints and its held-out evaluation
  runs/<arm>_seed<s>/        one RL run per arm and training seed (checkpoints, metrics,
                             rl_summary.json, heldout.jsonl)
  report/                    report.md, results.json, curve PNGs

Every stage is cached or resumed: a finished SFT is skipped and an unfinished one resumed, an
RL run resumes from its latest checkpoint and returns at once when finished, a run's held-out
evaluation is read back from its heldout.jsonl. So rerunning the same command after a crash
or a preemption finishes the job without redoing work.

Arms (`config.pipeline.arms`) differ only in the overrides of `ARMS`; every other setting,
the data, the sampling budget and the held-out tasks are the same for all of them.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tg_jax import config_lib
from tg_jax.evaluation import heldout
from tg_jax.train import data_stage, rl, sft, sft_eval

RUNS_DIR, REPORT_DIR = "runs", "report"

# Arm name -> (config overrides, one-line description for the report).
ARMS: dict[str, tuple[dict[str, Any], str]] = {
    "grpo": ({"tg.enabled": False}, "GRPO with task and requirement rewards, no hints"),
    "tg": ({"tg.enabled": True}, "GRPO + targeted guidance (hinted teacher, failed turns)"),
}


def arm_config(config: Any, arm: str) -> Any:
    """`config` with the overrides of `arm` (a new config; the original is untouched)."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; known: {sorted(ARMS)}")
    return config_lib.apply_overrides(config, ARMS[arm][0])


def run_data(config: Any, workdir: str) -> dict[str, Any]:
    """Data stage: writes (or reuses) the train / held-out task datasets."""
    sources = data_stage.prepare_tasks(config, workdir)
    sizes = {split: len(src) for split, src in sources.items()}
    print(f"data: {sizes} tasks in {os.path.join(workdir, data_stage.TFDS_DIR)}")
    return sources


def run_sft_stage(config: Any, workdir: str, sources: dict[str, Any] | None = None) -> Any:
    """SFT stage: trains, resumes or loads the base model, evaluates it once; returns params."""
    state = sft.run_sft(config, workdir)
    if os.path.exists(os.path.join(workdir, sft_eval.EVAL_FILE)):
        print(f"sft: finished checkpoint and {sft_eval.EVAL_FILE} found in {workdir}")
        return state.params
    sources = sources if sources is not None else data_stage.prepare_tasks(config, workdir)
    tasks = data_stage.load_tasks(sources, "heldout", config.sft.eval.num_tasks)
    result = sft_eval.write_sft_eval(config, workdir, state.params, tasks)
    headline = {k: v for k, v in result.items() if not isinstance(v, dict | list)}
    print("sft_eval:", json.dumps(headline, indent=1))
    return state.params


def run_pipeline(config: Any, workdir: str) -> dict[str, Any]:
    """The whole main job (see the module docstring); returns the report's results dict."""
    from tg_jax import report  # noqa: PLC0415 (matplotlib only for the report)

    sources = run_data(config, workdir)
    base_params = run_sft_stage(config, workdir, sources)
    eval_tasks = data_stage.load_tasks(sources, "heldout", config.eval.num_tasks)
    runs = []
    for arm in config.pipeline.arms:
        cfg = arm_config(config, arm)
        for seed in config.eval.train_seeds:
            run_dir = os.path.join(workdir, RUNS_DIR, f"{arm}_seed{int(seed)}")
            result = rl.run_rl(
                cfg, run_dir, base_params, arm_name=arm, seed=int(seed), sources=sources
            )
            records = heldout.evaluate_run(cfg, run_dir, result.state.params, eval_tasks)
            runs.append(report.load_run_result(run_dir, records, description=ARMS[arm][1]))
    res = report.write_report(os.path.join(workdir, REPORT_DIR), runs, config.eval)
    print(f"report: {os.path.join(workdir, REPORT_DIR, report.REPORT_FILE)}")
    return res
