"""Peers' methods on the TG teacher path (tg.method, tg_jax.rl.peers, issue #43).

Each arm's loss and gradient on tiny logits against a float64 numpy reference (the loss is
composed by the same `tg_jax.rl.loss` functions `loss_fn` uses; the model is an identity
unembedding), one train step per arm on the tiny model, the arms' distilled-token counts, and
the default method leaving the TG loss bit-for-bit what it was before the peers existed.
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_train_step import (
    _batch,
    _config,
    _loss_and_grad,
    _run_steps,
    _single_mesh,
    _trajectories,
)
from tg_jax.rl import peers
from tg_jax.rl.core import normalizers, shares
from tg_jax.rl.loss import (
    distill_weight,
    peer_advantages,
    policy_and_distill,
    policy_term,
    teacher_term_options,
)
from tg_jax.rl.step_config import RLConfig, TGConfig
from tg_jax.rl.tg.divergence import chunked_token_stats
from tg_jax.rl.tg.loss import tg_term
from tg_jax.rl.tg.mask import tg_mask

B, T, V = 2, 5, 7
RL = RLConfig()  # token_mean, clip 0.2 / 0.28
LAMBDA = 0.7
ADV_B = np.array([0.8, -1.3])


# --- a tiny batch of logits and its numpy reference (float64) --------------------------------


def _np_log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _take(x_BxTxV, idx_BxT):
    return np.take_along_axis(x_BxTxV, idx_BxT[..., None], -1)[..., 0]


def _setup(seed=0):
    rng = np.random.default_rng(seed)
    zs = (rng.normal(size=(B, T, V)) * 2.0).astype(np.float32)
    zt = (rng.normal(size=(B, T, V)) * 2.0).astype(np.float32)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    loss_mask = np.ones((B, T), bool)
    loss_mask[0, 0] = loss_mask[1, 4] = False  # a prompt token, a padding token
    failed = np.zeros((B, T), bool)
    failed[0, 1:4] = failed[1, 2:4] = True  # the failed turns
    hinted = loss_mask.copy()
    hinted[1, 3] = False  # no teacher counterpart (e.g. truncated)
    noise = rng.normal(0, 0.05, (B, T))
    behaviour = np.where(loss_mask, _take(_np_log_softmax(zs), targets) + noise, 0.0)
    batch = types.SimpleNamespace(  # the Batch fields the loss terms read
        loss_mask_BxT=loss_mask,
        thinking_mask_BxT=np.zeros((B, T), bool),
        failed_turn_mask_BxT=failed,
        hinted_BxT=hinted,  # the targets with a hinted teacher counterpart: M of each gate
        requirement_ids_BxT=np.where(hinted, 0, -1).astype(np.int32),
        requirement_names=("fence",),
        behaviour_logprobs_BxT=behaviour.astype(np.float32),
        targets_BxT=targets,
        head_B=None,
    )
    return zs, zt, batch


def _tg_cfg(method, gate="all_turns", **kw):
    """The references below are written for the reverse KL (`_np_reverse_kl`), token mean."""
    kw = dict(kind="reverse", normalize="token_mean") | kw
    return TGConfig(method=method, gate=gate, lambda_tg=LAMBDA, **kw)


def _gated(batch, cfg):
    """The batch with M of cfg's gate (`tg_mask`, as `build_batch` builds it)."""
    mask = tg_mask(
        batch.hinted_BxT,
        batch.thinking_mask_BxT,
        batch.failed_turn_mask_BxT,
        batch.loss_mask_BxT,
        include_thinking=False,
        gate=cfg.gate,
    )
    return types.SimpleNamespace(**{**vars(batch), "tg_mask_BxT": mask})


def _jax_loss(zs, zt, batch, cfg):
    """`loss_fn`'s composition on logits (identity unembedding, chunks of 2 over T = 5)."""
    batch = _gated(batch, cfg)
    norms = normalizers(batch, cfg)
    stats = chunked_token_stats(
        zs, jnp.asarray(batch.targets_BxT), lambda h: h, teacher_hidden_BxTxD=zt, chunk_size=2,
        **teacher_term_options(cfg),
    )  # fmt: skip
    adv, _ = peer_advantages(jnp.asarray(ADV_B, jnp.float32), stats, batch, cfg, norms)
    policy, _ = policy_term(stats.logprob_BxT, batch, adv, RL, shares(batch, norms, RL))
    tg = tg_term(stats.divergence_BxT, batch, distill_weight(0, cfg), cfg, norms)
    return policy_and_distill(policy, tg, cfg)


def _value_and_grad(zs, zt, batch, cfg):
    fn = jax.jit(lambda z: _jax_loss(z, zt, batch, cfg))
    loss, grad = jax.value_and_grad(fn)(jnp.asarray(zs))
    return float(loss), np.asarray(grad, np.float64)


def _np_pg(ls, batch, adv_BxT):
    """Token mean of the clipped surrogate max(-A r, -A clip(r, 0.8, 1.28))."""
    ratio = np.exp(_take(ls, batch.targets_BxT) - batch.behaviour_logprobs_BxT)
    loss = np.maximum(-adv_BxT * ratio, -adv_BxT * np.clip(ratio, 0.8, 1.28))
    return loss[batch.loss_mask_BxT].mean()


def _np_reverse_kl(ls, lt):
    return (np.exp(ls) * (ls - lt)).sum(-1)


def _np_gap(ls, lt, batch):
    return _take(lt, batch.targets_BxT) - _take(ls, batch.targets_BxT)


def _fd_grad(fn, zs, h=1e-6):
    """Central finite differences of the float64 scalar fn(zs)."""
    zs = np.asarray(zs, np.float64)
    grad = np.zeros_like(zs)
    for idx in np.ndindex(zs.shape):
        up, down = zs.copy(), zs.copy()
        up[idx] += h
        down[idx] -= h
        grad[idx] = (fn(up) - fn(down)) / (2 * h)
    return grad


def _adv_BxT():
    return np.broadcast_to(ADV_B[:, None], (B, T))


# --- SDPO: (1 - w) L_GRPO + w mean_M D, every turn, three estimators --------------------------


def _np_topk_kl(ls, lt, k, by=None):
    """Reverse KL over the top-k tokens of `by` (default: the teacher), both renormalised."""
    idx = np.argsort(-(lt if by is None else by), -1)[..., :k]
    s, t = np.take_along_axis(ls, idx, -1), np.take_along_axis(lt, idx, -1)
    s, t = _np_log_softmax(s), _np_log_softmax(t)
    return (np.exp(s) * (s - t)).sum(-1)


@pytest.mark.parametrize("estimator", ["full", "topk", "sampled"])
def test_sdpo_blend_loss_and_gradient_vs_numpy(estimator):
    zs, zt, batch = _setup()
    w, k = 0.3, 3
    cfg = _tg_cfg("sdpo", peer_weight=w, peer_estimator=estimator, peer_top_k=k)
    mask = batch.loss_mask_BxT & batch.hinted_BxT  # every turn: no failed-turn gate
    assert np.asarray(_gated(batch, cfg).tg_mask_BxT).tolist() == mask.tolist()
    lt = _np_log_softmax(zt)

    def divergence(ls):
        if estimator == "full":
            return _np_reverse_kl(ls, lt)
        if estimator == "topk":
            return _np_topk_kl(ls, lt, k)
        return -_np_gap(ls, lt, batch)  # log p_s(y) - log p_t(y)

    def np_loss(z):
        ls = _np_log_softmax(z)
        return (1 - w) * _np_pg(ls, batch, _adv_BxT()) + w * divergence(ls)[mask].mean()

    loss, grad = _value_and_grad(zs, zt, batch, cfg)
    np.testing.assert_allclose(loss, np_loss(zs), rtol=1e-5, atol=1e-6)
    if estimator != "sampled":
        np.testing.assert_allclose(grad, _fd_grad(np_loss, zs), rtol=1e-3, atol=2e-5)
        return
    # Sampled: gradient sg(D_t) grad log p_s(y_t) = D_t (onehot(y_t) - p_s,t) on M.
    ls = _np_log_softmax(zs)
    pg_grad = _fd_grad(lambda z: (1 - w) * _np_pg(_np_log_softmax(z), batch, _adv_BxT()), zs)
    onehot = np.eye(V)[batch.targets_BxT]
    coef = np.where(mask, divergence(ls), 0.0)[..., None] / mask.sum()
    np.testing.assert_allclose(
        grad, pg_grad + w * coef * (onehot - np.exp(ls)), rtol=1e-3, atol=2e-5
    )


def test_sdpo_top_k_is_the_teachers_and_exact_at_full_vocabulary():
    zs, zt, batch = _setup(1)
    ls, lt = _np_log_softmax(zs), _np_log_softmax(zt)
    got = peers.sdpo.teacher_top_k_divergence(jnp.asarray(ls, jnp.float32),
                                              jnp.asarray(lt, jnp.float32), k=2,
                                              kind="reverse")  # fmt: skip
    np.testing.assert_allclose(got, _np_topk_kl(ls, lt, 2), rtol=1e-5, atol=1e-6)
    # The student's top-2 gives another value: the tokens are the teacher's.
    assert np.abs(_np_topk_kl(ls, lt, 2, by=ls) - _np_topk_kl(ls, lt, 2)).max() > 1e-2
    full = peers.sdpo.teacher_top_k_divergence(jnp.asarray(ls), jnp.asarray(lt), k=V,
                                               kind="reverse")  # fmt: skip
    np.testing.assert_allclose(full, _np_reverse_kl(ls, lt), rtol=1e-5, atol=1e-6)


def test_sdpo_and_opsd_need_the_all_turns_gate():
    for method in ("sdpo", "opsd"):
        with pytest.raises(ValueError, match="all_turns"):
            TGConfig(method=method)
    assert TGConfig(method="sdar").gate == "failed_turns"  # the token gate may sit on either


# --- OPSD: TG with the all-turns gate --------------------------------------------------------


def test_opsd_is_tg_with_the_all_turns_gate_vs_numpy():
    zs, zt, batch = _setup(2)
    loss, grad = _value_and_grad(zs, zt, batch, _tg_cfg("opsd"))
    loss_tg, grad_tg = _value_and_grad(zs, zt, batch, _tg_cfg("tg"))
    assert loss == loss_tg and np.array_equal(grad, grad_tg)  # the same path, bit for bit
    mask = batch.loss_mask_BxT & batch.hinted_BxT
    lt = _np_log_softmax(zt)

    def np_loss(z):
        ls = _np_log_softmax(z)
        return _np_pg(ls, batch, _adv_BxT()) + LAMBDA * _np_reverse_kl(ls, lt)[mask].mean()

    np.testing.assert_allclose(loss, np_loss(zs), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, _fd_grad(np_loss, zs), rtol=1e-3, atol=2e-5)
    # ...and it differs from TG's failed-turn gate.
    loss_gated, _ = _value_and_grad(zs, zt, batch, _tg_cfg("tg", gate="failed_turns"))
    assert abs(loss_gated - loss) > 1e-3


# --- SDAR: GRPO + lambda mean_M g_t D_t, g_t = sg(sigmoid(beta (gap_t - tau))) ----------------


def test_sdar_gate_values():
    zs, zt, batch = _setup(3)
    ls, lt = _np_log_softmax(zs), _np_log_softmax(zt)
    gap = peers.sdar.log_prob_gap(jnp.asarray(ls), jnp.asarray(lt), jnp.asarray(batch.targets_BxT))
    np.testing.assert_allclose(gap, _np_gap(ls, lt, batch), rtol=1e-6, atol=1e-6)
    gate = peers.sdar.token_gate(jnp.asarray([-1.0, 0.5, 0.5, 3.0]), 2.0, 0.5)
    np.testing.assert_allclose(gate, 1 / (1 + np.exp(-2.0 * np.array([-1.5, 0, 0, 2.5]))), 1e-6)
    assert float(gate[1]) == 0.5
    # The gate's gradient is zero.
    g = jax.grad(lambda x: peers.sdar.token_gate(x, 2.0, 0.5).sum())(jnp.asarray([0.1, 1.0]))
    assert np.all(np.asarray(g) == 0.0)


@pytest.mark.parametrize("gate", ["all_turns", "failed_turns"])
def test_sdar_loss_and_gradient_vs_numpy_gate_is_stop_gradient(gate):
    zs, zt, batch = _setup(4)
    beta, tau = 1.5, -0.5
    cfg = _tg_cfg("sdar", gate=gate, sdar_beta=beta, sdar_tau=tau)
    mask = batch.loss_mask_BxT & batch.hinted_BxT
    if gate == "failed_turns":
        mask &= batch.failed_turn_mask_BxT
    lt = _np_log_softmax(zt)

    def np_gate(ls):
        return 1 / (1 + np.exp(-beta * (_np_gap(ls, lt, batch) - tau)))

    fixed_gate = np_gate(_np_log_softmax(zs))

    def np_loss(z, g=None):
        ls = _np_log_softmax(z)
        g = np_gate(ls) if g is None else g
        pg = _np_pg(ls, batch, _adv_BxT())
        return pg + LAMBDA * (g * _np_reverse_kl(ls, lt))[mask].mean()

    loss, grad = _value_and_grad(zs, zt, batch, cfg)
    np.testing.assert_allclose(loss, np_loss(zs), rtol=1e-5, atol=1e-6)
    assert fixed_gate[mask].min() < 0.3 and fixed_gate[mask].max() > 0.7  # tokens differ
    # The gradient holds g_t fixed (stop-gradient)...
    np.testing.assert_allclose(
        grad, _fd_grad(lambda z: np_loss(z, fixed_gate), zs), rtol=1e-3, atol=2e-5
    )
    # ...which is not the gradient through the gate.
    assert np.abs(grad - _fd_grad(np_loss, zs)).max() > 1e-3


# --- SGCD: no KL; A'_t = A clip(1 + alpha tanh(gap_t), 1 - c, 1 + c) ---------------------------


def test_sgcd_advantage_reweighting_clipping_and_no_kl():
    zs, zt, batch = _setup(5)
    alpha, c = 1.5, 0.3
    cfg = _tg_cfg("sgcd", sgcd_alpha=alpha, sgcd_clip=c)
    batch = _gated(batch, cfg)
    mask = batch.loss_mask_BxT & batch.hinted_BxT  # where the teacher ran
    assert np.asarray(batch.tg_mask_BxT).tolist() == mask.tolist()
    assert float(normalizers(batch, cfg).num_distilled) == 0.0  # nothing distilled
    lt = _np_log_softmax(zt)

    def np_weight(ls):
        score = np.where(mask, np.tanh(_np_gap(ls, lt, batch)), 0.0)
        return np.clip(1 + alpha * np.sign(ADV_B)[:, None] * score, 1 - c, 1 + c)

    weight = np_weight(_np_log_softmax(zs))
    # Both clip bounds are hit, unmasked tokens keep weight 1, masked ones move.
    assert np.isclose(weight, 1 + c).any() and np.isclose(weight, 1 - c).any()
    assert np.all(weight[~mask] == 1.0) and np.all(weight[mask] != 1.0)

    # The weights and the reweighted advantages from the jax functions.
    stats = chunked_token_stats(
        jnp.asarray(zs), jnp.asarray(batch.targets_BxT), lambda h: h,
        teacher_hidden_BxTxD=jnp.asarray(zt), chunk_size=2, **teacher_term_options(cfg),
    )  # fmt: skip
    adv, metrics = peer_advantages(jnp.asarray(ADV_B), stats, batch, cfg, normalizers(batch, cfg))
    np.testing.assert_allclose(adv, ADV_B[:, None] * weight, rtol=1e-5, atol=1e-6)
    loss_mask = batch.loss_mask_BxT
    np.testing.assert_allclose(
        metrics["sgcd_weight_mean"], weight[loss_mask].mean(), rtol=1e-5, atol=1e-6
    )

    def np_loss(z, w=None):
        ls = _np_log_softmax(z)
        return _np_pg(ls, batch, _adv_BxT() * (np_weight(ls) if w is None else w))

    loss, grad = _value_and_grad(zs, zt, batch, cfg)
    np.testing.assert_allclose(loss, np_loss(zs), rtol=1e-5, atol=1e-6)
    # No KL term: the TG term is exactly 0; the gradient is the surrogate's with fixed weights.
    norms = normalizers(batch, cfg)
    tg = tg_term(jnp.ones((B, T)), batch, distill_weight(0, cfg), cfg, norms)
    assert float(tg.loss) == 0.0 and float(tg.kl) == 0.0
    np.testing.assert_allclose(grad, _fd_grad(lambda z: np_loss(z, weight), zs), 1e-3, 2e-5)
    assert np.abs(grad - _fd_grad(np_loss, zs)).max() > 1e-4  # weights are stop-gradient


# --- the tiny model: one train step per arm, costs, and the default unchanged -----------------


METHODS = ("tg", "sdpo", "opsd", "sdar", "sgcd")


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_each_arm_runs_one_train_step(method):
    from tg_jax.train import pipeline
    from tg_jax.train.rl import distilled_tokens

    w = 0.25  # tg.peer_weight (sdpo); lambda_tg is 0.5
    cfg = _config(**{"tg.method": method, "tg.gate": "all_turns", "tg.peer_weight": w,
                     "tg.sgcd_clip": 0.3, "tg.normalize": "token_mean"})  # fmt: skip
    if method != "tg":
        arm = pipeline.ARMS[method]
        assert arm.group == "ablation" and arm.overrides["tg.method"] == method
        assert arm.overrides["tg.gate"] == "all_turns"
    batch = _batch(_trajectories(), gate="all_turns")
    _, metrics, _ = _run_steps(cfg, [batch], _single_mesh())
    m = metrics[0]
    assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    assert m["update_skipped"] == 0.0
    typed = TGConfig.from_config(cfg.tg)
    assert typed.distils == (method != "sgcd")
    n_teacher = int(np.asarray(batch.tg_mask_BxT).sum())
    assert n_teacher > 20
    # Distilled-token cost (tg_jax.train.rl): every teacher token but for sgcd, which has none.
    assert distilled_tokens(cfg.tg, batch) == (0 if method == "sgcd" else n_teacher)
    assert m["tg_num_distilled"] == (0 if method == "sgcd" else n_teacher)
    if method == "sdpo":
        assert m["lambda_tg"] == w and m["tg_loss"] > 0
        np.testing.assert_allclose(m["loss"], (1 - w) * m["pg_loss"] + m["tg_loss"], rtol=1e-5)
        np.testing.assert_allclose(m["tg_loss"], w * m["tg_kl"], rtol=1e-5)
    elif method == "sgcd":
        assert m["tg_loss"] == 0.0 and m["lambda_tg"] == 0.0 and m["loss"] == m["pg_loss"]
        assert 0.7 <= m["sgcd_weight_mean"] <= 1.3 and m["sgcd_weight_mean"] != 1.0
    else:
        assert m["lambda_tg"] == 0.5 and m["tg_loss"] > 0
        np.testing.assert_allclose(m["loss"], m["pg_loss"] + m["tg_loss"], rtol=1e-5)
        np.testing.assert_allclose(m["tg_loss"], 0.5 * m["tg_kl"], rtol=1e-5)


# The default config's loss on this fixed batch before tg.method existed (commit a8d9483,
# CPU), full and compact teacher rows, and the sum of squared gradients (float64 of
# float32). The figures are not bit for bit the same on every CPU (XLA:CPU's vector code
# differs; the compact loss came out 4.7e-6 apart, relative, in CI at commit 231f8cc and on
# an AMD EPYC since), so they are checked to 1e-4 (loss) and 2e-6 (gradients)
# relative. Lambda 0.5 -> 0.49 moves them 8.6e-4 and 1.2e-5, token_sum 3.5e-2 and 4.9e-4; the
# KL's direction (forward moves them 4.7e-6 and 9.6e-7 on this near-uniform batch) is checked
# against numpy in the tests above.
BEFORE = {
    False: (-0.003950783051550388, 0.5208068497808819),
    True: (-0.003950792830437422, 0.5208068509316602),
}


@pytest.mark.slow
@pytest.mark.parametrize("compact", [False, True])
def test_default_method_leaves_the_tg_loss_unchanged(compact):
    # BEFORE was recorded with the reverse KL over the token mean (lambda 0.5).
    cfg = _config(**{"tg.kind": "reverse", "tg.normalize": "token_mean"})
    assert cfg.tg.method == "tg"
    batch = _batch(_trajectories(), compact=compact)
    loss, sums, grads = _loss_and_grad(cfg, batch)
    sq = float(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads)))
    np.testing.assert_allclose(float(loss), BEFORE[compact][0], rtol=1e-4)
    np.testing.assert_allclose(sq, BEFORE[compact][1], rtol=2e-6)
    assert sums["tg_loss"] > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize(
    "method,gate",
    [("sdpo", "all_turns"), ("sdar", "failed_turns"), ("sgcd", "failed_turns")],
)
def test_compact_teacher_rows_equal_full_rows(method, gate):
    """The peers' per-token terms through compact teacher rows (D at the teacher slots,
    `slot_divergence`, where they are few) give the loss and gradients of full rows."""
    from tests.test_train_step import _tree_close
    from tg_jax.rl.tg.teacher import divergence_at_slots

    over = {"tg.method": method, "tg.gate": gate, "tg.peer_estimator": "topk", "tg.peer_top_k": 4,
            "tg.normalize": "token_mean"}  # fmt: skip
    cfg = _config(**over)
    trajs = [  # turn 0 fails in every fourth row: few compact rows
        dataclasses.replace(t, turn_verdicts=[{"fence": i % 4 != 0}, {"fence": True}])
        for i, t in enumerate(_trajectories())
    ]
    full = _batch(trajs, gate=gate)
    compact = _batch(trajs, gate=gate, compact=True)
    assert divergence_at_slots(compact) == (gate == "failed_turns")
    loss_a, sums_a, grads_a = _loss_and_grad(cfg, full)
    loss_b, sums_b, grads_b = _loss_and_grad(cfg, compact)
    assert sums_a["tg_loss"] > 1e-5 if method != "sgcd" else sums_a["sgcd_weight_mean"] != 1.0
    for k in sums_a:
        np.testing.assert_allclose(sums_a[k], sums_b[k], rtol=1e-5, atol=1e-7, err_msg=k)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6, atol=1e-7)
    _tree_close(grads_a, grads_b, atol=1e-6, rtol=1e-4)
