"""Train step: teacher gets no gradient, TG value vs a direct KL, exact zeros, teacher modes,
sharded == single device, micro-batches == big batch, NaN guard, no recompiles."""

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tg_jax import config_files, config_lib, sharding
from tg_jax.models import ModelConfig, Transformer, forward, hidden_states, init_params
from tg_jax.rl import train_state as tst
from tg_jax.rl import train_step as ts
from tg_jax.rl.batch import Batch, build_batch
from tg_jax.rl.step_config import StepConfig
from tg_jax.testing import synthetic_trajectories

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

MODEL = config_lib.tiny_model_config()


def _config(**overrides) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = MODEL
    c.mesh = config_lib.mesh_config((1, 1, 1, 1))
    c.rl = config_lib.rl_config(reward_weights={"task": 1.0, "fence": 0.5})
    c.tg = config_lib.tg_config(chunk_size=16, max_teacher_rows=16)
    c.tg.lambda_tg = 0.5
    c.optim = config_lib.optim_config(lr=1e-3, eps=1e-6)
    return config_files.apply_overrides(c, overrides)


@functools.cache
def _model_and_params():
    model = Transformer(ModelConfig.from_config(MODEL))
    return model, init_params(model, jax.random.key(0))


@functools.cache
def _forward():
    model, _ = _model_and_params()
    return jax.jit(functools.partial(forward, model))


def _trajectories(num=8, seed=0, **kw):
    kw = {"hint_len": 5, "fail_prob": 0.5, **kw}
    return synthetic_trajectories(np.random.default_rng(seed), num, 40, **kw)


def _batch(trajs, mode="per_trajectory", micro_batches=1, on_policy_noise=0.1, **kw) -> Batch:
    """A batch whose behaviour log-probs are the model's own plus noise (ratios near 1)."""
    batch = build_batch(
        trajs, max_len=64, teacher_max_len=64, mode=mode, max_teacher_rows=16,
        requirement_names=("fence",), pad_to_multiple=16, micro_batches=micro_batches, **kw,
    )  # fmt: skip
    model, params = _model_and_params()
    logits = _forward()(params, batch.tokens_BxT, batch.positions_BxT, batch.segment_ids_BxT)
    logp = jax.nn.log_softmax(logits, -1)
    logp = np.take_along_axis(np.asarray(logp), batch.targets_BxT[..., None], -1)[..., 0]
    noise = np.random.default_rng(1).normal(0, on_policy_noise, logp.shape).astype(np.float32)
    behaviour = np.where(batch.loss_mask_BxT, logp + noise, 0.0).astype(np.float32)
    return dataclasses.replace(batch, behaviour_logprobs_BxT=behaviour)


@functools.cache
def _loss_and_grad_fn(typed: StepConfig):
    """One jitted (loss, grads) per step config, shared by the module's tests (a program is
    traced and compiled once however many tests run it)."""
    model, _ = _model_and_params()
    fn = functools.partial(ts.loss_fn, model=model, rl_cfg=typed.rl, tg_cfg=typed.tg)
    return jax.jit(jax.value_and_grad(fn, has_aux=True))


def _loss_and_grad(cfg, batch, params=None, **kw):
    _, default_params = _model_and_params()
    fn = _loss_and_grad_fn(StepConfig.from_config(cfg))
    (loss, (sums, maxes)), grads = fn(default_params if params is None else params, batch, **kw)
    return loss, sums, grads


def _log_softmax(z):
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _tree_close(a, b, atol, rtol=0.0):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=rtol)


@pytest.mark.slow
def test_teacher_branch_gets_no_gradient_and_tg_matches_direct_kl():
    cfg = _config()
    batch = _batch(_trajectories())
    model, params = _model_and_params()
    loss, sums, grads = _loss_and_grad(cfg, batch)

    # The teacher's hidden states supplied as constants: same loss, same gradient.
    @jax.jit  # one program, not an op-by-op eager forward
    def teacher_at_students(params, batch):
        teacher = hidden_states(
            model, params, batch.teacher_tokens_BtxTt, batch.teacher_positions_BtxTt,
            batch.teacher_segment_ids_BtxTt,
        )  # fmt: skip
        return ts.gather_teacher(teacher, batch)

    gathered = teacher_at_students(params, jax.tree.map(jnp.asarray, batch))
    loss_c, _, grads_c = _loss_and_grad(cfg, batch, teacher_hidden_BxTxD=gathered)
    np.testing.assert_allclose(loss, loss_c, rtol=1e-6)
    _tree_close(grads, grads_c, atol=1e-7, rtol=1e-5)
    # ...and the TG term does contribute to that gradient.
    _, sums_off, grads_off = _loss_and_grad(_config(**{"tg.enabled": False}), batch)
    assert sums["tg_loss"] > 1e-6 and sums_off["tg_loss"] == 0.0
    leaves = zip(jax.tree.leaves(grads), jax.tree.leaves(grads_off), strict=True)
    diff = max(float(jnp.abs(x - y).max()) for x, y in leaves)
    assert diff > 1e-6  # the TG term (lambda 0.5, token_sum) is ~5e-5 here

    # The divergence, recomputed from full logits through the index map, in float64.
    fwd = _forward()
    zs = fwd(params, batch.tokens_BxT, batch.positions_BxT, batch.segment_ids_BxT)
    zt = fwd(params, batch.teacher_tokens_BtxTt, batch.teacher_positions_BtxTt,
             batch.teacher_segment_ids_BtxTt)  # fmt: skip
    zt = np.asarray(zt, np.float64)[batch.teacher_row_BxT, batch.teacher_pos_BxT]
    ls, lt = _log_softmax(zs), _log_softmax(zt)
    kl = (np.exp(lt) * (lt - ls)).sum(-1)  # the shipped recipe: KL(teacher || student)
    mask = batch.tg_mask_BxT & batch.failed_turn_mask_BxT & batch.answer_mask_BxT
    assert mask.sum() > 10
    expected = kl[mask].mean()
    np.testing.assert_allclose(sums["tg_kl"], expected, rtol=1e-4, atol=1e-8)
    np.testing.assert_allclose(sums["tg_kl/fence"], expected, rtol=1e-4, atol=1e-8)
    # token_sum: lambda x the sum over M / (trajectories x tg.norm_length).
    trajectories = (batch.loss_mask_BxT.sum(-1) > 0).sum()
    expected_loss = 0.5 * kl[mask].sum() / (trajectories * cfg.tg.norm_length)
    np.testing.assert_allclose(sums["tg_loss"], expected_loss, rtol=1e-4, atol=1e-8)
    np.testing.assert_allclose(loss, sums["pg_loss"] + sums["tg_loss"], rtol=1e-6)


@pytest.mark.slow
def test_no_failed_turn_or_empty_hint_gives_exactly_zero_tg():
    cfg, cfg_off = _config(), _config(**{"tg.enabled": False})
    trajs = _trajectories()
    no_fail = [dataclasses.replace(t, turn_verdicts=[{"fence": True}] * t.num_turns) for t in trajs]
    empty = [dataclasses.replace(t, hint_tokens={"fence": []}) for t in trajs]
    for variant in (no_fail, empty):
        batch = _batch(variant)
        assert not batch.tg_mask_BxT.any()
        loss, sums, grads = _loss_and_grad(cfg, batch)
        loss_off, _, grads_off = _loss_and_grad(cfg_off, batch)
        assert float(sums["tg_loss"]) == 0.0 and float(sums["tg_kl"]) == 0.0
        assert float(loss) == float(loss_off)
        # Two programs (the TG term compiled in or not): equal to float32 rounding, as the
        # compiler orders their sums (tests/compile_settings.py).
        _tree_close(grads, grads_off, atol=1e-8, rtol=1e-6)


@pytest.mark.slow
def test_per_turn_equals_per_trajectory_with_one_failed_turn():
    cfg = _config()
    trajs = _trajectories()
    one = []
    for i, t in enumerate(trajs):  # turn 0 fails in half the rows, turn 1 in the others
        verdicts = [{"fence": i % 2 == 1}, {"fence": i % 2 == 0}]
        one.append(dataclasses.replace(t, turn_verdicts=verdicts))
    b_traj, b_turn = _batch(one, "per_trajectory"), _batch(one, "per_turn")
    np.testing.assert_array_equal(b_traj.tg_mask_BxT, b_turn.tg_mask_BxT)
    loss_a, sums_a, grads_a = _loss_and_grad(cfg, b_traj)
    loss_b, sums_b, grads_b = _loss_and_grad(_config(**{"tg.teacher_mode": "per_turn"}), b_turn)
    assert sums_a["tg_loss"] > 1e-6
    np.testing.assert_allclose(sums_a["tg_loss"], sums_b["tg_loss"], rtol=1e-5)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6, atol=1e-7)
    _tree_close(grads_a, grads_b, atol=1e-6, rtol=1e-4)


def _with_failures(trajs, which):
    """Verdicts: no turn fails ("none"), turn 0 fails in every third row and turn 1 in every
    fourth ("some"), every turn fails ("all")."""
    out = []
    for i, t in enumerate(trajs):
        if which == "none":
            fail = [False, False]
        elif which == "some":
            fail = [i % 3 == 0, i % 4 == 1]
        else:
            fail = [True, True]
        out.append(dataclasses.replace(t, turn_verdicts=[{"fence": not f} for f in fail]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "which,mode,overrides",
    [
        ("none", "per_trajectory", {}),
        ("some", "per_trajectory", {}),
        ("all", "per_trajectory", {"tg.include_thinking": True}),
        ("some", "per_turn", {"tg.include_thinking": True}),
        ("all", "per_turn", {}),
        ("some", "per_trajectory", {"tg.gate": "all_turns"}),
        ("none", "per_turn", {"tg.gate": "all_turns", "tg.kind": "jsd"}),
    ],
)
def test_compact_teacher_equals_full_rows(which, mode, overrides):
    """Compact rows (first hint on, student prefix keys/values, rows for targeted turns only)
    give the loss, metrics and gradients of full teacher rows. With the all-turns gate every
    turn is targeted, so compaction saves only the prefix before the first turn."""
    cfg = _config(**{"tg.teacher_mode": mode, **overrides})
    gate = cfg.tg.gate
    trajs = _with_failures(_trajectories(), which)
    full = _batch(trajs, mode, gate=gate)
    compact = _batch(trajs, mode, gate=gate, compact=True)
    assert compact.teacher_compact and not full.teacher_compact
    np.testing.assert_array_equal(compact.tg_mask_BxT, full.tg_mask_BxT)
    n_rows = int(compact.teacher_segment_ids_BtxTt.any(-1).sum())
    assert (n_rows == 0) == (which == "none" and gate == "failed_turns")
    loss_a, sums_a, grads_a = _loss_and_grad(cfg, full)
    loss_b, sums_b, grads_b = _loss_and_grad(cfg, compact)
    assert (float(sums_a["tg_loss"]) > 1e-5) == (n_rows > 0)
    # The compact pass runs the decode path's fused matmuls: hidden states agree to float32
    # rounding, so a KL of ~3e-4 (a difference of log-probs) agrees to ~1e-7 absolute.
    for k in sums_a:
        np.testing.assert_allclose(sums_a[k], sums_b[k], rtol=1e-5, atol=1e-7, err_msg=k)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6, atol=1e-7)
    _tree_close(grads_a, grads_b, atol=1e-6, rtol=1e-4)


def _run_steps(cfg, batches, mesh, *, ref=False):
    model, params = _model_and_params()
    rules = sharding.logical_rules(cfg.mesh)
    optimizer = tst.make_optimizer(cfg.optim)
    state = tst.create_train_state(model, optimizer, mesh, rules, jax.random.key(1), params=params)
    step = ts.make_train_step(cfg, model, mesh, rules)
    out = []
    for batch in batches:
        args = (jax.tree.map(lambda p: p * 0.9, params),) if ref else ()
        state, metrics = step(state, batch, *args)
        out.append(jax.device_get(metrics))
    return jax.device_get(state), out, step


def _single_mesh():
    return sharding.make_mesh(config_lib.mesh_config((1, 1, 1, 1)), jax.devices()[:1])


def _assert_same_run(run_a, run_b, atol=1e-5):
    (state_a, metrics_a, _), (state_b, metrics_b, _) = run_a, run_b
    for ma, mb in zip(metrics_a, metrics_b, strict=True):
        assert ma.keys() == mb.keys()
        for k in ma:
            np.testing.assert_allclose(ma[k], mb[k], atol=atol, rtol=1e-5, err_msg=k)
    _tree_close(state_a.params, state_b.params, atol=atol)
    assert int(state_a.step) == int(state_b.step) == len(metrics_a)


STEP_OVERRIDES = {"tg.include_thinking": True, "rl.dual_clip": 3.0}
_RUNS = {}


def _one_step(overrides, mode="per_trajectory", micro_batches=1, compact=False, ref=False):
    """`_run_steps` of one step on one device, on `_batch(_trajectories(), ...)`: memoized by
    the typed step config and the batch layout, so tests that run the same step share it."""
    cfg = _config(**overrides, **({"rl.micro_batches": micro_batches} if micro_batches > 1 else {}))
    key = (StepConfig.from_config(cfg), mode, micro_batches, compact, ref)
    if key not in _RUNS:
        batch = _batch(_trajectories(), mode, micro_batches=micro_batches, compact=compact)
        _RUNS[key] = _run_steps(cfg, [batch], _single_mesh(), ref=ref)
    return _RUNS[key]


@pytest.mark.slow
def test_sharded_step_equals_single_device():
    cfg = _config(**STEP_OVERRIDES)
    batch = _batch(_trajectories())
    mesh8 = sharding.make_mesh(config_lib.mesh_config((2, 2, 2, 1)))
    # Adam moments are sharded like their params.
    model, _ = _model_and_params()
    rules = sharding.logical_rules(cfg.mesh)
    shardings = tst.train_state_shardings(model, tst.make_optimizer(cfg.optim), mesh8, rules)
    q_spec = shardings.params["layers"]["attn"]["q_proj"].spec
    assert q_spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    mu = [s.mu for s in jax.tree.leaves(shardings.opt_state, is_leaf=lambda x: hasattr(x, "mu"))
          if hasattr(s, "mu")][0]  # fmt: skip
    assert mu["layers"]["attn"]["q_proj"].spec == q_spec
    sharded = _run_steps(cfg, [batch, batch], mesh8)
    single = _run_steps(cfg, [batch, batch], _single_mesh())
    _assert_same_run(sharded, single)
    assert single[1][0]["update_skipped"] == 0.0 and single[1][0]["tg_loss"] > 0
    assert single[1][0]["logprob_mismatch_max"] > 0.1  # the noise of `_batch`


@pytest.mark.slow
def test_sharded_compact_step_equals_single_device():
    cfg = _config(**STEP_OVERRIDES, **{"rl.micro_batches": 2})
    mesh8 = sharding.make_mesh(config_lib.mesh_config((2, 2, 2, 1)))
    divisor = sharding.batch_divisor(mesh8, sharding.logical_rules(cfg.mesh))
    batch = _batch(_trajectories(16), micro_batches=2, compact=True, batch_multiple=divisor)
    assert batch.teacher_compact and batch.teacher_tokens_BtxTt.shape[0] % (2 * divisor) == 0
    sharded = _run_steps(cfg, [batch, batch], mesh8)
    single = _run_steps(cfg, [batch, batch], _single_mesh())
    _assert_same_run(sharded, single)
    assert single[1][0]["tg_loss"] > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "agg,mode,kl,compact",
    [
        ("token_mean", "per_trajectory", 0.0, False),
        ("seq_mean_token_mean", "per_turn", 0.1, False),
        ("seq_mean_token_sum_norm", "per_trajectory", 0.0, False),
        ("token_mean", "per_trajectory", 0.0, True),
        ("seq_mean_token_mean", "per_turn", 0.1, True),
    ],
)
def test_micro_batches_equal_one_big_batch(agg, mode, kl, compact):
    # tg.norm_length 8 (not 50): the TG term weighs more; the first case's runs are then
    # test_token_sum_micro_batches_equal_one_big_batch's (`_one_step` runs them once).
    overrides = {"rl.agg_mode": agg, "tg.teacher_mode": mode, "rl.kl_coef": kl,
                 "tg.norm_length": 8.0, **STEP_OVERRIDES}  # fmt: skip
    big = _one_step(overrides, mode, compact=compact, ref=kl > 0)
    micro = _one_step(overrides, mode, micro_batches=4, compact=compact, ref=kl > 0)
    _assert_same_run(big, micro)
    assert big[1][0]["tg_loss"] > 0 and (kl == 0 or big[1][0]["ref_kl"] > 0)


@pytest.mark.slow
def test_token_sum_micro_batches_equal_one_big_batch():
    trajs = _trajectories()
    overrides = {"tg.normalize": "token_sum", "tg.norm_length": 8.0, **STEP_OVERRIDES}
    big = _one_step(overrides)
    micro = _one_step(overrides, micro_batches=4)
    _assert_same_run(big, micro)
    mean = _one_step({"tg.normalize": "token_mean", **STEP_OVERRIDES})
    # Same divergences; the loss is sum / (8 trajectories x 8) instead of sum / |M|.
    m0, s0 = mean[1][0], big[1][0]
    np.testing.assert_allclose(s0["tg_kl"], m0["tg_kl"], rtol=1e-5)
    expect = m0["tg_loss"] * m0["tg_num_distilled"] / (len(trajs) * 8.0)
    np.testing.assert_allclose(s0["tg_loss"], expect, rtol=1e-5)


def test_nan_guard_and_no_recompiles():
    cfg = _config(**STEP_OVERRIDES)
    batches = [_batch(_trajectories(seed=s)) for s in range(3)]
    bad = dataclasses.replace(
        batches[1], rewards={**batches[1].rewards, "task": np.full((8,), np.nan, np.float32)}
    )
    mesh = _single_mesh()
    model, params = _model_and_params()
    rules = sharding.logical_rules(cfg.mesh)
    state = tst.create_train_state(
        model, tst.make_optimizer(cfg.optim), mesh, rules, jax.random.key(1), params=params
    )
    step = ts.make_train_step(cfg, model, mesh, rules)
    state, m0 = step(state, batches[0])
    before = jax.device_get(state)
    state, m1 = step(state, bad)
    after = jax.device_get(state)
    assert float(m1["update_skipped"]) == 1.0 and not np.isfinite(float(m1["loss"]))
    _tree_close(before.params, after.params, atol=0.0)
    _tree_close(before.opt_state, after.opt_state, atol=0.0)
    assert int(after.step) == 2
    state, m2 = step(state, batches[2])
    assert float(m0["update_skipped"]) == 0.0 and float(m2["update_skipped"]) == 0.0
    assert np.isfinite(float(m2["loss"])) and float(m2["lr"]) == pytest.approx(1e-3)
    assert step.jitted._cache_size() == 1  # three batches, one compilation
