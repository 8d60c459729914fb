"""The frozen teacher (tg.teacher_params="reference"): config checks; with reference == policy
params the loss and gradients of the policy teacher; with other reference params the TG
divergence of the reference's logits (numpy, float64); in the train step the teacher stays at
the reference while the policy moves."""

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from tg_jax import config_files, config_lib, sharding
from tg_jax.models import ModelConfig, Transformer, forward, init_params
from tg_jax.rl import train_state as tst
from tg_jax.rl import train_step as ts
from tg_jax.rl.batch import build_batch
from tg_jax.rl.step_config import StepConfig, TGConfig
from tg_jax.testing import synthetic_trajectories

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

REFERENCE = {"tg.teacher_params": "reference"}


def _config(model=None, **overrides) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = model or config_lib.tiny_model_config()
    c.mesh = config_lib.mesh_config((1, 1, 1, 1))
    c.rl = config_lib.rl_config(reward_weights={"task": 1.0, "fence": 0.5})
    c.tg = config_lib.tg_config(chunk_size=16)
    c.tg.lambda_tg = 0.5
    c.optim = config_lib.optim_config(lr=1e-3, eps=1e-6)
    return config_files.apply_overrides(c, overrides)


@functools.cache
def _model_and_params(tie_embeddings=True):
    model_cfg = config_lib.tiny_model_config()
    model_cfg.tie_embeddings = tie_embeddings
    model = Transformer(ModelConfig.from_config(model_cfg))
    return model_cfg, model, init_params(model, jax.random.key(0))


def _batch(params, model, compact=False):
    """8 trajectories, about half their turns failed; behaviour log-probs = the model's."""
    trajs = synthetic_trajectories(np.random.default_rng(0), 8, 40, hint_len=5, fail_prob=0.5)
    batch = build_batch(
        trajs, max_len=64, teacher_max_len=64, mode="per_trajectory",
        requirement_names=("fence",), pad_to_multiple=16, compact=compact,
    )  # fmt: skip
    logits = forward(model, params, batch.tokens_BxT, batch.positions_BxT, batch.segment_ids_BxT)
    logp = np.take_along_axis(
        np.asarray(jax.nn.log_softmax(logits)), batch.targets_BxT[..., None], -1
    )
    behaviour = np.where(batch.loss_mask_BxT, logp[..., 0], 0.0).astype(np.float32)
    return dataclasses.replace(batch, behaviour_logprobs_BxT=behaviour)


def _loss_and_grad(cfg, batch, model, params, ref_params=None):
    typed = StepConfig.from_config(cfg)
    fn = functools.partial(ts.loss_fn, model=model, rl_cfg=typed.rl, tg_cfg=typed.tg)
    (loss, (sums, _)), grads = jax.jit(jax.value_and_grad(fn, has_aux=True))(
        params, batch, ref_params=ref_params
    )
    return loss, sums, grads


def _tree_close(a, b, atol, rtol=0.0):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=rtol)


def _perturbed(params, scale, only=None):
    """params + N(0, scale) noise on every leaf (or on the leaves named `only`)."""
    leaves, tree = jax.tree.flatten_with_path(params)
    rng = np.random.default_rng(3)
    out = []
    for path, x in leaves:
        name = jax.tree_util.keystr(path)
        hit = only is None or only in name
        noise = rng.normal(0.0, scale, x.shape).astype(np.float32) if hit else 0.0
        out.append(jnp.asarray(x + noise, x.dtype))
    return jax.tree.unflatten(tree, out)


def _log_softmax(z):
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


# ---------------------------------------------------------------------------------------------
# Config.
# ---------------------------------------------------------------------------------------------


def test_teacher_params_config():
    policy = StepConfig.from_config(_config())
    assert policy.tg.teacher_params == "policy" and not policy.needs_reference
    assert policy.tg.compact_rows  # today's behaviour: compact rows, no reference
    ref = StepConfig.from_config(_config(**REFERENCE))
    assert ref.tg.reference_teacher and ref.needs_reference
    assert not ref.tg.compact_rows  # full rows: compact ones continue the policy's keys/values
    grpo = StepConfig.from_config(_config(**REFERENCE, **{"tg.enabled": False}))
    assert not grpo.needs_reference and not grpo.tg.compact_rows  # the GRPO arm: no teacher
    assert not TGConfig.from_config(config_lib.tg_config(compact=False)).compact_rows
    with pytest.raises(ValueError, match="tg.teacher_params must be one of policy, reference"):
        StepConfig.from_config(_config(**{"tg.teacher_params": "base"}))


@pytest.mark.slow
def test_reference_teacher_needs_reference_params_and_full_rows():
    cfg_model, model, params = _model_and_params()
    cfg = _config(cfg_model, **REFERENCE)
    with pytest.raises(ValueError, match="needs ref_params"):
        _loss_and_grad(cfg, _batch(params, model), model, params)
    with pytest.raises(ValueError, match="need full teacher rows"):
        _loss_and_grad(cfg, _batch(params, model, compact=True), model, params, params)
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    with pytest.raises(ValueError, match="with_reference=False is not allowed"):
        ts.make_train_step(cfg, model, mesh, sharding.logical_rules(cfg.mesh), with_reference=False)


# ---------------------------------------------------------------------------------------------
# Loss: reference == policy params, and other reference params.
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["forward", "reverse"])
def test_reference_equal_to_policy_gives_the_policy_teacher(kind):
    cfg_model, model, params = _model_and_params()
    full = _batch(params, model)
    policy = _loss_and_grad(_config(cfg_model, **{"tg.kind": kind}), full, model, params)
    ref_cfg = _config(cfg_model, **{"tg.kind": kind}, **REFERENCE)
    ref_copy = jax.tree.map(jnp.copy, params)
    reference = _loss_and_grad(ref_cfg, full, model, params, ref_copy)
    assert float(policy[1]["tg_loss"]) > 1e-6
    # The same computation on the same rows: equal up to XLA's fusion choices.
    np.testing.assert_allclose(reference[0], policy[0], rtol=1e-6, atol=1e-8)
    for k in policy[1]:
        np.testing.assert_allclose(reference[1][k], policy[1][k], rtol=1e-6, atol=1e-8, err_msg=k)
    _tree_close(reference[2], policy[2], atol=1e-8, rtol=1e-6)
    # ...and the policy teacher on its default compact rows, to the compact rows' rounding.
    compact = _loss_and_grad(_config(cfg_model, **{"tg.kind": kind}), _batch(params, model, True),
                             model, params)  # fmt: skip
    np.testing.assert_allclose(reference[0], compact[0], rtol=1e-6, atol=1e-7)
    _tree_close(reference[2], compact[2], atol=1e-6, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,tie,only",
    [("forward", True, None), ("reverse", True, None), ("forward", False, "lm_head")],
    ids=["forward_all_leaves", "reverse_all_leaves", "forward_untied_lm_head_only"],
)
def test_reference_teacher_divergence_matches_numpy(kind, tie, only):
    """D from the reference's logits on the hinted rows, not the policy's: its own
    unembedding too (with only lm_head perturbed, the teacher's hidden states are the
    policy's and only its logits differ)."""
    cfg_model, model, params = _model_and_params(tie)
    ref = _perturbed(params, 0.05, only)
    batch = _batch(params, model)
    cfg = _config(cfg_model, **{"tg.kind": kind}, **REFERENCE)
    loss, sums, grads = _loss_and_grad(cfg, batch, model, params, ref)
    _, sums_policy, grads_policy = _loss_and_grad(
        _config(cfg_model, **{"tg.kind": kind}), batch, model, params
    )

    zs = forward(model, params, batch.tokens_BxT, batch.positions_BxT, batch.segment_ids_BxT)
    zt = forward(model, ref, batch.teacher_tokens_BtxTt, batch.teacher_positions_BtxTt,
                 batch.teacher_segment_ids_BtxTt)  # fmt: skip
    zt = np.asarray(zt, np.float64)[batch.teacher_row_BxT, batch.teacher_pos_BxT]
    ls, lt = _log_softmax(zs), _log_softmax(zt)
    p, q = (ls, lt) if kind == "reverse" else (lt, ls)  # KL(p || q), student first = reverse
    d = (np.exp(p) * (p - q)).sum(-1)
    mask = batch.tg_mask_BxT & batch.failed_turn_mask_BxT & batch.answer_mask_BxT
    assert mask.sum() > 10
    expected = d[mask].mean()
    np.testing.assert_allclose(sums["tg_kl"], expected, rtol=1e-4, atol=1e-8)
    # The shipped recipe's token_sum: the sum over M / (trajectories x tg.norm_length).
    trajectories = (batch.loss_mask_BxT.sum(-1) > 0).sum()
    expected_loss = 0.5 * d[mask].sum() / (trajectories * cfg.tg.norm_length)
    np.testing.assert_allclose(sums["tg_loss"], expected_loss, rtol=1e-4, atol=1e-8)
    np.testing.assert_allclose(loss, sums["pg_loss"] + sums["tg_loss"], rtol=1e-6)
    # The policy teacher's divergence is another number (here: the untrained policy vs itself
    # with a hint), so the reference was really used.
    assert abs(float(sums["tg_kl"]) - float(sums_policy["tg_kl"])) > 0.1 * float(sums["tg_kl"])
    diff = optax.tree.norm(jax.tree.map(jnp.subtract, grads, grads_policy))
    assert float(diff) > 1e-3 * float(optax.tree.norm(grads))


# ---------------------------------------------------------------------------------------------
# Train step: the teacher stays at the reference.
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_train_step_teacher_stays_at_the_reference():
    cfg_model, model, params = _model_and_params()
    mesh = sharding.make_mesh(config_lib.mesh_config((1, 1, 1, 1)), jax.devices()[:1])
    batch = _batch(params, model)
    runs = {}
    for name, overrides in (("policy", {}), ("reference", REFERENCE)):
        cfg = _config(cfg_model, **overrides)
        rules = sharding.logical_rules(cfg.mesh)
        state = tst.create_train_state(
            model, tst.make_optimizer(cfg.optim), mesh, rules, jax.random.key(1), params=params
        )
        step = ts.make_train_step(cfg, model, mesh, rules)
        ref = jax.tree.map(jnp.copy, params)
        out = []
        for _ in range(3):
            args = (ref,) if name == "reference" else ()
            state, metrics = step(state, batch, *args)
            out.append(jax.device_get(metrics))
        runs[name] = out
    start_norm = float(optax.tree.norm(params))
    pol, ref = runs["policy"], runs["reference"]
    # Step 1: the policy is still the reference: identical steps.
    for k in pol[0]:
        np.testing.assert_allclose(ref[0][k], pol[0][k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert ref[0]["tg_teacher_drift"] == 0.0 and ref[0]["tg_loss"] > 0
    # Then the policy moves; the reference teacher does not.
    for m in ref:
        np.testing.assert_allclose(m["tg_teacher_param_norm"], start_norm, rtol=1e-6)
    assert 0 < ref[1]["tg_teacher_drift"] < ref[2]["tg_teacher_drift"]
    assert all(m["tg_teacher_drift"] == 0.0 for m in pol)
    assert abs(pol[2]["tg_teacher_param_norm"] - start_norm) > 1e-4
    assert abs(float(ref[2]["tg_kl"]) - float(pol[2]["tg_kl"])) > 1e-6


@pytest.mark.slow
def test_resumed_run_keeps_the_start_params_as_the_teacher(tmp_path):
    """The reference is made from run_rl's init_params, not from the restored checkpoint: a
    run stopped after step 1 and resumed equals the uninterrupted one, teacher included."""
    from tests import rl_loop_driver as driver
    from tg_jax.metrics import last_per_step, read_metrics
    from tg_jax.train import rl

    config = driver.make_config(steps=3)
    config.tg.teacher_params = "reference"
    init = driver.initial_params(config)
    kw = {"arm_name": "tg", "seed": 0, "sources": driver.make_sources()}
    full = rl.run_rl(config, str(tmp_path / "full"), init, **kw)
    first = rl.run_rl(config, str(tmp_path / "resumed"), init, stop_after=1, **kw)
    resumed = rl.run_rl(config, str(tmp_path / "resumed"), init, **kw)
    assert first.step == 1 and full.finished and resumed.finished

    def train_metrics(workdir):
        rows = last_per_step(read_metrics(str(workdir)))
        return {r["step"]: r for r in rows if r["stage"] == "train"}

    a, b = train_metrics(tmp_path / "full"), train_metrics(tmp_path / "resumed")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    start_norm = float(optax.tree.norm(init))
    for step in (1, 2, 3):
        for k in ("tg_teacher_param_norm", "tg_teacher_drift", "tg_kl", "loss"):
            assert a[step][k] == b[step][k], (step, k)
        np.testing.assert_allclose(b[step]["tg_teacher_param_norm"], start_norm, rtol=1e-6)
    assert (
        b[1]["tg_teacher_drift"] == 0.0 and 0 < b[2]["tg_teacher_drift"] < b[3]["tg_teacher_drift"]
    )
    fa, fb = driver.flat_params(full.state.params), driver.flat_params(resumed.state.params)
    for k in fa:
        np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("teacher", ["policy", "reference"])
def test_aot_train_step_lowers_with_either_teacher(teacher):
    """tg_jax.tpu.aot lowers the step as train/rl.py runs it: the reference teacher takes the
    reference params and full teacher rows."""
    from tests.test_aot import _tiny_config
    from tg_jax.tpu import aot_steps, hbm

    cfg = config_files.apply_overrides(
        _tiny_config((1, 2, 1, 1), moe=False), {"tg.teacher_params": teacher}
    )
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:2])
    shapes = aot_steps.TrainShapes(
        rows=4, seq_len=32, teacher_rows=4, teacher_len=32, prefix_len=32
    )
    compiled = aot_steps.compile_tg_train_step(cfg, mesh, sharding.logical_rules(cfg.mesh), shapes)
    assert hbm.memory_report(compiled, "train", hbm=2.0**30).arguments > 0
