"""The main job in miniature: data -> SFT -> GRPO and TG arms -> held-out eval -> report."""

import json
import os

import pytest

from tg_jax import config_lib
from tg_jax.train import pipeline, sft_eval

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "configs")


def _config():
    config = config_lib.load_config_file(os.path.join(CONFIG_DIR, "tiny.py"))
    return config_lib.apply_overrides(
        config,
        {
            "sft.steps": 2,
            "sft.eval.num_tasks": 2,
            "sft.eval.temperatures": (1.0,),
            "rl_loop.steps": 1,
            "rl_loop.eval_every": 0,
            "rl_loop.async_sampling": False,
            "eval.num_tasks": 2,
            "eval.last_k": 1,
            "eval.n_boot": 50,
        },
    )


def test_arms_differ_only_in_their_overrides():
    config = _config()
    grpo, tg = pipeline.arm_config(config, "grpo"), pipeline.arm_config(config, "tg")
    assert not grpo.tg.enabled and tg.tg.enabled
    grpo_d, tg_d = grpo.to_dict(), tg.to_dict()
    grpo_d["tg"].pop("enabled"), tg_d["tg"].pop("enabled")
    assert grpo_d == tg_d


def test_every_arm_applies_to_the_default_and_experiment_configs():
    for name in ("default.py", "experiment.py"):
        config = config_lib.load_config_file(os.path.join(CONFIG_DIR, name))
        for arm, spec in pipeline.ARMS.items():
            cfg = pipeline.arm_config(config, arm)
            for key, value in spec.overrides.items():
                if key.startswith("rl.reward_weights.") and key.split(".")[-1] not in (
                    config.rl.reward_weights
                ):
                    continue  # a requirement this config does not reward: left out
                node = cfg
                for part in key.split("."):
                    node = node[part]
                assert node == value, (name, arm, key)
    experiment = config_lib.load_config_file(os.path.join(CONFIG_DIR, "experiment.py"))
    assert set(experiment.pipeline.arms) == set(pipeline.ARMS)
    assert len(experiment.eval.train_seeds) >= 3


def test_bad_arm_fails_before_any_work(tmp_path):
    config = config_lib.apply_overrides(_config(), {"pipeline.arms": ("grpo", "tgg")})
    with pytest.raises(ValueError, match="unknown arm 'tgg'"):
        pipeline.run_pipeline(config, str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_pipeline_runs_every_stage_and_caches(tmp_path):
    config = _config()
    workdir = str(tmp_path)
    res = pipeline.run_pipeline(config, workdir)
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
        assert f"**{ct['total_s'] / 60:.1f} min** (held-out evaluation: 2 of 2 runs" in f.read()
    with open(os.path.join(workdir, sft_eval.EVAL_FILE)) as f:
        base = json.load(f)
    assert {"pass_rate", "unprompted_compliance/fence", "hinted_compliance/fence"} <= set(base)

    # A second run finds every stage done: nothing is retrained or re-evaluated.
    stamps = {
        p: os.path.getmtime(os.path.join(workdir, p))
        for p in ("sft_eval.json", "runs/grpo_seed0/heldout.jsonl", "runs/tg_seed0/heldout.jsonl")
    }
    again = pipeline.run_pipeline(config, workdir)
    for p, t in stamps.items():
        assert os.path.getmtime(os.path.join(workdir, p)) == t, p
    assert again["arms"]["tg"]["heldout"] == res["arms"]["tg"]["heldout"]
