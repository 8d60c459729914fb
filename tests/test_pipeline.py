"""The main job in miniature: data -> SFT -> GRPO and TG arms -> held-out eval -> report."""

import json
import os
import signal

import pytest

from tg_jax import checkpointing, config_files
from tg_jax.evaluation import heldout_reads, protocol
from tg_jax.train import pipeline, rl, sft, sft_eval, sft_gates

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "configs")


# The tiny config's pipeline in seconds: 2 SFT steps, 1 RL step, evaluations on 2 tasks.
FAST_PIPELINE = {
    "sft.steps": 2,
    "sft.eval.num_tasks": 2,
    "sft.eval.temperatures": (1.0,),
    "rl_loop.steps": 1,
    "rl_loop.eval_every": 0,
    "rl_loop.async_sampling": False,
    "eval.num_tasks": 2,
    "eval.last_k": 1,
    "eval.n_boot": 50,
}


def _config():
    config = config_files.load_config_file(os.path.join(CONFIG_DIR, "tiny.py"))
    return config_files.apply_overrides(config, FAST_PIPELINE)


def test_arms_differ_only_in_their_overrides():
    config = _config()
    grpo, tg = pipeline.arm_config(config, "grpo"), pipeline.arm_config(config, "tg")
    assert not grpo.tg.enabled and tg.tg.enabled
    grpo_d, tg_d = grpo.to_dict(), tg.to_dict()
    grpo_d["tg"].pop("enabled"), tg_d["tg"].pop("enabled")
    assert grpo_d == tg_d


def test_every_arm_applies_to_the_default_and_experiment_configs():
    for name in ("default.py", "experiment.py", "peers.py"):
        config = config_files.load_config_file(os.path.join(CONFIG_DIR, name))
        for arm, spec in pipeline.ARMS.items():
            cfg = pipeline.arm_config(config, arm)
            overrides = pipeline.arm_overrides(config, arm)
            for key, value in spec.overrides.items():
                if key == pipeline.EVERY_REQUIREMENT_WEIGHT:
                    assert {k: cfg.rl.reward_weights[k] for k in config.rl.reward_weights} == {
                        k: config.rl.reward_weights[k] if k == "task" else value
                        for k in config.rl.reward_weights
                    }, (name, arm)
                    continue
                if key.startswith("rl.reward_weights.") and key.split(".")[-1] not in (
                    config.rl.reward_weights
                ):
                    assert key not in overrides
                    continue  # a requirement this config does not reward: left out
                node, base = cfg, config
                for part in key.split("."):
                    node, base = node[part], base[part]
                if isinstance(value, pipeline.Scale):  # relative to the config's own value
                    assert node == pytest.approx(base * value.factor), (name, arm, key)
                    continue
                assert node == value, (name, arm, key)
    # Every arm is run by one of the protocols: the evaluation protocol, the peers', the
    # thinking controls.
    protocols = [config_files.load_config_file(os.path.join(CONFIG_DIR, f"{name}.py"))
                 for name in ("experiment", "peers", "thinking")]  # fmt: skip
    assert set().union(*(set(p.pipeline.arms) for p in protocols)) == set(pipeline.ARMS)
    for p in protocols:
        assert {"grpo", "tg"} <= set(p.pipeline.arms) and len(p.eval.train_seeds) >= 3


def test_peers_config_is_its_base_config_plus_the_arms():
    for arg, base in ((None, "default.py"), ("fence", "fence.py")):
        peers = config_files.load_config_file(os.path.join(CONFIG_DIR, "peers.py"), arg).to_dict()
        want = config_files.load_config_file(os.path.join(CONFIG_DIR, base)).to_dict()
        assert peers["pipeline"]["arms"] == ("grpo", "tg", "sdpo", "opsd", "sdar", "sgcd")
        assert peers["eval"]["train_seeds"] == (0, 1, 2)
        for d in (peers, want):
            d["pipeline"].pop("arms"), d["eval"].pop("train_seeds")
        assert peers == want, base
    assert want["rl_loop"]["steps"] == 120 and want["env"]["requirements"] == ("fence",)
    with pytest.raises(ValueError, match="configs/peers.py takes one of"):
        config_files.load_config_file(os.path.join(CONFIG_DIR, "peers.py"), "joint2")


def test_lambda_ablations_scale_the_configs_own_lambda():
    for name in ("default.py", "fence.py", "joint.py"):
        config = config_files.load_config_file(os.path.join(CONFIG_DIR, name))
        lam = config.tg.lambda_tg
        high = pipeline.arm_config(config, "tg_lambda_high").tg.lambda_tg
        low = pipeline.arm_config(config, "tg_lambda_low").tg.lambda_tg
        assert (high, low) == (pytest.approx(4 * lam), pytest.approx(lam / 4)), name
        assert config.tg.lambda_tg == lam  # the shared config untouched


def test_task_only_arms_and_aliases():
    config = config_files.load_config_file(os.path.join(CONFIG_DIR, "default.py"))
    assert config.rl.reward_weights["tool_json"] > 0  # the shared config rewards a requirement
    grpo_task = pipeline.arm_config(config, "grpo_task_only")
    assert not grpo_task.tg.enabled
    assert dict(grpo_task.rl.reward_weights) == {"task": 1.0, "tool_json": 0.0}
    tg_task = pipeline.arm_config(config, "tg_task_only")  # alias of tg_no_req_reward
    assert tg_task.to_dict() == pipeline.arm_config(config, "tg_no_req_reward").to_dict()
    assert tg_task.tg.enabled and dict(tg_task.rl.reward_weights)["tool_json"] == 0.0
    # The pair differs only in tg.enabled.
    a, b = grpo_task.to_dict(), tg_task.to_dict()
    a["tg"].pop("enabled"), b["tg"].pop("enabled")
    assert a == b
    assert pipeline.get_arm("tg_task_only") is pipeline.ARMS["tg_no_req_reward"]
    # Every requirement weight, whatever the environment names them.
    swe = config_files.apply_overrides(config, {})
    swe.unlock()
    swe.rl.reward_weights = {"task": 1.0, "tool_protocol": 0.3, "markdown_report": 0.2}
    got = pipeline.arm_config(swe, "grpo_task_only").rl.reward_weights
    assert dict(got) == {"task": 1.0, "tool_protocol": 0.0, "markdown_report": 0.0}


def test_preregistration_accepts_arms_in_any_order(tmp_path):
    # The file is written with sorted keys; the protocol's arm order (experiment.py: the
    # order of ARMS) is not sorted, and must not read as a different protocol.
    config = _config()
    order = ("tg", "grpo_task_only", "grpo")
    arms = {a: pipeline.arm_config(config, a) for a in order}
    out = protocol.preregister(config, str(tmp_path), arms)
    assert out == protocol.check_preregistration(config, str(tmp_path), arms)
    arms.pop("grpo")
    with pytest.raises(protocol.PreregistrationMismatch, match="arms: file"):
        protocol.check_preregistration(config, str(tmp_path), arms)


def test_bad_arm_fails_before_any_work(tmp_path):
    config = config_files.apply_overrides(_config(), {"pipeline.arms": ("grpo", "tgg")})
    with pytest.raises(ValueError, match="unknown arm 'tgg'"):
        pipeline.run_pipeline(config, str(tmp_path))
    assert os.listdir(tmp_path) == []
    # Arms without the baseline the report compares with: refused before any work too.
    config = config_files.apply_overrides(_config(), {"pipeline.arms": ("tg", "tg_think")})
    with pytest.raises(ValueError, match="eval.baseline 'grpo' is not among pipeline.arms"):
        pipeline.run_pipeline(config, str(tmp_path))
    assert os.listdir(tmp_path) == []
    # A reference that is no run of this job (neither an arm nor the base model).
    config = config_files.apply_overrides(_config(), {"eval.references": ("base", "sdpo")})
    with pytest.raises(ValueError, match=r"eval.references \['sdpo'\] are neither among"):
        pipeline.run_pipeline(config, str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_a_torn_heldout_read_ledger_is_a_clear_error(tmp_path):
    (tmp_path / heldout_reads.READS_FILE).write_text('{"reads": [{"purpose"')
    with pytest.raises(heldout_reads.HeldoutReadError, match="not a held-out read ledger"):
        heldout_reads.check_read(str(tmp_path), heldout_reads.FINAL, "tg_seed0")
    (tmp_path / heldout_reads.READS_FILE).write_text('{"reads": {}}')
    with pytest.raises(heldout_reads.HeldoutReadError, match=r":1: not a held-out read ledger"):
        heldout_reads.reads(str(tmp_path))


@pytest.mark.slow
def test_pipeline_runs_every_stage_and_caches(tmp_path):
    reg = tmp_path / "preregistrations.jsonl"  # a registered hypothesis (evaluation.registry)
    config = config_files.apply_overrides(
        _config(), {"eval.hypothesis": "tiny/tg-vs-grpo", "eval.registry": str(reg),
                    "eval.references": ("base",)},  # the base model as a second reference
    )  # fmt: skip
    workdir = str(tmp_path / "w")
    res = pipeline.run_pipeline(config, workdir)
    assert list(res["references"]) == ["grpo", "base"]
    assert res["references"]["grpo"] == res["noninferiority"]
    assert res["references"]["base"]["verdict"] in ("exploratory", "not meaningful")
    entry, outcome = (json.loads(x) for x in reg.read_text().splitlines())
    assert entry["id"] == outcome["id"] == f"{entry['claim']}#1" and entry["outcome"] is None
    assert entry["hypothesis"] == "tiny/tg-vs-grpo"  # a label: the claim's key is derived
    for run in ("grpo_seed0", "tg_seed0", "base"):  # each finished run in the results ledger
        assert (tmp_path / "ledger" / entry["claim"] / "1" / f"{run}.json").exists(), run
    assert outcome["outcome"]["verdict"] == res["noninferiority"]["verdict"]
    assert res["noninferiority"]["verdict"] in ("exploratory", "not meaningful")  # one seed
    assert res["context"]["registry"]["level"] == 0.95  # the first attempt: no split
    for path in ("sft_eval.json", "report/report.md", "report/results.json"):
        assert os.path.exists(os.path.join(workdir, path)), path
    for arm in ("grpo", "tg"):
        assert os.path.exists(os.path.join(workdir, "runs", f"{arm}_seed0", "heldout.jsonl"))
    assert set(res["arms"]) == {"grpo", "tg"}
    text = pipeline.headline(res)
    tg = res["arms"]["tg"]["heldout"]["plain"]["bootstrap"]["compliance"]
    assert f"compliance {tg['mean']:.2f} [{tg['low']:.2f}, {tg['high']:.2f}]" in text
    assert res["noninferiority"]["verdict"].upper() in text and "grpo" in text
    # The protocol's compute time: SFT + every run's RL + every run's held-out evaluation.
    ct = res["compute_time"]
    with open(os.path.join(workdir, "sft", "sft_summary.json")) as f:
        assert ct["sft_s"] == json.load(f)["wall_s"]
    rl_s = sum(r["costs"]["wall_time_s"] for r in res["runs"])
    eval_s = sum(r["costs"]["eval_wall_time_s"] for r in res["runs"])
    assert (ct["runs"], ct["eval_runs"]) == (2, 2) and eval_s > 0 and ct["complete"]
    assert ct["total_s"] == pytest.approx(ct["sft_s"] + rl_s + eval_s)
    assert f"compute time {ct['total_s'] / 60:.1f} min" in text
    with open(os.path.join(workdir, "report", "report.md")) as f:
        md = f.read()
    assert f"**{ct['total_s'] / 60:.1f} min** (held-out evaluation: 2 of 2 runs" in md
    assert f"Registered as `{entry['id']}` in `{reg}`; earlier attempts" in md
    with open(os.path.join(workdir, sft_eval.EVAL_FILE)) as f:
        base = json.load(f)
    assert {"pass_rate", "unprompted_compliance/fence", "hinted_compliance/fence"} <= set(base)
    # The fence's format cost: the plain pass rate minus the one with the fence forced open.
    assert base["format_cost/fence"] == pytest.approx(
        base["pass_rate"] - base["forced_pass_rate/fence"]
    )
    assert base["modes"]["t1.0/forced_fence"]["num_episodes"] == config.sft.eval.num_tasks
    # The report stands on a named machine, the base model's figures and the pre-registration.
    with open(os.path.join(workdir, "report", "report.md")) as f:
        md = f.read()
    sha = res["context"]["preregistration"]["sha256"]
    assert sha in md and os.path.exists(os.path.join(workdir, protocol.PREREGISTRATION_FILE))
    assert f"{os.cpu_count()} cores" in md and f"pass_rate {base['pass_rate']:.2f}" in md
    assert f"format_cost/fence {base['format_cost/fence']:.2f}" in md
    assert res["context"]["sft_attempts"][0]["verdict"] == "accepted"  # tiny: gates off
    # The tiny model solves almost nothing: below the floor the verdict is not pass/fail.
    grpo_success = res["arms"]["grpo"]["heldout"]["plain"]["bootstrap"]["task_success"]["mean"]
    if grpo_success < config.eval.floor:
        assert res["noninferiority"]["verdict"] == "not meaningful"
        assert "NOT MEANINGFUL" in text and "NOT MEANINGFUL" in md

    # A second run finds every stage done: nothing is retrained or re-evaluated.
    stamps = {
        p: os.path.getmtime(os.path.join(workdir, p))
        for p in ("sft_eval.json", "runs/grpo_seed0/heldout.jsonl", "runs/tg_seed0/heldout.jsonl")
    }
    again = pipeline.run_pipeline(config, workdir)
    for p, t in stamps.items():
        assert os.path.getmtime(os.path.join(workdir, p)) == t, p
    assert again["arms"]["tg"]["heldout"] == res["arms"]["tg"]["heldout"]

    # The held-out tasks were read once per run, by its final evaluation; the base model was
    # evaluated on dev tasks (and the periodic evaluation reads dev tasks too).
    assert base["tasks"] == {"split": "dev", "seed": 8}
    reads = heldout_reads.reads(workdir)
    assert [(r["purpose"], r["run"], r["asked"]) for r in reads] == [
        ("final evaluation", "grpo_seed0", False),
        ("final evaluation", "tg_seed0", False),
        ("final evaluation", "base", False),
    ]
    assert "the final evaluation of 3 run(s), once each; nothing else read" in md
    # A deleted heldout.jsonl is not evaluated again unasked: a second look is an error.
    os.remove(os.path.join(workdir, "runs", "tg_seed0", "heldout.jsonl"))
    with pytest.raises(heldout_reads.HeldoutReadError, match="run tg_seed0 was already evaluated"):
        pipeline.run_pipeline(config, workdir)
    asked = config_files.apply_overrides(config, {"eval.reread_heldout": True})
    res = pipeline.run_pipeline(asked, workdir)
    assert [r["asked"] for r in heldout_reads.reads(workdir)] == [False, False, False, True]
    assert res["context"]["heldout_reads"]["extra"][0]["run"] == "tg_seed0"
    with open(os.path.join(workdir, "report", "report.md")) as f:
        assert "**1 more read(s)**: final evaluation of tg_seed0 on" in f.read()


@pytest.mark.slow
def test_changed_protocol_is_refused(tmp_path):
    config = _config()
    workdir = str(tmp_path)
    pipeline.run_pipeline(config, workdir)
    moved = config_files.apply_overrides(config, {"eval.margin": -0.2})
    with pytest.raises(protocol.PreregistrationMismatch, match=r"eval.margin: file -0.05"):
        pipeline.run_pipeline(moved, workdir)
    floor = config_files.apply_overrides(config, {"eval.floor": 0.0})
    with pytest.raises(protocol.PreregistrationMismatch, match=r"eval.floor"):
        pipeline.run_pipeline(floor, workdir)
    fewer = config_files.apply_overrides(config, {"pipeline.arms": ("grpo",)})
    with pytest.raises(protocol.PreregistrationMismatch, match=r"arms: file \['grpo', 'tg'\]"):
        pipeline.run_pipeline(fewer, workdir)
    # Report time: a file edited after the runs no longer matches the config.
    path = os.path.join(workdir, protocol.PREREGISTRATION_FILE)
    with open(path) as f:
        stored = json.load(f)
    stored["arms"]["tg"]["tg"]["enabled"] = False
    with open(path, "w") as f:
        json.dump(stored, f)
    arms = {a: pipeline.arm_config(config, a) for a in config.pipeline.arms}
    with pytest.raises(protocol.PreregistrationMismatch, match="arm 'tg': its config differs"):
        protocol.check_preregistration(config, workdir, arms)


@pytest.mark.slow
def test_base_model_gates_stop_before_rl(tmp_path):
    config = config_files.apply_overrides(
        _config(),
        # A format-cost bound no base can meet (cost > -0.99 unless the format alone solves
        # 99% more tasks): the gate reads sft_eval.json's forced mode.
        {"sft.require.enabled": True, "sft.require.pass_rate": (0.9, 1.0), "sft.retry_seeds": 1,
         "sft.require.max_format_cost": -0.99},
    )  # fmt: skip
    workdir = str(tmp_path)
    with pytest.raises(sft_gates.BaseModelGateError) as info:
        pipeline.run_pipeline(config, workdir)
    msg = str(info.value)
    for part in ("attempt 0 (seed 0, sft.data_seed 1", "attempt 1 (seed 1, sft.data_seed 2",
                 "FAIL pass_rate", "outside [0.9, 1.0]", "hinted_compliance/fence",
                 "format_cost/fence", "> -0.99", "format cost <= -0.99",
                 "sft.steps", "sft.data_seed", "sft.optim.lr", "sft.retry_seeds"):  # fmt: skip
        assert part in msg, part
    # Both attempts trained and evaluated (the retry in a fresh subdir); nothing downstream.
    assert os.path.exists(os.path.join(workdir, "sft_retry1", sft_eval.EVAL_FILE))
    for path in ("runs", "report", protocol.PREREGISTRATION_FILE):
        assert not os.path.exists(os.path.join(workdir, path)), path


@pytest.mark.slow
def test_retry_seed_that_passes_the_gates_is_used_and_reported(tmp_path, monkeypatch):
    config = config_files.apply_overrides(_config(), {"sft.retry_seeds": 2})
    workdir = str(tmp_path)
    real_stage, last_dir = pipeline.run_sft_stage, []

    def stage(cfg, sft_dir):
        last_dir.append(sft_dir)
        return real_stage(cfg, sft_dir)

    def check(cfg, result):  # attempt 0 fails its gates, attempt 1 passes
        return ["pass_rate 0.000 outside [0.2, 0.6]"] if last_dir[-1] == workdir else []

    monkeypatch.setattr(pipeline, "run_sft_stage", stage)
    monkeypatch.setattr(sft_gates, "check_base_model", check)
    res = pipeline.run_pipeline(config, workdir)
    assert last_dir == [workdir, os.path.join(workdir, "sft_retry1")]  # no third attempt
    attempts = res["context"]["sft_attempts"]
    assert [(a["attempt"], a["seed"], a["data_seed"]) for a in attempts] == [(0, 0, 1), (1, 1, 2)]
    assert attempts[0]["verdict"].startswith("rejected") and attempts[1]["verdict"] == "accepted"
    with open(os.path.join(workdir, "sft_retry1", sft_eval.EVAL_FILE)) as f:
        assert res["context"]["base_model"]["pass_rate"] == json.load(f)["pass_rate"]
    with open(os.path.join(workdir, "report", "report.md")) as f:
        md = f.read()
    assert "SFT attempt 0 (seed 0, data_seed 1" in md and "rejected (pass_rate" in md
    assert "SFT attempt 1 (seed 1, data_seed 2" in md
    assert "base model: SFT attempt 1 (seed 1, data_seed 2) passed the gates after 1 rejected" in (
        pipeline.headline(res)
    )


def _sigterm_then(fn):
    """`fn`, after a real SIGTERM has set the preemption flag (the handler installed first)."""

    def wrapped(*args, **kwargs):
        assert checkpointing.install_sigterm_handler()
        signal.raise_signal(signal.SIGTERM)
        assert checkpointing.preemption_requested()
        return fn(*args, **kwargs)

    return wrapped


@pytest.mark.slow
def test_sigterm_during_sft_stops_the_job_and_a_rerun_resumes(
    tmp_path, monkeypatch, restore_sigterm
):
    config = config_files.apply_overrides(_config(), {"sft.steps": 4, "sft.checkpoint_every": 100})
    workdir = str(tmp_path)
    monkeypatch.setattr(sft, "run_sft", _sigterm_then(sft.run_sft))
    with pytest.raises(checkpointing.Preempted) as info:
        pipeline.run_pipeline(config, workdir)
    assert info.value.code == 143 and "preempted during SFT" in str(info.value)
    assert not sft.sft_finished(config, workdir)  # a checkpoint, not the finished one
    with checkpointing.TrainingCheckpointer(sft.sft_checkpoint_dir(workdir), read_only=True) as c:
        assert c.latest_step() == 1
    for path in (sft_eval.EVAL_FILE, "runs", "report", protocol.PREREGISTRATION_FILE):
        assert not os.path.exists(os.path.join(workdir, path)), path

    monkeypatch.undo()
    checkpointing.clear_preemption_request()  # a fresh process starts without the flag
    res = pipeline.run_pipeline(config, workdir)
    assert sft.sft_finished(config, workdir) and set(res["arms"]) == {"grpo", "tg"}
    with open(os.path.join(workdir, "sft", "sft_summary.json")) as f:
        sessions = json.load(f)["sessions"]
    assert [(s["start_step"], s["end_step"]) for s in sessions] == [(0, 1), (1, 4)]


@pytest.mark.slow
def test_sigterm_during_an_rl_arm_stops_the_job_and_a_rerun_resumes(
    tmp_path, monkeypatch, restore_sigterm
):
    config = config_files.apply_overrides(_config(), {"rl_loop.steps": 2})
    workdir = str(tmp_path)
    real = rl.run_rl
    calls = []

    def run_rl(cfg, run_dir, *args, arm_name, **kwargs):
        calls.append(arm_name)
        fn = _sigterm_then(real) if arm_name == "tg" else real
        return fn(cfg, run_dir, *args, arm_name=arm_name, **kwargs)

    monkeypatch.setattr(rl, "run_rl", run_rl)
    with pytest.raises(checkpointing.Preempted, match="preempted during RL run tg seed 0"):
        pipeline.run_pipeline(config, workdir)
    assert calls == ["grpo", "tg"]
    runs = os.path.join(workdir, "runs")
    assert os.path.exists(os.path.join(runs, "grpo_seed0", "heldout.jsonl"))
    assert not os.path.exists(os.path.join(runs, "tg_seed0", "heldout.jsonl"))
    assert not os.path.exists(os.path.join(workdir, "report"))
    with checkpointing.TrainingCheckpointer(
        os.path.join(runs, "tg_seed0", "checkpoints"), read_only=True
    ) as c:
        assert c.latest_step() == 1
    grpo_stamp = os.path.getmtime(os.path.join(runs, "grpo_seed0", "heldout.jsonl"))

    monkeypatch.undo()
    checkpointing.clear_preemption_request()
    res = pipeline.run_pipeline(config, workdir)
    assert os.path.getmtime(os.path.join(runs, "grpo_seed0", "heldout.jsonl")) == grpo_stamp
    tg = [r for r in res["runs"] if r["arm"] == "tg"][0]
    steps = [s for s, _ in tg["curves"]["train:rollout/compliance"]]
    assert steps == [1, 2]  # resumed at step 1, finished at 2


@pytest.mark.slow
def test_base_model_evaluated_for_other_requirements_is_evaluated_again(tmp_path, capsys):
    # A finished SFT whose sft_eval.json has no figures for a requirement of the config (the
    # demo's base copied into a workdir of another requirement) is evaluated again, not
    # retrained, and not sent to the gates without figures.
    config = _config()
    workdir = str(tmp_path)
    pipeline.run_sft_stage(config, workdir)
    path = os.path.join(workdir, sft_eval.EVAL_FILE)
    with open(path) as f:
        measured = json.load(f)
    assert sft_gates.unmeasured_requirements(config, measured) == []
    other = {k: v for k, v in measured.items() if not k.startswith("hinted_compliance/fence")}
    other["unprompted_compliance/tool_json"] = other.pop("unprompted_compliance/fence")
    assert sft_gates.unmeasured_requirements(config, other) == ["fence"]
    with open(path, "w") as f:
        json.dump(other, f)
    checkpoints = os.path.join(workdir, "sft", "checkpoints")
    stamps = {p: os.path.getmtime(os.path.join(checkpoints, p)) for p in os.listdir(checkpoints)}
    capsys.readouterr()
    pipeline.run_sft_stage(config, workdir)
    assert "no figures for requirement(s) ['fence']" in capsys.readouterr().out
    with open(path) as f:
        again = json.load(f)
    assert again["hinted_compliance/fence"] == measured["hinted_compliance/fence"]
    assert again["unprompted_compliance/fence"] == measured["unprompted_compliance/fence"]
    assert {p: os.path.getmtime(os.path.join(checkpoints, p)) for p in stamps} == stamps


@pytest.mark.slow
def test_a_registered_attempt_spans_sittings_through_the_ledger(tmp_path, capsys):
    from tg_jax.evaluation import verdict

    reg = tmp_path / "docs" / "preregistrations.jsonl"
    reg.parent.mkdir()
    config = config_files.apply_overrides(
        _config(), {"eval.hypothesis": "tiny/sittings", "eval.registry": str(reg),
                    "eval.floor": 0.0},  # the tiny model solves nothing: no floor
    )  # fmt: skip
    workdir = str(tmp_path / "w")
    first = config_files.apply_overrides(config, {"pipeline.sitting": ("grpo_seed0", "base")})
    assert pipeline.run_pipeline(first, workdir) == {}
    out = capsys.readouterr().out
    assert "sitting: ran grpo_seed0, base;" in out
    attempt = out.split("--attempt=")[1].split()[0]
    argv = [f"--attempt={attempt}", f"--registry={reg}"]
    assert verdict.main(argv) == 1  # the candidate's run is not in yet
    assert "tg_seed0" in capsys.readouterr().out
    assert not os.path.exists(os.path.join(workdir, "runs", "tg_seed0"))
    assert not os.path.exists(os.path.join(workdir, "report"))
    # The next sitting (another machine would clone the committed ledger): the same attempt.
    second = config_files.apply_overrides(config, {"pipeline.sitting": ("tg_seed0",)})
    assert pipeline.run_pipeline(second, workdir) == {}
    assert f"--attempt={attempt} " in capsys.readouterr().out
    ledger_dir = os.path.join(tmp_path, "docs", "ledger", *attempt.split("#"))
    assert sorted(os.listdir(ledger_dir)) == [
        "attempt.json", "base.json", "grpo_seed0.json", "tg_seed0.json"
    ]  # fmt: skip
    assert verdict.main([*argv, "--json"]) == 0
    v = json.loads(capsys.readouterr().out)
    assert v["verdict"] == "exploratory" and v["missing"] == []  # one seed per arm
    with pytest.raises(ValueError, match=r"pipeline.sitting \['tg_seed7'\] are not runs"):
        pipeline.run_pipeline(
            config_files.apply_overrides(config, {"pipeline.sitting": ("tg_seed7",)}), workdir
        )
