"""The eval stage: a checkpoint directory's held-out evaluation, with traces; no training.

    python -m tg_jax.main --config=configs/tiny.py --workdir=W --config.stage=eval \\
        --config.model.hf_checkpoint=W/export/tg_seed0 --config.eval.reread_heldout=True

The policy is `model.hf_checkpoint`, any checkpoint directory: a run's export
(W/export/<arm>_seed<s>), one written during training (W/runs/<run>/export/step_<N>, with
`rl_loop.export_every`), the base model (W/base_model) or a user's Qwen3. A directory named
`<arm>_seed<s>` after an arm of `tg_jax.train.arms.ARMS` is evaluated under that arm's config
(its thinking controls, say). The tasks: those the final evaluations of W read
(`protocol.heldout_tasks`: the first `eval.num_tasks` held-out tasks, or a registered
attempt's draw), or a user's task file (`--config.tasks.heldout_source=FILE`).

The episodes are played by the final evaluation's code (`heldout_reads.final_evaluation`) with
the sampling key of every arm (`eval.sampling_seed`): a run's export evaluated in its workdir
reproduces the run's held-out episodes one for one. The read is a look at the held-out tasks:
the ledger records it as "evaluation only", and refuses it where the ledger already holds a
read (the pipeline's final evaluations) unless `eval.reread_heldout` (then recorded as asked;
the report of W lists it).

Outputs in W/eval/<name> (the directory's name; `<run>_step_<N>` for an export during
training), read back on a rerun (delete the directory to evaluate again):
  heldout.jsonl, heldout_summary.json  one record per episode (as a run's), the wall time
  traces.jsonl                         one line per episode: task, condition, sample, outcome,
                                       rewards, and each turn: its text, tokens and their
                                       log-prob, tool calls, verdicts, the hint before it and
                                       the observation after it
  report.md, results.json              the report's held-out tables (compliance, task success,
                                       per requirement, plain vs hinted) with their intervals
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

from tg_jax import multihost, paths
from tg_jax.errors import ConfigError

EVAL_DIR, TRACES_FILE = "eval", "traces.jsonl"
_RUN_NAME = re.compile(r"\A(?P<arm>.+)_seed(?P<seed>\d+)\Z")


def eval_name(checkpoint: str) -> str:
    """The evaluation's name: the directory's, `<run>_step_<N>` for .../<run>/export/step_<N>."""
    parts = os.path.normpath(os.fspath(checkpoint).rstrip("/")).split(os.sep)
    name = parts[-1]
    if name.startswith("step_") and len(parts) >= 3 and parts[-2] == "export":
        return f"{parts[-3]}_{name}"
    return name


def arm_and_seed(name: str) -> tuple[str | None, int]:
    """(the arm of `ARMS` a `<arm>_seed<s>[_step_<N>]` name names, or None; s, or 0)."""
    from tg_jax.train import arms  # noqa: PLC0415

    m = _RUN_NAME.match(re.sub(r"_step_\d+\Z", "", name))
    if m is None:
        return None, 0
    arm = m["arm"]
    known = arm in arms.ARMS or arm in arms.ARM_ALIASES
    return (arm if known else None), int(m["seed"])


def run(config: Any, workdir: str) -> dict[str, Any]:
    """The eval stage (module docstring); returns the report's results dict ({} off process 0).

    Raises:
      ConfigError: no `model.hf_checkpoint`.
      heldout_reads.HeldoutReadError: another look at the held-out tasks, not asked for.
    """
    if not config.model.get("hf_checkpoint"):
        raise ConfigError(
            "the eval stage evaluates a checkpoint directory: set --config.model.hf_checkpoint "
            "to one (a run's export W/export/<arm>_seed<s>, W/base_model, a Qwen3 directory)"
        )
    from tg_jax.evaluation import heldout_reads, protocol  # noqa: PLC0415
    from tg_jax.models import hf_dir  # noqa: PLC0415
    from tg_jax.train import arms, pipeline  # noqa: PLC0415

    md = hf_dir.open_model_dir(
        config.model.hf_checkpoint, tool_format=config.model.get("tool_format", "")
    )
    name = eval_name(config.model.hf_checkpoint)
    arm, seed = arm_and_seed(name)
    config = hf_dir.resolve_config(config, md)
    cfg = arms.arm_config(config, arm) if arm else config
    sources = multihost.primary_first("data", lambda: pipeline.run_data(config, workdir))
    tasks = protocol.heldout_tasks(config, workdir, sources)
    out = paths.as_path(workdir) / EVAL_DIR / name
    print(f"eval: {md.path} as {f'arm {arm!r}' if arm else 'no arm'} on {len(tasks)} tasks")
    params = _load_params(cfg, md)
    records = heldout_reads.final_evaluation(
        cfg,
        workdir,
        name,
        os.fspath(out),
        params,
        tasks,
        md.renderer,
        purpose=heldout_reads.EVAL_ONLY,
        traces=lambda recs, trajs: write_traces(out / TRACES_FILE, recs, trajs, md.renderer),
    )
    if not multihost.is_primary():
        return {}
    res = write_report(cfg, workdir, os.fspath(out), arm or name, seed, records, md.path)
    print(pipeline.headline(res))
    print(f"eval: {out / 'report.md'}, traces {out / TRACES_FILE}")
    return res


def _load_params(config: Any, md: Any) -> Any:
    """The checkpoint's params on the trainer's mesh, as the pipeline loads its base model."""
    from tg_jax import sharding  # noqa: PLC0415
    from tg_jax.models import ModelConfig  # noqa: PLC0415

    devices, _ = sharding.split_devices(config)
    mesh = sharding.make_mesh(config.mesh, devices)
    rules = sharding.logical_rules(config.mesh)
    return md.load_params(ModelConfig.from_config(config.model), mesh=mesh, rules=rules)


def episode_trace(record: Any, traj: Any, renderer: Any) -> dict[str, Any]:
    """One episode for reading: its record's outcome, its rewards, the prompt, and per
    assistant turn the text (thinking included), its sampled tokens and their log-prob under
    the sampling distribution, the tool calls the renderer's format reads in it, its verdicts,
    the hint shown before it and the observation that followed it."""
    import numpy as np  # noqa: PLC0415

    from tg_jax.text.chat import Role  # noqa: PLC0415

    tokens, roles = np.asarray(traj.tokens), np.asarray(traj.roles)
    logprobs = np.asarray(traj.behaviour_logprobs, np.float64)
    turn_ids, starts = np.asarray(traj.turn_ids), [int(s) for s in traj.turn_starts]
    decode = renderer.tokenizer.decode

    def text(lo: int, hi: int, role: Role) -> str:
        return decode([int(t) for t in tokens[lo:hi][roles[lo:hi] == role]])

    fmt = renderer.tool_format
    turns = []
    for k in range(len(starts)):
        (idx,) = np.nonzero(turn_ids == k)
        end = int(idx[-1]) + 1 if idx.size else starts[k]
        nxt = starts[k + 1] if k + 1 < len(starts) else len(tokens)
        said = decode([int(t) for t in tokens[idx]])
        calls = fmt.calls(said) if fmt is not None else []
        turns.append(
            {
                "turn": k,
                "text": said,
                "tokens": int(idx.size),
                "logprob": float(logprobs[idx].sum()),
                "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in calls],
                "verdicts": dict(traj.turn_verdicts[k]),
                "failed": traj.failed_requirements(k),
                "hint": text(starts[k - 1] if k else 0, starts[k], Role.HINT),
                "observation": text(end, nxt, Role.ENV),
            }
        )
    return {
        **record.to_dict(),
        "rewards": {k: float(v) for k, v in traj.rewards.items()},
        "prompt": text(0, starts[0] if starts else len(tokens), Role.PROMPT),
        "turns": turns,
    }


def write_traces(path: Any, records: Sequence[Any], trajs: Sequence[Any], renderer: Any) -> None:
    """`episode_trace` of every episode, one JSON line each, written atomically."""
    if len(records) != len(trajs):
        raise ValueError(f"{len(records)} records but {len(trajs)} trajectories")
    path = paths.as_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps(episode_trace(r, t, renderer), default=str) + "\n"
        for r, t in zip(records, trajs, strict=True)
    ]
    tmp = path.parent / f"{path.name}.tmp"
    tmp.write_text("".join(lines))
    tmp.replace(path)


def write_report(config, workdir, out_dir, arm, seed, records, checkpoint) -> dict[str, Any]:
    """results.json and report.md in `out_dir`: the report's held-out sections (no training,
    no comparison) for one set of episodes."""
    from tg_jax.envs import env_kind  # noqa: PLC0415
    from tg_jax.evaluation import heldout_reads, md_heldout, md_setting, protocol, report  # noqa: PLC0415
    from tg_jax.evaluation.report_settings import ReportSettings  # noqa: PLC0415

    run = report.RunResult(arm=arm, seed=seed, heldout=list(records), train_records=[], costs={})
    res = report.compute_results([run], ReportSettings.from_config(config.eval))
    res["context"] = {
        "machine": protocol.machine_info(),
        "heldout_reads": heldout_reads.summary(workdir),
        "env_kind": env_kind(config.env),
        "checkpoint": checkpoint,
    }
    res = report._json_safe(res)
    paths.write_json_atomic(
        paths.as_path(out_dir) / report.RESULTS_FILE, res, indent=1, allow_nan=False
    )
    lines = [
        f"# Evaluation of `{checkpoint}`",
        "",
        f"Evaluation only (`--config.stage=eval`), no training; traces: {TRACES_FILE}.",
        "",
    ]
    for section in (
        md_setting.context_section,
        md_heldout.heldout_section,
        md_heldout.requirements_section,
        md_heldout.diagnostic_section,
        md_heldout.side_effects_section,
    ):
        lines += section(res)
    (paths.as_path(out_dir) / report.REPORT_FILE).write_text("\n".join(lines))
    return res
