"""Learning-rate trials (tg_jax.train.tuning): the same budget for every arm, chosen on a
validation split of the train tasks, never on held-out; the user's command end to end."""

import json
import os
import subprocess
import sys

import grain
import pytest

from tests.test_pipeline import FAST_PIPELINE, _sigterm_then
from tg_jax import checkpointing, config_files
from tg_jax.data import task_data
from tg_jax.data.pipeline import TaskIterator
from tg_jax.envs import decode_task
from tg_jax.sampling.episode import EpisodeRecord
from tg_jax.train import pipeline, rl, tuning

ROOT = os.path.join(os.path.dirname(__file__), "..")
CONFIG_DIR = os.path.join(ROOT, "configs")

# The tiny pipeline in seconds (tests/test_pipeline.py's settings) with two rates per arm.
FAST = {**FAST_PIPELINE, "pipeline.tune.lrs": (1e-3, 3e-3), "pipeline.tune.val_tasks": 4}


def _config(**extra):
    config = config_files.load_config_file(os.path.join(CONFIG_DIR, "tiny.py"))
    return config_files.apply_overrides(config, {**FAST, **extra})


def _record(task_success, compliance):
    return EpisodeRecord("t", "plain", 0, task_success, compliance, {}, 1)


def test_score_weighs_task_success_and_each_requirement():
    config = config_files.apply_overrides(
        _config(), {"rl.reward_weights": {"task": 1.0, "fence": 0.5}}
    )
    records = [
        _record(True, {"fence": True}),  # 1 + 0.5
        _record(True, {"fence": False}),  # 1
        _record(False, {"fence": True}),  # 0.5
        _record(False, {"fence": False}),  # 0
    ]
    assert tuning.score(config, records) == pytest.approx(3.0 / 4)
    task_only = config_files.apply_overrides(config, {"rl.reward_weights.fence": 0.0})
    assert tuning.score(task_only, records) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no validation episodes"):
        tuning.score(config, [])


def test_trials_never_train_on_the_validation_split(tmp_path):
    config = _config()
    sources = task_data.prepare_tasks(config, str(tmp_path))
    n = len(sources["train"])
    trial_sources, val = tuning.split_train(sources, 4)
    assert len(trial_sources["train"]) == n - 4 and trial_sources["heldout"] is sources["heldout"]
    all_train = task_data.load_tasks(sources, "train")
    assert [t.task_id for t in val] == [t.task_id for t in all_train[n - 4 :]]
    # Two epochs of the trials' task stream: every task but the validation split's, each twice.
    it = TaskIterator(
        trial_sources["train"], group_size=4, seed=3, decode_fn=decode_task,
        shard=grain.sharding.ShardOptions(0, 1, drop_remainder=True),
    )  # fmt: skip
    seen = [t.task_id for _ in range(2 * (n - 4) // 4) for t in next(it)]
    assert sorted(set(seen)) == sorted(t.task_id for t in all_train[: n - 4])
    assert not set(seen) & {t.task_id for t in val}
    with pytest.raises(IndexError):
        trial_sources["train"][n - 4]


@pytest.mark.parametrize(
    "overrides, why",
    [
        ({"pipeline.tune.val_tasks": 31}, "must leave at least a step's"),
        ({"pipeline.tune.seed": 0}, "is one of eval.train_seeds"),
        ({"pipeline.tune.lrs": (1e-3, 1e-3)}, "distinct positive rates"),
        ({"pipeline.tune.samples_per_task": 0}, "samples_per_task must be >= 1"),
    ],
    ids=["val_too_big", "seed_shared", "duplicate_lr", "no_samples"],
)
def test_bad_tuning_sections_fail_before_any_work(tmp_path, overrides, why):
    with pytest.raises(ValueError, match=why):
        pipeline.run_pipeline(_config(**overrides), str(tmp_path))
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_every_arm_gets_the_same_trials_and_runs_at_its_best_rate(tmp_path, monkeypatch):
    calls = []
    real = rl.run_rl

    def spy(cfg, run_dir, params, **kw):
        calls.append({
            "dir": os.path.relpath(run_dir, tmp_path), "lr": float(cfg.optim.lr),
            "seed": kw["seed"], "train": len(kw["sources"]["train"]),
            "eval": [t.task_id for t in kw.get("eval_tasks") or []],
        })  # fmt: skip
        return real(cfg, run_dir, params, **kw)

    monkeypatch.setattr(rl, "run_rl", spy)
    config = _config()
    res = pipeline.run_pipeline(config, str(tmp_path))
    with open(tmp_path / "tune" / "tuning.json") as f:
        tuned = json.load(f)
    assert tuned == res["context"]["tuning"]
    n = int(config.tasks.num_train)
    val_ids = [t.task_id for t in task_data.load_tasks(
        task_data.prepare_tasks(config, str(tmp_path)), "train")[n - 4 :]]  # fmt: skip
    trials = [c for c in calls if c["dir"].startswith("tune")]
    finals = [c for c in calls if c["dir"].startswith("runs")]
    assert len(trials) == 4 and len(finals) == 2  # 2 arms x 2 rates; 2 arms x 1 seed
    for arm in ("grpo", "tg"):
        mine = [c for c in trials if c["dir"].startswith(f"tune/{arm}_lr")]
        assert [c["lr"] for c in mine] == [1e-3, 3e-3]
        assert all(c["seed"] == 1000 and c["train"] == n - 4 for c in mine)
        assert all(c["eval"] == val_ids[: int(config.rl_loop.eval_tasks)] for c in mine)
        scores = [t["score"] for t in tuned["arms"][arm]["trials"]]
        best = [1e-3, 3e-3][max(range(2), key=lambda i: (scores[i], -i))]
        assert tuned["arms"][arm]["chosen_lr"] == best
        (final,) = [c for c in finals if c["dir"] == f"runs/{arm}_seed0"]
        assert final["lr"] == best and final["train"] == n and final["seed"] == 0
        # Validation: the last 4 train tasks, plain prompts, 1 episode each.
        with open(tmp_path / "tune" / f"{arm}_lr0" / "validation.jsonl") as f:
            recs = [json.loads(line) for line in f]
        assert sorted(r["task_id"] for r in recs) == sorted(val_ids)
        assert {r["condition"] for r in recs} == {"plain"}
    # The trials' compute is part of the protocol's, and the report states the procedure.
    ct = res["compute_time"]
    assert ct["tune_s"] == pytest.approx(tuned["wall_s"]) and ct["tune_s"] > 0
    rl_s = sum(r["costs"]["wall_time_s"] for r in res["runs"])
    eval_s = sum(r["costs"]["eval_wall_time_s"] for r in res["runs"])
    assert ct["total_s"] == pytest.approx(ct["sft_s"] + ct["tune_s"] + rl_s + eval_s)
    assert res["context"]["budget"]["lr_trials"] == 2 and res["context"]["budget_equal"]
    md = (tmp_path / "report" / "report.md").read_text()
    assert "2 trials per arm" in md and "validation split of 4" in md
    assert f"| `tg` | {tuned['arms']['tg']['trials'][0]['score']:.3f}" in md
    assert "![tuning.png](tuning.png)" in md and (tmp_path / "report" / "tuning.png").is_file()
    # A rerun reads every trial back: nothing is retrained or re-validated.
    calls.clear()
    stamp = os.path.getmtime(tmp_path / "tune" / "tg_lr1" / "validation.jsonl")
    again = pipeline.run_pipeline(config, str(tmp_path))
    assert again["context"]["tuning"]["arms"] == tuned["arms"]
    assert os.path.getmtime(tmp_path / "tune" / "tg_lr1" / "validation.jsonl") == stamp


@pytest.mark.slow
def test_sigterm_during_a_trial_stops_the_job_and_a_rerun_resumes(
    tmp_path, monkeypatch, restore_sigterm
):
    config = _config(**{"rl_loop.steps": 2})
    real = rl.run_rl
    calls = []

    def run_rl(cfg, run_dir, *args, arm_name, **kwargs):
        calls.append(os.path.relpath(run_dir, tmp_path))
        preempt = run_dir.endswith(os.path.join("tune", "tg_lr1"))
        return (_sigterm_then(real) if preempt else real)(cfg, run_dir, *args, arm_name=arm_name,
                                                           **kwargs)  # fmt: skip

    monkeypatch.setattr(rl, "run_rl", run_rl)
    with pytest.raises(checkpointing.Preempted, match="tuning trial tg lr 0.003") as info:
        pipeline.run_pipeline(config, str(tmp_path))
    assert info.value.code == 143
    assert calls == ["tune/grpo_lr0", "tune/grpo_lr1", "tune/tg_lr0", "tune/tg_lr1"]
    tune = tmp_path / "tune"
    assert not (tune / "tuning.json").exists() and not (tmp_path / "runs").exists()
    assert not (tune / "tg_lr1" / tuning.VALIDATION_FILE).exists()
    with checkpointing.TrainingCheckpointer(
        str(tune / "tg_lr1" / "checkpoints"), read_only=True
    ) as c:
        assert c.latest_step() == 1
    stamps = {p: os.path.getmtime(tune / p / tuning.VALIDATION_FILE)
              for p in ("grpo_lr0", "grpo_lr1", "tg_lr0")}  # fmt: skip

    monkeypatch.undo()
    checkpointing.clear_preemption_request()  # a fresh process starts without the flag
    res = pipeline.run_pipeline(config, str(tmp_path))
    assert {p: os.path.getmtime(tune / p / tuning.VALIDATION_FILE) for p in stamps} == stamps
    with open(tune / "tg_lr1" / "rl_summary.json") as f:
        sessions = json.load(f)["sessions"]
    assert [(s["start_step"], s["end_step"]) for s in sessions] == [(0, 1), (1, 2)]
    assert set(res["context"]["tuning"]["arms"]) == {"grpo", "tg"}


def _main(*args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "tg_jax.main", "--config=configs/tiny.py", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def _flag(key, value):
    return f"--config.{key}={value}"


@pytest.mark.e2e
def test_users_command_with_learning_rate_trials(tmp_path):
    work = tmp_path / "w"
    # The tool-call threads too (tests/test_rollout.py checks they change no outcome).
    args = [_flag(k, v) for k, v in FAST.items()]
    args += [_flag("rl_loop.env_workers", 3), _flag("eval.env_workers", 3)]
    result = _main(f"--workdir={work}", "--config.stage=pipeline", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tune: grpo keeps lr" in result.stdout and "tune: tg keeps lr" in result.stdout
    assert "learning-rate trials" in result.stdout  # the headline's compute time
    with open(work / "tune" / "tuning.json") as f:
        tuned = json.load(f)
    assert tuned["lrs"] == [1e-3, 3e-3] and set(tuned["arms"]) == {"grpo", "tg"}
    assert "## Equal tuning budget" in (work / "report" / "report.md").read_text()


@pytest.mark.e2e
def test_a_bad_tuning_section_is_one_line_and_exit_2(tmp_path):
    result = _main(
        f"--workdir={tmp_path / 'w'}", "--config.stage=pipeline",
        "--config.pipeline.tune.lrs=(1e-3,)", "--config.pipeline.tune.val_tasks=100",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: invalid config: pipeline.tune.val_tasks")
    assert not os.path.exists(tmp_path / "w" / "tfds")
