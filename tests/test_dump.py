"""`rl_loop.dump_rollouts` (each RL step's batch in <run>/rollouts/step_<N>.array_record) and its
replay (`python -m tg_jax.replay`); `rl_loop.profile_steps`."""

import glob
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests import rl_loop_driver as driver
from tg_jax import config_files, replay, tracing
from tg_jax.models import ModelConfig, hf_dir
from tg_jax.notebook import dump_view
from tg_jax.rl.batch import build_batch
from tg_jax.sampling.trajectory import Trajectory
from tg_jax.text import ByteTokenizer
from tg_jax.text.chat import Role
from tg_jax.train import rl, rollout_dump

REPO = os.path.join(os.path.dirname(__file__), "..")
CONFIG = os.path.join(REPO, "configs", "tiny.py")


def _traj(task_reward: float, fence: bool, group: int) -> Trajectory:
    # prompt 3 tokens, assistant turn 0 of 4 tokens (log-prob -0.25 each)
    roles = [Role.PROMPT] * 3 + [Role.ANSWER] * 4
    return Trajectory(
        tokens=np.arange(10, 17), roles=np.asarray(roles, np.int8),
        turn_ids=np.asarray([-1] * 3 + [0] * 4), turn_starts=np.asarray([2]),
        behaviour_logprobs=np.asarray([0.0] * 3 + [-0.25] * 4, np.float32),
        turn_verdicts=[{"fence": fence}], rewards={"task": task_reward, "fence": float(fence)},
        hint_tokens={"fence": [7, 8]}, group_id=group, policy_version=3, task_id=f"t{group}",
    )  # fmt: skip


def test_dump_of_a_step_reads_back(tmp_path):
    config = config_files.apply_overrides(
        config_files.load_config_file(CONFIG), {"rl_loop.dump_rollouts": True}
    )
    trajs = [_traj(1.0, True, 5), _traj(0.0, False, 5)]
    batch = build_batch(trajs, max_len=16, teacher_max_len=16, mode="per_turn",
                        requirement_names=("fence",),
                        pad_to_multiple=8, batch_multiple=4, max_teacher_rows=4)  # fmt: skip
    assert batch.valid_B.tolist() == [True, True, False, False]  # two padding rows
    dropped = {"group_id": 9, "task_ids": ["t9"], "why": "engine_error: non-finite logits"}
    trajs[0].info["dropped_groups"] = [dropped]  # as drop_engine_errors leaves it
    rollout_dump.dump_step(config, str(tmp_path), 7, trajs, batch)
    recs = rollout_dump.read_dump(rollout_dump.dump_path(str(tmp_path), 7))
    assert [r["row"] for r in recs] == [0, 1]  # the padding rows are not written
    with open(tmp_path / rollout_dump.DUMP_DIR / "step_7.dropped.json") as f:
        assert json.load(f) == [dropped]
    assert (recs[0]["sampler_process"], recs[0]["request_ids"]) == (0, [])  # none recorded
    a, b = recs
    assert (a["step"], a["task_id"], a["group_id"], a["policy_version"]) == (7, "t5", 5, 3)
    np.testing.assert_array_equal(a["tokens_T"], np.arange(10, 17))
    # Targets: position t predicts token t + 1, so the turn's 4 tokens are at positions 2..5.
    np.testing.assert_array_equal(a["loss_mask_T"], [0, 0, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(a["behaviour_logprobs_T"], [0, 0, -0.25, -0.25, -0.25, -0.25, 0])
    np.testing.assert_array_equal(a["verdicts_KxR"], [[1]])
    np.testing.assert_array_equal(b["verdicts_KxR"], [[0]])
    # The failed turn of b is targeted: the TG mask covers it and its hint is "fence".
    assert a["tg_mask_T"].sum() == 0 and b["tg_mask_T"].sum() == 4
    np.testing.assert_array_equal(b["requirement_ids_T"], [-1, -1, 0, 0, 0, 0, -1])
    np.testing.assert_array_equal(b["hints"]["fence"], [7, 8])
    # tiny rewards the task alone: rewards 1 and 0 in one group, GRPO (mean 0.5, std 0.5).
    assert (a["reward"], b["reward"]) == (1.0, 0.0)
    assert b["rewards"] == {"task": 0.0, "fence": 0.0}
    adv = 0.5 / (0.5 + float(config.rl.adv_eps))
    np.testing.assert_allclose(a["advantages_T"], np.asarray([0, 0, 1, 1, 1, 1, 0]) * adv)
    np.testing.assert_allclose(b["advantages_T"], np.asarray([0, 0, 1, 1, 1, 1, 0]) * -adv)
    # Off (the default): nothing is written.
    off = config_files.load_config_file(CONFIG)
    rollout_dump.dump_step(off, str(tmp_path / "off"), 7, trajs, batch)
    assert not os.path.exists(tmp_path / "off")


# The figures a replay must give as the trainer logged them (fp32: relative 1e-5, absolute
# 1e-6); `lr` counts optimizer updates, which a params directory does not carry.
REPLAYED = ("loss", "pg_loss", "tg_loss", "tg_kl", "entropy", "logprob_mismatch_mean",
            "logprob_mismatch_max", "reward", "advantage_abs_mean", "lambda_tg",
            "tg_num_distilled", "num_tokens")  # fmt: skip


def _same_figures(out, names):
    for k in names:
        np.testing.assert_allclose(out["metrics"][k], out["logged"][k], rtol=1e-5, atol=1e-6,
                                   err_msg=k)  # fmt: skip


@pytest.mark.slow
def test_a_run_dumps_every_step_and_each_step_replays(tmp_path):
    overrides = {"rl_loop.dump_rollouts": True, "rl_loop.eval_every": 0,
                 "rl_loop.profile_steps": (2, 2)}  # fmt: skip
    config = config_files.apply_overrides(driver.make_config(steps=2), overrides)
    params = driver.initial_params(config)
    traced = tracing.trace_count("rl_train_step")
    rl.run_rl(config, str(tmp_path), params, arm_name="tg", seed=0,
              sources=driver.make_sources())  # fmt: skip
    # The step was traced (and compiled) once per batch shape the steps had, no more.
    shapes = {tuple(np.shape(x) for x in jax.tree.leaves(rollout_dump.read_batch(
        rollout_dump.dump_path(str(tmp_path), step)))) for step in (1, 2)}  # fmt: skip
    assert tracing.trace_count("rl_train_step") - traced == len(shapes)
    rows = int(config.rl_loop.groups_per_step) * int(config.rl_loop.rollouts_per_group)
    for step in (1, 2):
        recs = rollout_dump.read_dump(rollout_dump.dump_path(str(tmp_path), step))
        assert len(recs) == rows and {r["step"] for r in recs} == {step}
        for r in recs:  # the sampled tokens carry their log-probs, and only they
            sampled = r["behaviour_logprobs_T"] != 0
            assert sampled.any() and not (sampled & (r["loss_mask_T"] == 0)).any()
            # Lineage: the sampling process and one engine request per turn.
            assert r["sampler_process"] == 0 and len(r["request_ids"]) == len(r["verdicts_KxR"])
            assert r["policy_version"] == step - 1  # synchronous sampling: the last update
    # rl_loop.profile_steps: step 2's trace, the train step's program and the step's marker in
    # it (the plugin's layout: <run>/profile/plugins/profile/<time>/<host>.xplane.pb).
    (trace,) = glob.glob(str(tmp_path / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    with open(trace, "rb") as f:
        data = f.read()
    assert b"rl_train_step" in data and b"rl_step" in data
    # Step 2 replayed under the run's checkpoints (the state saved after step 1): the trainer's
    # own step, update figures included.
    dump2 = rollout_dump.dump_path(str(tmp_path), 2)
    out = replay.replay(dump2, str(tmp_path / "checkpoints"))
    assert out["state"] == "training state of step 1" and out["logged"]["tg_num_distilled"] > 0
    _same_figures(out, (*REPLAYED, "grad_norm", "lr"))
    # Step 1 under a params directory of the starting policy (as W/base_model is).
    base = str(tmp_path / "base_model")
    hf_dir.export_model_dir(base, params, ModelConfig.from_config(config.model))
    out = replay.replay(rollout_dump.dump_path(str(tmp_path), 1), base)
    _same_figures(out, REPLAYED)
    tok = np.load(out["npz"])
    sampled = tok["loss_mask_BxT"] & tok["valid_B"][:, None]
    gap = np.abs(tok["logprob_BxT"] - tok["behaviour_logprobs_BxT"])[sampled]
    # Per token: the replayed log-probs are the trainer's (its logged mismatch to the sampler).
    np.testing.assert_allclose(gap.mean(), out["logged"]["logprob_mismatch_mean"], atol=1e-6)
    assert (tok["divergence_BxT"][tok["tg_mask_BxT"]] > 0).all()
    with open(out["json"]) as f:
        assert json.load(f)["metrics"] == out["metrics"]
    # The notebooks' view of the dump: a failed row's turns and its tokens by replayed D_t.
    step = dump_view.load_step(rollout_dump.dump_path(str(tmp_path), 1))
    row = dump_view.failed_rows(step)[0]
    html = dump_view.row_html(ByteTokenizer(), step, row)
    assert "BROKEN" in html and html.count("D_t (replay)") == step.records[row]["tg_mask_T"].sum()
    # The command: step 2 again; a checkpoints directory without the step before is refused.
    cmd = [sys.executable, "-m", "tg_jax.replay", f"--dump={dump2}"]
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run([*cmd, f"--checkpoint={tmp_path / 'checkpoints'}"], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.split()[:1] == ["loss"]]
    assert "logged" in line and "|diff|" in line
    with open(
        rollout_dump.dump_path(str(tmp_path), 2).replace(".array_record", ".replay.json")
    ) as f:
        written = json.load(f)  # by the command, on one CPU device (the run had 8)
    _same_figures(written, REPLAYED)
    bad = subprocess.run([*cmd[:-1], f"--dump={rollout_dump.dump_path(str(tmp_path), 1)}",
                          f"--checkpoint={tmp_path / 'checkpoints'}"], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert bad.returncode == 2 and "no checkpoint of step 0" in bad.stderr, bad.stderr[-2000:]


@pytest.mark.parametrize("steps", [(3, 2), (0, 1), (1,), (1, 2, 3)])
def test_profile_steps_other_than_first_and_last_are_refused(steps):
    from tg_jax.train.loop_settings import LoopConfig

    with pytest.raises(ValueError, match=r"rl_loop.profile_steps must be \(\) or \(first, last\)"):
        LoopConfig(profile_steps=steps)
    assert LoopConfig(profile_steps=(2, 2)).profile_steps == (2, 2)


def test_a_dump_the_replay_cannot_use_is_one_usage_error_before_any_work(tmp_path):
    from tg_jax.errors import UsageError

    with pytest.raises(UsageError, match=r"--dump .*notes.txt: not a step's dump file"):
        replay.replay(str(tmp_path / "notes.txt"), str(tmp_path))
    # A step's records without the batch and config the replay reads (an older dump).
    dump = rollout_dump.dump_path(str(tmp_path), 3)
    rollout_dump.write_records(dump, [])
    with pytest.raises(UsageError, match=r"cannot read the step's batch or the run's config"):
        replay.replay(dump, str(tmp_path))
