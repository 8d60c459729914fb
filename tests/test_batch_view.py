"""Scripted rollouts, the batch inspection helpers and their HTML rendering (tiny model)."""

import jax
import numpy as np
import pytest

from tg_jax import config_files
from tg_jax.envs.coding import CodingEnv, CodingEnvConfig
from tg_jax.envs.hints import CORRECT_HINTS
from tg_jax.envs.tasks import generate_tasks
from tg_jax.models import forward
from tg_jax.notebook import batch_view, html_render
from tg_jax.notebook.base_policy import load_base_policy
from tg_jax.rl.batch import build_batch
from tg_jax.rl.tg.divergence import token_divergence
from tg_jax.sampling.scripted import scripted_rollout
from tg_jax.text import ByteTokenizer, ChatRenderer, Role

RENDERER = ChatRenderer(ByteTokenizer())
TASK = generate_tasks("heldout", 1, seed=0)[0]
ENV_CFG = CodingEnvConfig(requirements=("fence", "tool_json"), max_turns=3, executor="trusted")
TURNS = (
    '<think>guess</think>\ndef f(x): return x\n<tool_call>{"name": "run_tests"}</tool_call>',
    "```python\ndef f(x): return x\n```\nCALL submit",
)


@pytest.fixture(scope="module")
def traj():
    return scripted_rollout(RENDERER, lambda: CodingEnv(ENV_CFG), TASK, TURNS, group_id=3)


@pytest.fixture(scope="module")
def policy():
    config = config_files.load_config_file("configs/tiny.py")
    return load_base_policy(config, None, seed=0)


def test_scripted_rollout(traj):
    assert traj.num_turns == 2 and traj.group_id == 3
    assert traj.turn_verdicts == [
        {"fence": False, "tool_json": True},
        {"fence": True, "tool_json": False},
    ]
    assert batch_view.failed_turns(traj) == [0, 1]
    text = RENDERER.tokenizer.decode(traj.tokens)
    assert all(t in text for t in TURNS)
    assert not traj.behaviour_logprobs.any()
    # Each requirement's hint message, and the one message for a turn that breaks both.
    assert set(traj.hint_tokens) == {"fence", "tool_json", "fence+tool_json"}
    both = RENDERER.tokenizer.decode(traj.hint_tokens["fence+tool_json"])
    assert both.index(CORRECT_HINTS["fence"]) < both.index(CORRECT_HINTS["tool_json"])
    # The think block is THINK, the rest of the turn ANSWER.
    think = traj.tokens[traj.roles == Role.THINK]
    assert RENDERER.tokenizer.decode(think) == "<think>guess</think>"


def test_scripted_rollout_refuses_a_short_script():
    with pytest.raises(ValueError, match="no more"):
        scripted_rollout(RENDERER, lambda: CodingEnv(ENV_CFG), TASK, TURNS[:1])


def test_failed_turns_ignores_not_applicable(traj):
    import dataclasses

    t = dataclasses.replace(traj, turn_verdicts=[{"fence": None, "tool_json": True}] * 2)
    assert batch_view.failed_turns(t) == []


def test_to_tokens():
    np.testing.assert_array_equal(batch_view.to_tokens(np.array([1, 2, 3])), [0, 1, 2])
    x = batch_view.to_tokens(np.array([[1.0, 2.0]]), np.nan)
    assert np.isnan(x[0, 0]) and x[0, 1] == 1.0


@pytest.mark.slow
def test_teacher_roles_and_logits(traj, policy):
    batch = build_batch([traj], max_len=512, teacher_max_len=512, pad_to_multiple=16)
    n, n_t = len(traj.tokens), int(batch.teacher_segment_ids_BtxTt[0].sum())
    roles = batch_view.teacher_roles(batch, 0, traj.roles)
    # Hints are exactly the inserted tokens; the rest is the student sequence in order.
    assert (roles[:n_t] == Role.HINT).sum() == n_t - n
    kept = batch.teacher_tokens_BtxTt[0, :n_t][roles[:n_t] != Role.HINT]
    np.testing.assert_array_equal(kept, traj.tokens)
    hint = np.concatenate([traj.hint_tokens["fence"]])
    first_hint = np.flatnonzero(roles == Role.HINT)[: len(hint)]
    np.testing.assert_array_equal(batch.teacher_tokens_BtxTt[0, first_hint], hint)

    student, teacher = batch_view.next_token_logits(policy.model, policy.params, batch)
    direct_s = np.asarray(forward(policy.model, policy.params, batch.tokens_BxT,
                                  batch.positions_BxT, batch.segment_ids_BxT))  # fmt: skip
    direct_t = np.asarray(forward(policy.model, policy.params, batch.teacher_tokens_BtxTt,
                                  batch.teacher_positions_BtxTt,
                                  batch.teacher_segment_ids_BtxTt))  # fmt: skip
    np.testing.assert_allclose(student, direct_s, atol=1e-5)
    pos = batch_view.turn_positions(batch, 0, 0)
    pos = pos[batch.tg_mask_BxT[0, pos]]  # M: the turn's answer (thinking only if configured)
    assert len(pos)
    np.testing.assert_allclose(teacher[0, pos], direct_t[0, batch.teacher_pos_BxT[0, pos]],
                               atol=1e-5)  # fmt: skip

    d = batch_view.divergences(student, teacher, targets_BxT=batch.targets_BxT)
    assert set(d) == {f"{k}{s}" for k in batch_view.KINDS for s in ("", "/sampled")}
    rev = token_divergence(student, teacher, kind="reverse")
    np.testing.assert_allclose(d["reverse"], rev, atol=1e-6)
    assert (d["reverse"][0, pos] >= -1e-6).all() and (d["jsd"] <= np.log(2) + 1e-6).all()


def test_top_tokens():
    tok = ByteTokenizer()
    s = np.full(272, -10.0)
    t = np.full(272, -10.0)
    s[ord("a")], s[ord("b")] = 8.0, 4.0
    t[ord("`")], t[ord("a")] = 5.0, 3.0
    rows = batch_view.top_tokens(tok, s, t, k=2, target=ord("a"))
    assert [r["id"] for r in rows][:2] == [ord("a"), ord("`")]
    assert {r["id"] for r in rows} == {ord("a"), ord("b"), ord("`")}
    p = np.exp(s - jax.nn.logsumexp(s))
    assert rows[0]["p_plain"] == pytest.approx(p[ord("a")])
    assert rows[0]["rank_plain"] == 1 and rows[0]["rank_hinted"] == 2 and rows[0]["produced"]
    assert rows[0]["token"] == "'a'"


def test_tokens_html(traj):
    tok = RENDERER.tokenizer
    n = len(traj.tokens)
    mask = np.zeros(n, bool)
    mask[5:8] = True
    h = html_render.tokens_html(tok, traj.tokens, roles=traj.roles, mask=mask, title="x<y")
    assert h.count("<span") == n
    assert h.count(html_render.MASK_STYLE) == 3
    assert "x&lt;y" in h and "&lt;|im_start|&gt;" in h
    values = np.where(mask, 1.0, np.nan)
    h = html_render.tokens_html(tok, traj.tokens, values=values, value_name="D")
    assert h.count("rgb(255,64,64)") == 3  # the max value is fully red
    with pytest.raises(ValueError, match="roles"):
        html_render.tokens_html(tok, traj.tokens, roles=traj.roles[:-1])
    t = html_render.table_html([{"a": 0.12345, "b": "<x>"}], formats={"a": ".2f"})
    assert "<td>0.12</td>" in t and "&lt;x&gt;" in t
    assert "in mask" in html_render.legend_html(mask=True)
