"""PPO surrogate, dual clip, TIS, aggregation and reference KL against numpy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tg_jax.rl import policy_loss as pl


def _np_token_loss_and_grad(lp, lb, adv, cl, ch, c, lprox, cap):
    """Per-token loss and d loss / d lp, written branch by branch (no clip/min/max tricks)."""
    prox = lb if lprox is None else lprox
    r = np.exp(lp - prox)
    w = 1.0 if cap is None else min(np.exp(prox - lb), cap)
    if adv >= 0:
        if r > 1 + ch and adv > 0:
            loss, grad = -adv * (1 + ch), 0.0
        else:
            loss, grad = -adv * r, -adv * r
    else:
        if r < 1 - cl:
            loss, grad = -adv * (1 - cl), 0.0
        else:
            loss, grad = -adv * r, -adv * r
        if c is not None and r > c:
            loss, grad = -adv * c, 0.0
    return loss * w, grad * w


def _np_aggregate_weights(mask, mode, norm_length):
    """d aggregate / d loss_t for each token (the aggregation is linear in the losses)."""
    mask = mask.astype(np.float64)
    if mode == "token_mean":
        return mask / max(mask.sum(), 1)
    n_seq = max((mask.sum(-1) > 0).sum(), 1)
    if mode == "seq_mean_token_mean":
        return mask / np.maximum(mask.sum(-1, keepdims=True), 1) / n_seq
    length = mask.shape[-1] if norm_length is None else norm_length
    return mask / length / n_seq


def test_hand_computed_clipping():
    # A = +1, ratios 0.5, 1, 1.5, 3 -> losses -0.5, -1, -1.2, -1.2 (upper clip at 1.2).
    lp = jnp.log(jnp.array([[0.5, 1.0, 1.5, 3.0]]))
    zeros = jnp.zeros((1, 4))
    mask = jnp.ones((1, 4), bool)
    loss, m = pl.ppo_loss(lp, zeros, jnp.array([1.0]), mask)
    np.testing.assert_allclose(loss, -0.975, rtol=1e-6)
    np.testing.assert_allclose(m.clip_frac_high, 0.5)
    np.testing.assert_allclose(m.clip_frac_low, 0.0)
    np.testing.assert_allclose(m.ratio_mean, 1.5, rtol=1e-6)
    np.testing.assert_allclose(m.ratio_max, 3.0, rtol=1e-6)
    # The clipped tokens get no gradient; the others get -A r / 4.
    g = jax.grad(lambda x: pl.ppo_loss(x, zeros, jnp.array([1.0]), mask)[0])(lp)
    np.testing.assert_allclose(g, [[-0.125, -0.25, 0.0, 0.0]], rtol=1e-6)
    # A = -1 with dual clip c = 2: ratio 0.5 -> lower clip 0.8; 3 -> bounded at 2.
    loss, m = pl.ppo_loss(lp, zeros, jnp.array([-1.0]), mask, dual_clip=2.0)
    np.testing.assert_allclose(loss, (0.8 + 1.0 + 1.5 + 2.0) / 4, rtol=1e-6)
    np.testing.assert_allclose(m.clip_frac_low, 0.25)
    np.testing.assert_allclose(m.dual_clip_frac, 0.25)
    g = jax.grad(lambda x: pl.ppo_loss(x, zeros, jnp.array([-1.0]), mask, dual_clip=2.0)[0])(lp)
    np.testing.assert_allclose(g, [[0.0, 0.25, 0.375, 0.0]], rtol=1e-6)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_aggregation_by_hand(mode):
    loss = jnp.array([[1.0, 2.0, 3.0, 4.0], [10.0, 0.0, 0.0, 0.0], [np.nan, 5.0, 5.0, 5.0]])
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool)  # an empty padding row
    want = {
        "token_mean": (1 + 2 + 3 + 10) / 4,
        "seq_mean_token_mean": (2 + 10) / 2,
        "seq_mean_token_sum_norm": (6 / 4 + 10 / 4) / 2,  # L defaults to T = 4
    }[mode]
    np.testing.assert_allclose(pl.aggregate(loss, mask, mode), want, rtol=1e-6)
    assert float(pl.aggregate(loss, jnp.zeros_like(mask), mode)) == 0.0
    if mode == "seq_mean_token_sum_norm":
        np.testing.assert_allclose(pl.aggregate(loss, mask, mode, norm_length=8), want / 2)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize(
    "cl,ch,c,cap,proximal",
    [(0.2, 0.2, None, None, False), (0.2, 0.28, 3.0, None, False), (0.1, 0.3, 2.0, 1.5, True)],
)
def test_random_vs_numpy(mode, cl, ch, c, cap, proximal):
    rng = np.random.default_rng(1)
    b, t = 3, 7
    lb = rng.normal(-2.0, 0.5, (b, t)).astype(np.float32)
    lp = (lb + rng.uniform(-1.5, 1.5, (b, t))).astype(np.float32)
    lprox = (lb + rng.uniform(-1.0, 1.0, (b, t))).astype(np.float32) if proximal else None
    adv = np.array([1.3, -0.7, -2.0], np.float32)
    mask = rng.random((b, t)) > 0.25
    mask[2, :] = mask[2, :] | (np.arange(t) < 2)
    norm_length = 10 if mode == "seq_mean_token_sum_norm" else None
    fn = functools.partial(
        pl.ppo_loss,
        clip_low=cl,
        clip_high=ch,
        dual_clip=c,
        tis_cap=cap,
        agg_mode=mode,
        norm_length=norm_length,
    )
    (loss, m), grad = jax.value_and_grad(
        lambda x: fn(x, lb, adv, mask, logp_proximal_BxT=lprox), has_aux=True
    )(lp)

    tok_loss = np.zeros((b, t))
    tok_grad = np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            tok_loss[i, j], tok_grad[i, j] = _np_token_loss_and_grad(
                lp[i, j], lb[i, j], adv[i], cl, ch, c, None if lprox is None else lprox[i, j], cap
            )
    agg_w = _np_aggregate_weights(mask, mode, norm_length)
    np.testing.assert_allclose(loss, (agg_w * tok_loss).sum(), rtol=1e-5)
    np.testing.assert_allclose(grad, agg_w * tok_grad, rtol=1e-5, atol=1e-7)

    prox = lb if lprox is None else lprox
    r = np.exp(lp - prox)[mask]
    a = np.broadcast_to(adv[:, None], (b, t))[mask]
    np.testing.assert_allclose(m.clip_frac_low, np.mean((a < 0) & (r < 1 - cl)), rtol=1e-6)
    np.testing.assert_allclose(m.clip_frac_high, np.mean((a > 0) & (r > 1 + ch)), rtol=1e-6)
    want_dual = 0.0 if c is None else np.mean((a < 0) & (r > c))
    np.testing.assert_allclose(m.dual_clip_frac, want_dual, rtol=1e-6)
    np.testing.assert_allclose(m.ratio_mean, r.mean(), rtol=1e-5)
    np.testing.assert_allclose(m.ratio_max, r.max(), rtol=1e-5)
    np.testing.assert_allclose(m.approx_kl, np.mean(r - 1 - np.log(r)), rtol=1e-4)
    if cap is not None:
        w = np.minimum(np.exp(prox - lb), cap)[mask]
        np.testing.assert_allclose(m.tis_weight_mean, w.mean(), rtol=1e-5)
        assert np.any(w == cap) and np.any(w < cap)  # both sides of the cap are exercised
    assert m.clip_frac_high > 0 and m.clip_frac_low > 0
    assert c is None or m.dual_clip_frac > 0


def test_kl_estimators_by_hand_and_expectation():
    # log rho = log(0.25 / 0.5) = -log 2.
    lp = jnp.log(jnp.array([[0.5]]))
    lr = jnp.log(jnp.array([[0.25]]))
    np.testing.assert_allclose(pl.kl_to_reference(lp, lr, "k1"), [[np.log(2)]], rtol=1e-6)
    np.testing.assert_allclose(pl.kl_to_reference(lp, lr, "k2"), [[0.5 * np.log(2) ** 2]], 1e-6)
    np.testing.assert_allclose(pl.kl_to_reference(lp, lr, "k3"), [[np.log(2) - 0.5]], 1e-6)
    # k1 and k3 are unbiased: E_{y~p}[k(y)] = KL(p || q), computed by enumerating y.
    p = np.array([0.1, 0.2, 0.3, 0.4])
    q = np.array([0.4, 0.3, 0.2, 0.1])
    kl = np.sum(p * np.log(p / q))
    for est in ("k1", "k3"):
        k = pl.kl_to_reference(jnp.log(p)[None], jnp.log(q)[None], est)[0]
        np.testing.assert_allclose(np.sum(p * np.asarray(k)), kl, rtol=1e-5)
    # The gradient of k3 w.r.t. logp is 1 - rho; the reference gets none.
    gp, gr = jax.grad(lambda a, b: pl.kl_to_reference(a, b, "k3").sum(), argnums=(0, 1))(lp, lr)
    np.testing.assert_allclose(gp, [[0.5]], rtol=1e-6)
    assert float(gr[0, 0]) == 0.0


def test_reference_kl_term_added():
    rng = np.random.default_rng(2)
    lp = rng.normal(-2, 0.3, (2, 5)).astype(np.float32)
    lref = (lp + rng.normal(0, 0.3, (2, 5))).astype(np.float32)
    mask = np.ones((2, 5), bool)
    mask[1, 3:] = False
    adv = np.array([1.0, -1.0], np.float32)
    base, _ = pl.ppo_loss(lp, lp, adv, mask)
    loss, m = pl.ppo_loss(lp, lp, adv, mask, logp_ref_BxT=lref, kl_coef=0.1, kl_estimator="k3")
    log_rho = (lref - lp)[mask]
    want_kl = np.mean(np.exp(log_rho) - 1 - log_rho)
    np.testing.assert_allclose(m.kl_loss, want_kl, rtol=1e-5)
    np.testing.assert_allclose(loss, base + 0.1 * want_kl, rtol=1e-5)
    # On policy (ratio 1): 5 tokens with A = +1 (loss -1 each), 3 with A = -1 (loss +1 each).
    np.testing.assert_allclose(m.pg_loss, -(5 * 1.0 - 3 * 1.0) / 8, rtol=1e-6)


def test_errors():
    x = jnp.zeros((1, 2))
    with pytest.raises(ValueError):
        pl.ppo_loss(x, x, jnp.ones((1,)), x > -1, tis_cap=2.0)
    with pytest.raises(ValueError):
        pl.ppo_loss(x, x, jnp.ones((1,)), x > -1, dual_clip=1.0)
