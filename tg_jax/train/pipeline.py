"""The main job: data -> SFT base model -> RL arms x seeds -> held-out evaluation -> report.

    run_pipeline(config, workdir)

Layout of `workdir`:
  tfds/                      the task datasets (data stage)
  sft/, sft_eval.json        the base model's checkpoints and its held-out evaluation
  base_model/                the base model as a Hugging Face checkpoint directory (weights,
                             tokenizer.json of sft.tokenizer, byte or the BPE SFT trained,
                             Qwen3 chat template); every RL run starts
                             from it. With `model.hf_checkpoint` there is no SFT: that
                             directory is the base model.
  tune/                      with pipeline.tune.lrs: each arm's learning-rate trials on a
                             validation split of the train tasks, tuning.json (tg_jax.train.tuning)
  runs/<arm>_seed<s>/        one RL run per arm and training seed (checkpoints, metrics,
                             rl_summary.json, heldout.jsonl), at the arm's chosen rate
  export/<arm>_seed<s>/      each run's final policy as a checkpoint directory (transformers'
                             `from_pretrained` loads it; tokenizer and template copied)
  report/                    report.md, results.json, curve PNGs

  sft_retry<k>/               SFT attempt k (seed + k, sft.data_seed + k), when the base
                             model of attempt k-1 failed the gates and sft.retry_seeds >= k
  preregistration.json       margin, floor, arms and their configs, written before any RL step

Every stage is cached or resumed: a finished SFT is skipped and an unfinished one resumed, an
RL run resumes from its latest checkpoint and returns at once when finished, a run's held-out
evaluation is read back from its heldout.jsonl. So rerunning the same command after a crash
or a preemption finishes the job without redoing work. A stage stopped by a preemption
request (SIGTERM) raises `checkpointing.Preempted` (exit status 143) right after its
checkpoint: it is neither evaluated nor cached as finished, and no later stage runs.

Between SFT and RL the base model must pass the gates of `sft.require` (`sft_gates`): else
`BaseModelGateError`, with the measured figures and the knobs, and no RL run or report.

Arms (`config.pipeline.arms`) differ only in the overrides of `ARMS`; every other setting,
the data, the sampling budget and the held-out tasks are the same for all of them.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

from tg_jax import checkpointing, config_files, multihost, paths, sharding
from tg_jax.data import task_data
from tg_jax.envs import env_kind
from tg_jax.evaluation import heldout_reads, protocol, registry, stability
from tg_jax.evaluation.report_settings import ReportSettings
from tg_jax.models import ModelConfig, hf_dir
from tg_jax.train import rl, sft, sft_eval, sft_gates, shipped_base, tuning
from tg_jax.train.arms import (  # noqa: F401 (the arms, named here too)
    ARM_ALIASES,
    ARMS,
    EVERY_REQUIREMENT_WEIGHT,
    Arm,
    Scale,
    arm_config,
    arm_overrides,
    get_arm,
)

RUNS_DIR, REPORT_DIR, EXPORT_DIR, BASE_MODEL_DIR = "runs", "report", "export", "base_model"


def run_data(config: Any, workdir: str) -> dict[str, Any]:
    """Data stage: writes (or reuses) the train / held-out task datasets."""
    sources = task_data.prepare_tasks(config, workdir)
    sizes = {split: len(src) for split, src in sources.items()}
    print(f"data: {sizes} tasks in {task_data.tasks_dir(workdir)}")
    return sources


def _preempted(stage: str, workdir: str) -> checkpointing.Preempted:
    err = checkpointing.Preempted(stage, workdir)
    print(err.message, file=sys.stderr)
    return err


def _read_json(path: str) -> dict[str, Any]:
    return paths.read_json(path)


def run_sft_stage(config: Any, workdir: str) -> Any:
    """SFT stage: trains, resumes or loads the base model, evaluates it once; returns params.

    Raises:
      checkpointing.Preempted: SFT stopped on a preemption request (checkpoint saved, no
        evaluation).
    """
    state = sft.run_sft(config, workdir)
    if checkpointing.preemption_requested() or not sft.sft_finished(config, workdir):
        raise _preempted("SFT", workdir)
    eval_path = os.path.join(workdir, sft_eval.EVAL_FILE)
    if paths.as_path(eval_path).exists():
        missing = sft_gates.unmeasured_requirements(config, _read_json(eval_path))
        if not missing:
            print(f"sft: finished checkpoint and {sft_eval.EVAL_FILE} found in {workdir}")
            return state.params
        print(
            f"sft: {sft_eval.EVAL_FILE} in {workdir} has no figures for requirement(s) "
            f"{missing} of env.requirements: evaluating the base model again"
        )
    result = sft.write_sft_eval(config, workdir, state.params)
    headline = {k: v for k, v in result.items() if not isinstance(v, dict | list)}
    print("sft_eval:", json.dumps(headline, indent=1))
    return state.params


def sft_attempt(config: Any, workdir: str, k: int) -> tuple[Any, str]:
    """(config, workdir) of SFT attempt k: attempt 0 is the config in `workdir`, attempt k
    uses seed + k and sft.data_seed + k in `workdir/sft_retry<k>`."""
    if k == 0:
        return config, workdir
    overrides = {"seed": int(config.seed) + k, "sft.data_seed": int(config.sft.data_seed) + k}
    return config_files.apply_overrides(config, overrides), os.path.join(workdir, f"sft_retry{k}")


def run_base_model(config: Any, workdir: str) -> tuple[Any, dict[str, Any], list[dict[str, Any]]]:
    """SFT until a base model passes the gates of `sft.require`, at most 1 + sft.retry_seeds
    attempts (`sft_attempt`); cached attempts are read back, not retrained.

    Returns:
      (params, its sft_eval.json, one dict per attempt: attempt, seed, data_seed, workdir,
      figures, failures, verdict).

    Raises:
      sft_gates.BaseModelGateError: every attempt failed (nothing downstream ran).
    """
    attempts = []
    for k in range(int(config.sft.retry_seeds) + 1):
        cfg, sft_dir = sft_attempt(config, workdir, k)
        params = run_sft_stage(cfg, sft_dir)
        result = _read_json(os.path.join(sft_dir, sft_eval.EVAL_FILE))
        failures = sft_gates.check_base_model(config, result)
        verdict = "accepted" if not failures else "rejected (" + "; ".join(failures) + ")"
        attempts.append(
            {
                "attempt": k,
                "seed": int(cfg.seed),
                "data_seed": int(cfg.sft.data_seed),
                "workdir": sft_dir,
                "figures": sft_gates.gate_figures(config, result),
                "failures": failures,
                "verdict": verdict,
            }
        )
        print(f"sft: attempt {k} (seed {cfg.seed}, data_seed {cfg.sft.data_seed}): {verdict}")
        if not failures:
            return params, result, attempts
    raise sft_gates.gate_error(config, attempts)


def _base_figures(result: dict[str, Any]) -> dict[str, float]:
    return {
        k: v
        for k, v in result.items()
        if isinstance(v, int | float)
        and ("pass_rate" in k or "compliance" in k or "format_cost" in k)
    }


def base_model_dir(config: Any, workdir: str) -> tuple[Any, dict, list]:
    """(the base model's checkpoint directory opened, its SFT evaluation, the SFT attempts).

    With `model.hf_checkpoint` that directory is the user's (no SFT). Otherwise SFT trains a
    base model that passes the gates (`run_base_model`) and writes it, once, as a checkpoint
    directory in `workdir/base_model` with its tokenizer's files (`sft.tokenizer`: byte, or the
    BPE trained on the SFT transcripts) and a Qwen3 chat template: every RL run then loads its
    policy the way a user's Qwen3 is loaded.
    """
    if config.model.hf_checkpoint:
        md = hf_dir.open_model_dir(
            config.model.hf_checkpoint, tool_format=config.model.get("tool_format", "")
        )
        return md, {}, []
    if shipped_base.source(config) == "shipped":
        return _shipped_base(config, workdir)
    params, result, attempts = run_base_model(config, workdir)
    out = paths.as_path(workdir) / BASE_MODEL_DIR
    if not (out / hf_dir.CONFIG_FILE).exists():
        sft_dir = attempts[-1]["workdir"]  # the accepted attempt: its tokenizer (sft.tokenizer)
        model_config = base_config(config, sft_dir).model
        with tempfile.TemporaryDirectory(prefix="tg_base_model_") as tmp:
            sft.write_tokenizer_files(config, sft_dir, tmp)
            hf_dir.export_model_dir(tmp, params, ModelConfig.from_config(model_config))
            hf_dir.copy_dir(tmp, str(out))
    return hf_dir.open_model_dir(str(out)), result, attempts


def _shipped_base(config: Any, workdir: str) -> tuple[Any, dict, list]:
    """The shipped base (`sft.source = "shipped"`), checked and copied to the workdir once;
    the gates of `sft.require` apply to its recorded figures."""
    out = str(paths.as_path(workdir) / BASE_MODEL_DIR)
    prov = multihost.primary_first("base_model", lambda: shipped_base.install(config, workdir, out))
    result = {
        **prov["sft_eval"],
        "shipped": {k: prov.get(k) for k in ("name", "sha256", "commit", "command", "machine")},
    }
    failures = sft_gates.check_base_model(config, result)
    if failures:
        raise sft_gates.gate_error(
            config,
            [
                {
                    "attempt": "shipped",
                    "seed": "-",
                    "data_seed": "-",
                    "workdir": out,
                    "figures": sft_gates.gate_figures(config, result),
                    "failures": failures,
                }
            ],
        )
    return hf_dir.open_model_dir(out), result, []


def remeasure_shipped_base(
    config: Any, workdir: str, md: Any, params: Any, recorded: dict
) -> dict[str, Any] | None:
    """A shipped base's figures (its dev tasks) measured on this machine, once per workdir
    (`workdir/sft_eval.json`, read back on a rerun), compared with the recorded ones
    (`shipped_base.compare`); a difference beyond the sampling interval is printed as a
    warning and the report lists it. After the arms, so RL starts at once. None when the base
    was not shipped (`recorded` has no "shipped")."""
    if not recorded.get("shipped"):
        return None
    path = paths.as_path(workdir) / sft_eval.EVAL_FILE
    if multihost.agreed(path.exists()):
        result = _read_json(str(path))
    else:
        model_cfg = ModelConfig.from_config(config.model)
        result = sft_eval.measure(config, model_cfg, params, md.renderer)
        result["shipped"] = recorded.get("shipped")
        result["comparison"] = shipped_base.compare(recorded, result)
        if multihost.is_primary():
            path.write_text(json.dumps(result, indent=2))
    comparison = result["comparison"]
    beyond = [k for k, c in comparison.items() if c["beyond"]]
    print(
        "base: re-measured here ("
        + ", ".join(
            f"{k} {c['measured']:.3f} vs {c['recorded']:.3f}"
            for k, c in comparison.items()
            if "greedy" not in k
        )
        + ")"
    )
    if beyond:
        print(
            f"warning: the shipped base measures differently here beyond the 95% sampling "
            f"interval on {', '.join(beyond)} ({path}); the recorded figures gate the run",
            file=sys.stderr,
        )
    return comparison


def train_source(config: Any) -> Any:
    """`config` with `sft.source = "train"` (a copy): SFT trains its base."""
    return config_files.apply_overrides(config, {"sft.source": "train"})


def base_config(config: Any, sft_dir: str) -> Any:
    """`config` with the vocabulary of the tokenizer SFT trained the base model with."""
    return sft.tokenized_config(config, sft.sft_tokenizer(config, sft_dir))


def _export(cfg: Any, workdir: str, run_name: str, params: Any, md: Any) -> None:
    """The run's final policy as a checkpoint directory `workdir/export/<run>` (once)."""
    out = paths.as_path(workdir) / EXPORT_DIR / run_name
    if not multihost.agreed((out / hf_dir.CONFIG_FILE).exists()):
        hf_dir.export_model_dir(str(out), params, ModelConfig.from_config(cfg.model), md)


def _load_base_params(config: Any, md: Any) -> Any:
    """The checkpoint's params on the trainer's mesh (its devices only when the sampler has
    its own: `sharding.split_devices`)."""
    model_cfg = ModelConfig.from_config(config.model)
    trainer_devices, _ = sharding.split_devices(config)
    mesh = sharding.make_mesh(config.mesh, trainer_devices)
    rules = sharding.logical_rules(config.mesh)
    return md.load_params(model_cfg, mesh=mesh, rules=rules)


def _run_arms(config, workdir, arms_cfgs, md, sources, base_params) -> list[Any]:
    """Every RL run (arm x training seed) and its held-out evaluation, as report RunResults."""
    from tg_jax.evaluation import report  # noqa: PLC0415 (matplotlib only for the report)

    eval_tasks = protocol.heldout_tasks(config, workdir, sources)  # an attempt's own draw
    sitting = tuple(config.pipeline.get("sitting", ()))
    runs = []
    for arm, cfg in arms_cfgs.items():
        for seed in config.eval.train_seeds:
            run_name = f"{arm}_seed{int(seed)}"
            if sitting and run_name not in sitting:
                continue  # another sitting's run (pipeline.sitting)
            run_dir = os.path.join(workdir, RUNS_DIR, run_name)
            result = rl.run_rl(
                cfg,
                run_dir,
                base_params,
                arm_name=arm,
                seed=int(seed),
                sources=sources,
                renderer=md.renderer,
                exporter=lambda p, out, c=cfg: hf_dir.export_model_dir(
                    out, p, ModelConfig.from_config(c.model), md
                ),
            )
            if checkpointing.preemption_requested() or not result.finished:
                raise _preempted(f"RL run {arm} seed {int(seed)}", run_dir)
            _export(cfg, workdir, run_name, result.state.params, md)
            records = heldout_reads.final_evaluation(
                cfg, workdir, run_name, run_dir, result.state.params, eval_tasks, md.renderer
            )
            export = os.path.join(workdir, EXPORT_DIR, run_name)
            protocol.record_run(cfg, workdir, arm, int(seed), records, export)  # registered only
            runs.append(
                report.load_run_result(
                    run_dir,
                    records,
                    group=get_arm(arm).group,
                    description=get_arm(arm).description,
                )
            )
    return runs


def _sitting_done(config: Any, prereg: dict, runs: list, reference_runs: dict) -> dict:
    """The end of a sitting (`pipeline.sitting`): what it ran and where the verdict comes from;
    no report (its runs are some of the job's)."""
    done = [f"{r.arm}_seed{r.seed}" for r in runs] + list(reference_runs)
    where = (
        f"docs/ledger: `python -m tg_jax.evaluation.verdict --attempt={prereg['registry_id']}"
        f" --registry={config.eval.registry}` once every run is in"
        if prereg.get("registry_id")
        else "no registered attempt: nothing keeps them"
    )
    print(f"sitting: ran {', '.join(done) or 'nothing'}; {where}")
    return {}


def _reference_runs(config, workdir, sources, base_params, md) -> dict[str, list[Any]]:
    """The held-out episodes of the references that are no arm: "base", the base model,
    evaluated once like a run (`heldout_reads.final_evaluation`), when `eval.references` names
    it or a baseline arm runs beside others (a baseline seed far under the base collapsed:
    `eval.collapse_drop`, negative = not checked)."""
    from tg_jax.evaluation.report import BASE_REFERENCE  # noqa: PLC0415 (matplotlib)

    arms, ev = tuple(config.pipeline.arms), config.eval
    compared = len(arms) > 1 and ev.baseline in arms and ev.get("collapse_drop", 0.0) >= 0
    if BASE_REFERENCE not in tuple(ev.get("references", ())) and not compared:
        return {}
    sitting = tuple(config.pipeline.get("sitting", ()))
    if sitting and BASE_REFERENCE not in sitting:
        return {}  # another sitting evaluates the base
    eval_tasks = protocol.heldout_tasks(config, workdir, sources)
    run_dir = os.path.join(workdir, RUNS_DIR, BASE_REFERENCE)
    records = heldout_reads.final_evaluation(
        config, workdir, BASE_REFERENCE, run_dir, base_params, eval_tasks, md.renderer
    )
    protocol.record_run(config, workdir, BASE_REFERENCE, None, records, config.model.hf_checkpoint)
    return {BASE_REFERENCE: records}


def _check_arms(config: Any, base_ref: str) -> None:
    """Fails before any work on a bad arm name or override, on several arms without the
    baseline (the report compares every arm with it; one arm alone is compared with none),
    on a reference or a sitting's run that is no run of this job."""
    arms = tuple(config.pipeline.arms)
    for arm in arms:
        arm_config(config, arm)
    tuning.check_tune_config(config)
    if len(arms) > 1 and str(config.eval.baseline) not in arms:
        raise ValueError(
            f"eval.baseline {config.eval.baseline!r} is not among pipeline.arms "
            f"{list(config.pipeline.arms)}: the report compares every arm with it; add it to the "
            "arms or set eval.baseline to one of them"
        )
    if bad := [r for r in config.eval.get("references", ()) if r not in (*arms, base_ref)]:
        raise ValueError(
            f"eval.references {bad} are neither among pipeline.arms {list(arms)} nor "
            f"{base_ref!r} (the base model): a reference is a run of this job"
        )
    known = [f"{a}_seed{int(s)}" for a in arms for s in config.eval.train_seeds] + [base_ref]
    if bad := [r for r in config.pipeline.get("sitting", ()) if r not in known]:
        raise ValueError(f"pipeline.sitting {bad} are not runs of this job: {known}")


def run_pipeline(config: Any, workdir: str) -> dict[str, Any]:
    """The whole main job (see the module docstring); returns the report's results dict."""
    from tg_jax.evaluation import report  # noqa: PLC0415 (matplotlib only for the report)

    _check_arms(config, report.BASE_REFERENCE)
    sources = multihost.primary_first("data", lambda: run_data(config, workdir))
    md, base_result, attempts = base_model_dir(config, workdir)
    if attempts:  # the embedded model: its vocabulary is its tokenizer's (sft.tokenizer)
        config = base_config(config, attempts[-1]["workdir"])
    config = hf_dir.resolve_config(config, md)
    arms_cfgs = {arm: arm_config(config, arm) for arm in config.pipeline.arms}
    prereg = multihost.primary_first(  # before the first RL step (trials too)
        "preregistration", lambda: protocol.preregister(config, workdir, arms_cfgs)
    )
    if prereg.get("registry_id"):  # the claim's earlier attempts set the verdict's level
        config = config_files.apply_overrides(config, {"eval.earlier": tuple(prereg["earlier"])})
    base_params = _load_base_params(config, md)
    tuned = None
    if tuning.enabled(config):  # the same learning-rate trials for every arm
        tuned = tuning.tune_arms(
            config, workdir, arms_cfgs, base_params, sources, renderer=md.renderer
        )
    runs = _run_arms(
        config, workdir, tuning.tuned_configs(arms_cfgs, tuned), md, sources, base_params
    )
    reference_runs = _reference_runs(config, workdir, sources, base_params, md)
    if config.pipeline.get("sitting"):
        return _sitting_done(config, prereg, runs, reference_runs)
    remeasured = remeasure_shipped_base(config, workdir, md, base_params, base_result)
    context = {
        "machine": protocol.machine_info(),
        "preregistration": protocol.check_preregistration(config, workdir, arms_cfgs),
        "base_model": _base_figures(base_result),
        "base_tasks": base_result.get("tasks"),
        "shipped_base": base_result.get("shipped"),
        "base_remeasured": remeasured,
        "sft_attempts": [
            {k: a[k] for k in ("attempt", "seed", "data_seed", "workdir", "verdict")}
            for a in attempts
        ],
        "budget": stability.tuning_budget(config),
        "budget_equal": len(
            {json.dumps(stability.tuning_budget(c), sort_keys=True) for c in arms_cfgs.values()}
        )
        <= 1,
        "tuning": tuned,
        "registry": _registry_context(config, prereg.get("registry_id")),
        "heldout_reads": heldout_reads.summary(workdir),
        "heldout_draw": protocol.describe_draw(config, workdir),
        "env_kind": env_kind(config.env),  # what a bootstrap cluster is
    }
    if not multihost.is_primary():  # process 0 writes the report; the others are done
        return {}
    walls = [sft.read_sft_wall_s(sft_attempt(config, workdir, a["attempt"])[1]) for a in attempts]
    res = report.write_report(
        os.path.join(workdir, REPORT_DIR),
        runs,
        config.eval,
        sft_wall_s=None if (None in walls or not walls) else sum(walls),
        tune_wall_s=tuned["wall_s"] if tuned else None,
        context=context,
        reference_runs=reference_runs,
    )
    print(headline(res))
    print(f"report: {os.path.join(workdir, REPORT_DIR, report.REPORT_FILE)}")
    if prereg.get("registry_id") and res.get("noninferiority"):
        registry.record_outcome(config.eval.registry, prereg["registry_id"], res["noninferiority"])
        print(
            f"registry: {prereg['registry_id']} {res['noninferiority']['verdict']} "
            f"({config.eval.registry})"
        )
    return res


def _registry_context(config: Any, key: str | None) -> dict[str, Any] | None:
    """The registered attempt this run is, the earlier ones with their verdicts, and the
    verdict's level after the split (None when the run tests no registered hypothesis)."""
    if not key:
        return None
    entries = registry.read(config.eval.registry)
    earlier = [
        {"id": k, "verdict": (entries.get(k, {}).get("outcome") or {}).get("verdict")}
        for k in config.eval.earlier
    ]
    level = ReportSettings.from_config(config.eval).verdict_level()
    return {
        "id": key,
        "hypothesis": config.eval.hypothesis,
        "registry": config.eval.registry,
        "earlier": earlier,
        "level": level,
    }


def headline(res: dict[str, Any]) -> str:
    """A few lines for the terminal: held-out compliance / task success per arm, NI verdict."""
    lines = ["held-out (plain prompts, 95% cluster bootstrap CI):"]
    for arm, a in res["arms"].items():
        boot = a["heldout"]["plain"]["bootstrap"]
        cells = [
            f"{key} {boot[key]['mean']:.2f} [{boot[key]['low']:.2f}, {boot[key]['high']:.2f}]"
            for key in ("compliance", "task_success")
            if key in boot
        ]
        lines.append(f"  {arm:<18} " + "  ".join(cells))
    attempts = (res.get("context") or {}).get("sft_attempts") or []
    if len(attempts) > 1:
        a = attempts[-1]
        lines.append(
            f"base model: SFT attempt {a['attempt']} (seed {a['seed']}, data_seed "
            f"{a['data_seed']}) passed the gates after {len(attempts) - 1} rejected"
        )
    ct = res.get("compute_time")
    if ct and ct.get("sft_s") is not None:
        partial = "" if ct["complete"] else "at least "
        tune_s = ct.get("tune_s")
        trials = "" if tune_s is None else f"learning-rate trials {tune_s / 60:.1f} + "
        lines.append(
            f"compute time {partial}{ct['total_s'] / 60:.1f} min: SFT {ct['sft_s'] / 60:.1f} + "
            f"{trials}RL {ct['rl_s'] / 60:.1f} + held-out evaluation {ct['eval_s'] / 60:.1f} "
            f"({ct['eval_runs']} of {ct['runs']} evaluations timed)"
        )
    ni = res.get("noninferiority")
    if ni:

        def num(x: Any) -> str:  # None: NaN after the JSON round trip (under two seeds)
            return "n/a" if x is None else f"{x:+.3f}"

        why = ni.get("why") or (
            f"baseline task success {ni['baseline_success']:.3f} < floor {ni['floor']:.3f}"
            if ni["verdict"] == "not meaningful"
            else ""
        )
        lines.append(
            f"non-inferiority of task success: {ni['verdict'].upper()} "
            f"({why + '; ' if why else ''}difference {num(ni['mean'])}, lower bound "
            f"{num(ni['lower'])} vs margin {ni['margin']:+.3f})"
        )
    return "\n".join(lines)
