"""SFT of the base model: loss mask, packing, batches, loss, and a tiny run with resume."""

import json
import os
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tg_jax import config_files
from tg_jax.envs.coding import CodingEnvConfig
from tg_jax.envs.tasks import generate_tasks
from tg_jax.envs.transcripts import TranscriptConfig, make_transcript
from tg_jax.metrics import read_metrics
from tg_jax.sampling.episode import EpisodeRecord, episode_compliance
from tg_jax.sampling.trajectory import Trajectory
from tg_jax.text import ByteTokenizer, ChatRenderer, Role
from tg_jax.train import sft, sft_data, sft_eval

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "configs")
TOK = ByteTokenizer()
RENDERER = ChatRenderer(TOK)


def _hinted_multi_turn_transcript():
    """A hinted transcript of >= 2 assistant turns with a tool observation between them."""
    env_cfg = CodingEnvConfig(requirements=("fence", "tool_json"), executor="trusted")
    knobs = TranscriptConfig(p_hinted=1.0, p_multi_turn=1.0, p_think=1.0, max_chars=2000)
    from tg_jax.envs.coding import CodingEnv

    env = CodingEnv(env_cfg)
    rng = random.Random(0)
    for task in generate_tasks("train", 20, seed=3):
        tr = make_transcript(task, rng, knobs, env)
        if tr.hinted and sum(m["role"] == "assistant" for m in tr.messages) >= 2:
            return tr
    raise AssertionError("no hinted multi-turn transcript drawn")


def test_hints_render_as_hint_role_and_mask_covers_exactly_assistant_tokens():
    tr = _hinted_multi_turn_transcript()
    messages = sft_data.transcript_messages(tr)
    assert messages[0]["role"] == "user"
    assert sum(m["role"] == "hint" for m in messages) >= 1
    assert all(m["role"] != "user" for m in messages[1:])
    ids, roles = sft_data.render_example(RENDERER, messages)
    hint_text = TOK.decode(ids[roles == Role.HINT])
    assert "Reminder:" in hint_text and hint_text.count("<|im_start|>user") >= 1

    rows = sft_data.pack_examples([(ids, roles)], seq_len=len(ids) + 7, pad_id=TOK.pad_id)
    mask = rows.loss_mask[0].astype(bool)
    # The masked targets, decoded, are exactly the assistant messages (thinking + answer +
    # <|im_end|>) in order: no prompt, hint, tool or template token is learned.
    expected = ""
    for m in messages:
        if m["role"] == "assistant":
            expected += m["content"] + "<|im_end|>"
    assert TOK.decode(rows.targets[0][mask]) == expected
    # And every assistant token is learned (the first token is never a target).
    assert mask.sum() == np.isin(roles[1:], sft_data.LOSS_ROLES).sum()
    n = len(ids)
    np.testing.assert_array_equal(rows.inputs[0, :n], ids)
    np.testing.assert_array_equal(rows.targets[0, : n - 1], ids[1:])
    assert not mask[n - 1 :].any() and (rows.inputs[0, n:] == TOK.pad_id).all()


def test_packing_keeps_sequences_apart():
    rng = np.random.default_rng(0)
    examples = []
    for n in (5, 9, 3, 12, 7, 4, 10):
        ids = rng.integers(0, 256, n).astype(np.int32)
        roles = np.where(np.arange(n) % 3 == 0, int(Role.PROMPT), int(Role.ANSWER)).astype(np.int8)
        examples.append((ids, roles))
    rows = sft_data.pack_examples(examples, seq_len=16, pad_id=TOK.pad_id, seed=1)
    assert rows.inputs.shape[1] == 16 and rows.num_rows <= 4  # 50 tokens in 4 rows of 16
    seen = []
    for r in range(rows.num_rows):
        seg = rows.segment_ids[r]
        for s in range(1, seg.max() + 1):
            where = np.flatnonzero(seg == s)
            assert (np.diff(where) == 1).all()  # contiguous
            np.testing.assert_array_equal(rows.positions[r, where], np.arange(len(where)))
            # The last token of a sequence predicts nothing (no target from the next one).
            assert rows.loss_mask[r, where[-1]] == 0 and rows.targets[r, where[-1]] == TOK.pad_id
            seen.append(tuple(rows.inputs[r, where]))
        assert (rows.loss_mask[r][seg == 0] == 0).all()
    assert sorted(seen) == sorted(tuple(ids) for ids, _ in examples)
    with pytest.raises(ValueError, match="seq_len"):
        sft_data.pack_examples(examples, seq_len=8, pad_id=TOK.pad_id)


def test_batch_indices_are_a_pure_function_of_step():
    a = [sft_data.batch_indices(10, 3, s, seed=5) for s in range(6)]
    b = [sft_data.batch_indices(10, 3, s, seed=5) for s in range(6)]
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    epoch0 = np.concatenate(a[:3])
    assert len(set(epoch0.tolist())) == 9  # an epoch draws distinct rows
    assert not all(np.array_equal(x, y) for x, y in zip(a[:3], a[3:], strict=True))


def test_sft_loss_by_hand():
    logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [1 / 3, 1 / 3, 1 / 3]]]))
    targets = jnp.array([[0, 1, 2]])
    mask = jnp.array([[1.0, 1.0, 0.0]])
    loss, aux = sft.sft_loss(logits, targets, mask)
    np.testing.assert_allclose(loss, -(np.log(0.5) + np.log(0.8)) / 2, rtol=1e-6)
    np.testing.assert_allclose(aux["accuracy"], 1.0)
    np.testing.assert_allclose(aux["num_tokens"], 2.0)


def _episode(task_success, fence_verdicts, actions):
    n = len(fence_verdicts)
    record = EpisodeRecord(
        task_id="t", condition="plain", sample=0, task_success=task_success,
        compliance=episode_compliance({"fence": fence_verdicts}), actions=actions, turns=n,
    )  # fmt: skip
    traj = Trajectory(
        tokens=np.zeros(1, np.int32), roles=np.zeros(1, np.int8), turn_ids=np.zeros(1, np.int32),
        turn_starts=np.zeros(n, np.int32), behaviour_logprobs=np.zeros(1, np.float32),
        turn_verdicts=[{"fence": v} for v in fence_verdicts], rewards={}, hint_tokens={},
        group_id=0, policy_version=-1, task_id="t",
    )  # fmt: skip
    return record, traj


def test_summarize_compliance():
    eps = [
        _episode(True, [True, None], {"submit": 1, "malformed": 0}),
        _episode(False, [False, True], {"submit": 1, "malformed": 1}),
        _episode(False, [None], {"submit": 0, "malformed": 0}),
    ]
    out = sft_eval.summarize([r for r, _ in eps], [t for _, t in eps], ("fence",))
    assert out["pass_rate"] == pytest.approx(1 / 3)
    assert out["compliance/fence"] == pytest.approx(2 / 3)  # 2 of 3 judged turns
    assert out["episode_compliance/fence"] == pytest.approx(1 / 2)  # 1 of 2 judged episodes
    assert out["submitted"] == pytest.approx(2 / 3)
    assert out["malformed_per_episode"] == pytest.approx(1 / 3)


def _tiny_config():
    return config_files.load_config_file(os.path.join(CONFIG_DIR, "tiny.py"))


@pytest.mark.slow
def test_tiny_sft_reduces_loss_and_resume_matches_uninterrupted(tmp_path):
    config = _tiny_config()
    steps = int(config.sft.steps)
    full = sft.run_sft(config, str(tmp_path / "full"))
    assert int(full.step) == steps
    losses = [r["loss"] for r in read_metrics(tmp_path / "full", stage="sft")]
    assert len(losses) == steps
    assert losses[-1] < losses[0] - 0.2

    # Interrupted after 3 steps (checkpointed), then resumed to the end.
    part = str(tmp_path / "part")
    stopped = sft.run_sft(config, part, stop_after=3)
    assert int(stopped.step) == 3 and not sft.sft_finished(config, part)
    resumed = sft.run_sft(config, part)
    assert int(resumed.step) == steps and sft.sft_finished(config, part)
    for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # A finished SFT is not redone, and its params load for the RL stage.
    again = sft.run_sft(config, part)
    assert int(again.step) == steps
    model = sft.build_model(config)
    from tg_jax import sharding

    mesh, rules = sharding.make_mesh(config.mesh), sharding.logical_rules(config.mesh)
    loaded = sft.load_sft_state(config, part, model, mesh, rules)
    for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(loaded.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_hint_requirements_set_the_hints_of_the_sft_transcripts():
    config = config_files.load_config_file(os.path.join(CONFIG_DIR, "tiny.py"))
    config = config_files.apply_overrides(
        config,
        {
            "env.requirements": ("tool_json",),
            "sft.hint_requirements": ("fence", "tool_json"),
            "sft.transcripts.p_hinted": 1.0,
            "sft.transcripts.p_hint_requirement": 1.0,
            "sft.transcripts.max_chars": 600,
            "sft.seq_len": 512,
            "model.max_seq_len": 512,
        },
    )
    env_cfg = sft_data.transcript_env_config(config)
    assert env_cfg.requirements == ("fence", "tool_json") and env_cfg.executor == "trusted"
    rows, stats = sft_data.make_sft_rows(config, RENDERER)
    text = TOK.decode(rows.inputs[rows.segment_ids > 0])
    assert "```python" in text and '<tool_call>{"name"' in text  # both hints followed
    assert stats["frac_hinted"] == 1.0
    # Empty = the env's requirements.
    plain = config_files.apply_overrides(config, {"sft.hint_requirements": ()})
    assert sft_data.transcript_env_config(plain).requirements == ("tool_json",)
    bad = config_files.apply_overrides(config, {"sft.hint_requirements": ("fence", "bogus")})
    with pytest.raises(ValueError, match="requirements must be names from"):
        sft_data.transcript_env_config(bad)


def test_read_sft_wall_s(tmp_path):
    workdir = str(tmp_path)
    assert sft.read_sft_wall_s(workdir) is None  # no SFT summary yet
    os.makedirs(os.path.join(workdir, sft.SFT_DIR))
    path = os.path.join(workdir, sft.SFT_DIR, sft.SUMMARY_FILE)
    with open(path, "w") as f:
        json.dump({"sessions": [], "wall_s": 12.5}, f)
    assert sft.read_sft_wall_s(workdir) == 12.5
    with open(path, "w") as f:
        f.write("{torn")
    with pytest.raises(ValueError, match="not a valid SFT summary"):
        sft.read_sft_wall_s(workdir)
