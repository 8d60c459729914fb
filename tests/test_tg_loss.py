"""Targeted-guidance loss: divergences vs numpy, estimators, chunking, masks, loss, schedule."""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tg_jax.rl.step_config import TGConfig
from tg_jax.rl.tg import divergence as tg
from tg_jax.rl.tg import loss as tg_loss
from tg_jax.rl.tg.mask import tg_mask

KINDS = ("reverse", "forward", "jsd")


# --- numpy references (float64) --------------------------------------------------------------


def _np_log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _np_div_from_probs(ps, pt, kind, beta=0.5):
    def kl(p, q):
        return np.sum(np.where(p > 0, p * (np.log(np.maximum(p, 1e-300)) - np.log(q)), 0.0), -1)

    if kind == "reverse":
        return kl(ps, pt)
    if kind == "forward":
        return kl(pt, ps)
    m = beta * pt + (1 - beta) * ps
    return beta * kl(pt, m) + (1 - beta) * kl(ps, m)


def _np_div(zs, zt, kind, beta=0.5):
    return _np_div_from_probs(np.exp(_np_log_softmax(zs)), np.exp(_np_log_softmax(zt)), kind, beta)


def _np_grad_fd(zs, zt, kind, beta=0.5, h=1e-6):
    """Central finite differences of sum(D) w.r.t. the student logits, in float64."""
    zs = np.asarray(zs, np.float64)
    grad = np.zeros_like(zs)
    for idx in np.ndindex(zs.shape):
        up, down = zs.copy(), zs.copy()
        up[idx] += h
        down[idx] -= h
        grad[idx] = (_np_div(up, zt, kind, beta).sum() - _np_div(down, zt, kind, beta).sum()) / (
            2 * h
        )
    return grad


def _logits(seed, shape, scale=2.0):
    return (np.random.default_rng(seed).normal(size=shape) * scale).astype(np.float32)


# --- step 3: divergences ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_divergence_vs_numpy_and_gradient(kind):
    zs, zt = _logits(0, (2, 3, 7)), _logits(1, (2, 3, 7))
    beta = 0.3
    d, (gs, gt) = jax.value_and_grad(
        lambda a, b: tg.token_divergence(a, b, kind=kind, beta=beta).sum(), argnums=(0, 1)
    )(zs, zt)
    d_tok = tg.token_divergence(zs, zt, kind=kind, beta=beta)
    assert d_tok.shape == (2, 3) and d_tok.dtype == jnp.float32
    np.testing.assert_allclose(d_tok, _np_div(zs, zt, kind, beta), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(gs, _np_grad_fd(zs, zt, kind, beta), rtol=1e-4, atol=1e-6)
    assert np.all(np.asarray(gt) == 0.0)  # the teacher is stop-gradiented


def test_divergence_analytic_gradients():
    # d KL(p_s||p_t) / dz_j = p_s,j (log p_s,j - log p_t,j - KL)
    # d KL(p_t||p_s) / dz_j = p_s,j - p_t,j
    zs, zt = _logits(2, (4, 5)), _logits(3, (4, 5))
    ls, lt = _np_log_softmax(zs), _np_log_softmax(zt)
    ps, pt = np.exp(ls), np.exp(lt)
    kl = (ps * (ls - lt)).sum(-1, keepdims=True)
    g_rev = jax.grad(lambda a: tg.token_divergence(a, zt, kind="reverse").sum())(zs)
    np.testing.assert_allclose(g_rev, ps * (ls - lt - kl), rtol=1e-5, atol=1e-7)
    g_fwd = jax.grad(lambda a: tg.token_divergence(a, zt, kind="forward").sum())(zs)
    np.testing.assert_allclose(g_fwd, ps - pt, rtol=1e-5, atol=1e-7)


def test_only_the_forward_kl_moves_a_confident_decision_token():
    # The default's decision token: the student (base model) puts 1 - 2 eps on its own format
    # (token 0), the hinted teacher 1 - 2 eps on the other (token 1). The forward KL's logit
    # gradient is p_s - p_t, about -1 on the teacher's token whatever eps; the reverse KL's
    # and the JSD's scale with eps (times log 1/eps): the reason for configs/default.py's TG.
    eps = 1e-4
    student = jnp.log(jnp.array([[1 - 2 * eps, eps, eps]]))
    teacher = jnp.log(jnp.array([[eps, 1 - 2 * eps, eps]]))
    grads = {
        kind: np.asarray(
            jax.grad(lambda a, k=kind: tg.token_divergence(a, teacher, kind=k).sum())(student)
        )[0]
        for kind in KINDS
    }
    np.testing.assert_allclose(grads["forward"], [1 - 3 * eps, -(1 - 3 * eps), 0.0], atol=1e-6)
    ls, lt = np.asarray(student[0], np.float64), np.asarray(teacher[0], np.float64)
    ps = np.exp(ls)  # reverse KL: p_s,j (log p_s,j - log p_t,j - KL)
    np.testing.assert_allclose(
        grads["reverse"], ps * (ls - lt - (ps * (ls - lt)).sum()), rtol=1e-3, atol=1e-7
    )
    assert abs(grads["reverse"][1]) < 20 * eps and abs(grads["jsd"][1]) < 20 * eps
    assert abs(grads["forward"][1]) > 50 * max(abs(grads["reverse"][1]), abs(grads["jsd"][1]))


def test_divergence_known_values():
    z = _logits(4, (3, 6))
    for kind in KINDS:  # D(p, p) = 0
        np.testing.assert_allclose(tg.token_divergence(z, z, kind=kind), 0.0, atol=1e-6)
    # p_s = (1/2, 1/2), p_t = (3/4, 1/4).
    zs = jnp.array([0.0, 0.0])
    zt = jnp.log(jnp.array([3.0, 1.0]))
    rev = tg.token_divergence(zs, zt, kind="reverse")
    np.testing.assert_allclose(rev, 0.5 * np.log(4 / 3), rtol=1e-6)
    fwd = 0.75 * np.log(1.5) + 0.25 * np.log(0.5)
    np.testing.assert_allclose(tg.token_divergence(zs, zt, kind="forward"), fwd, rtol=1e-6)
    # m = (5/8, 3/8).
    jsd = 0.5 * (0.75 * np.log(0.75 / 0.625) + 0.25 * np.log(0.25 / 0.375)) + 0.5 * (
        0.5 * np.log(0.5 / 0.625) + 0.5 * np.log(0.5 / 0.375)
    )
    np.testing.assert_allclose(tg.token_divergence(zs, zt, kind="jsd"), jsd, rtol=1e-5)
    # Disjoint supports: JSD_0.5 reaches its bound log 2.
    far = tg.token_divergence(jnp.array([30.0, -30.0]), jnp.array([-30.0, 30.0]), kind="jsd")
    np.testing.assert_allclose(far, np.log(2), rtol=1e-5)


def test_jsd_limits():
    zs, zt = _logits(5, (3, 6)), _logits(6, (3, 6))
    rev = np.asarray(tg.token_divergence(zs, zt, kind="reverse"))
    fwd = np.asarray(tg.token_divergence(zs, zt, kind="forward"))
    b = 1e-3
    lo = np.asarray(tg.token_divergence(zs, zt, kind="jsd", beta=b)) / b
    hi = np.asarray(tg.token_divergence(zs, zt, kind="jsd", beta=1 - b)) / b
    np.testing.assert_allclose(lo, fwd, rtol=2e-2)
    np.testing.assert_allclose(hi, rev, rtol=2e-2)
    with pytest.raises(ValueError):
        tg.token_divergence(zs, zt, kind="jsd", beta=0.0)


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_estimator_exact_expectation(kind):
    # Enumerate every token y: sum_y p_s(y) D(y) must equal the full divergence, and
    # sum_y p_s(y) grad D(y) its full gradient (the score-function term makes that hold).
    vocab = 6
    zs, zt = _logits(7, (vocab,)), _logits(8, (vocab,))
    ps = np.exp(_np_log_softmax(zs))
    tokens = jnp.arange(vocab)
    zs_rows = jnp.broadcast_to(jnp.asarray(zs), (vocab, vocab))
    zt_rows = jnp.broadcast_to(jnp.asarray(zt), (vocab, vocab))

    def sampled(z):
        return tg.token_divergence(
            z, zt_rows, kind=kind, beta=0.3, estimator="sampled", sampled_token=tokens
        )

    values = sampled(zs_rows)
    grads = jax.jacrev(lambda z: sampled(z))(zs_rows)  # [y, y', V]; row y only touches z[y]
    grads = np.asarray(grads)[np.arange(vocab), np.arange(vocab)]  # [y, V]
    full = tg.token_divergence(zs, zt, kind=kind, beta=0.3)
    full_grad = jax.grad(lambda z: tg.token_divergence(z, zt, kind=kind, beta=0.3))(zs)
    np.testing.assert_allclose((ps * np.asarray(values)).sum(), full, rtol=1e-5)
    np.testing.assert_allclose((ps[:, None] * grads).sum(0), full_grad, rtol=1e-4, atol=1e-6)
    if kind == "reverse":
        ls, lt = _np_log_softmax(zs), _np_log_softmax(zt)
        np.testing.assert_allclose(values, ls - lt, rtol=1e-5, atol=1e-6)
        # Without the score-function term the expected gradient would be sum_y p(y) grad log
        # p(y) = 0; the actual expected gradient is not 0.
        assert np.abs(np.asarray(full_grad)).max() > 1e-2


def test_sampled_estimator_monte_carlo():
    vocab, n = 8, 20000
    zs, zt = _logits(9, (vocab,), 1.0), _logits(10, (vocab,), 1.0)
    y = jax.random.categorical(jax.random.key(0), jnp.asarray(zs), shape=(n,))
    zt_n = jnp.broadcast_to(jnp.asarray(zt), (n, vocab))

    def mean_estimate(z):
        return tg.token_divergence(
            z, zt_n, kind="reverse", estimator="sampled", sampled_token=y
        ).mean()

    value, grad = jax.value_and_grad(lambda z: mean_estimate(jnp.broadcast_to(z, (n, vocab))))(
        jnp.asarray(zs)
    )
    full, full_grad = jax.value_and_grad(lambda z: tg.token_divergence(z, zt, kind="reverse"))(
        jnp.asarray(zs)
    )
    ls, lt = _np_log_softmax(zs), _np_log_softmax(zt)
    per_sample = (ls - lt)[np.asarray(y)]
    stderr = per_sample.std() / np.sqrt(n)
    assert abs(float(value) - float(full)) < 4 * stderr
    np.testing.assert_allclose(grad, full_grad, atol=0.05)


@pytest.mark.slow
def test_top_k_tail():
    # p_s = (.5, .3, .1, .1), p_t uniform, k = 2 -> buckets (.5, .3, .2) vs (.25, .25, .5).
    zs = jnp.log(jnp.array([0.5, 0.3, 0.1, 0.1]))
    zt = jnp.zeros(4)
    want = 0.5 * np.log(2) + 0.3 * np.log(1.2) + 0.2 * np.log(0.4)
    got = tg.token_divergence(zs, zt, kind="reverse", top_k=2)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    zs, zt = _logits(11, (3, 4, 9)), _logits(12, (3, 4, 9))

    @functools.partial(jax.jit, static_argnames=("kind", "top_k"))
    def div_and_grad(a, kind, top_k):
        def total(x):
            d = tg.token_divergence(x, zt, kind=kind, top_k=top_k)
            return d.sum(), d

        (_, d), g = jax.value_and_grad(total, has_aux=True)(a)
        return d, g

    for kind in KINDS:
        full, g_full = div_and_grad(zs, kind, None)
        exact, g_exact = div_and_grad(zs, kind, 9)
        np.testing.assert_allclose(exact, full, rtol=1e-5, atol=1e-7)
        assert np.all(np.isfinite(g_exact))
        np.testing.assert_allclose(g_exact, g_full, rtol=1e-4, atol=1e-6)
        approx, _ = div_and_grad(zs, kind, 3)
        # Lumping tokens together can only lower an f-divergence.
        assert np.all(np.asarray(approx) <= np.asarray(full) + 1e-6)
        # A numpy version of the buckets.
        ps, pt = np.exp(_np_log_softmax(zs)), np.exp(_np_log_softmax(zt))
        idx = np.argsort(-ps, -1)[..., :3]
        bs = np.take_along_axis(ps, idx, -1)
        bt = np.take_along_axis(pt, idx, -1)
        bs = np.concatenate([bs, 1 - bs.sum(-1, keepdims=True)], -1)
        bt = np.concatenate([bt, 1 - bt.sum(-1, keepdims=True)], -1)
        np.testing.assert_allclose(approx, _np_div_from_probs(bs, bt, kind), rtol=1e-4)


def test_minus_inf_logits_stay_finite():
    zs = jnp.array([0.0, 1.0, -jnp.inf])
    zt = jnp.array([0.5, -jnp.inf, -jnp.inf])
    d, g = jax.value_and_grad(lambda a: tg.token_divergence(a, zs, kind="jsd"))(zs)
    assert abs(float(d)) < 1e-6 and np.all(np.isfinite(g))
    g = jax.grad(lambda a: tg.token_divergence(a, zt, kind="forward"))(zs)
    assert np.all(np.isfinite(g))


# --- step 2: chunked statistics --------------------------------------------------------------


def _unchunked_stats(hidden, targets, w, teacher_hidden, w_teacher, **div):
    logits = (hidden @ w).astype(jnp.float32)
    log_p = jax.nn.log_softmax(logits, -1)
    logprob = jnp.take_along_axis(log_p, targets[..., None], -1)[..., 0]
    entropy = -(jnp.exp(log_p) * log_p).sum(-1)
    # The teacher's unembedding is a separate constant here: no gradient may reach w through it.
    d = tg.token_divergence(logits, teacher_hidden @ w_teacher, sampled_token=targets, **div)
    return logprob, entropy, d


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size", [4, 5, 12, 100])
@pytest.mark.parametrize(
    "div",
    [
        dict(kind="reverse"),
        dict(kind="jsd", beta=0.2),
        dict(kind="forward", top_k=4),
        dict(kind="reverse", estimator="sampled"),
    ],
    ids=["reverse", "jsd", "forward_topk", "sampled"],
)
def test_chunked_equals_unchunked(chunk_size, div):
    b, t, d, v = 2, 12, 8, 11
    rng = np.random.default_rng(13)
    hidden = rng.normal(size=(b, t, d)).astype(np.float32)
    teacher = rng.normal(size=(b, t, d)).astype(np.float32)
    w = rng.normal(size=(d, v)).astype(np.float32)
    targets = rng.integers(0, v, size=(b, t))
    coef = [rng.normal(size=(b, t)).astype(np.float32) for _ in range(3)]

    def objective(stats):
        return sum((c * s).sum() for c, s in zip(coef, stats, strict=True))

    def chunked(h, w_, ht):
        stats = tg.chunked_token_stats(
            h, targets, lambda x: x @ w_, teacher_hidden_BxTxD=ht, chunk_size=chunk_size, **div
        )
        return objective(stats), stats

    def reference(h, w_):
        stats = _unchunked_stats(h, targets, w_, teacher, w, **div)
        return objective(stats), stats

    (val, stats), grads = jax.value_and_grad(chunked, argnums=(0, 1, 2), has_aux=True)(
        hidden, w, teacher
    )
    (ref_val, ref_stats), ref_grads = jax.value_and_grad(reference, argnums=(0, 1), has_aux=True)(
        hidden, w
    )
    for got, want in zip(stats, ref_stats, strict=True):
        assert got.shape == (b, t)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(val, ref_val, rtol=1e-5)
    np.testing.assert_allclose(grads[0], ref_grads[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads[1], ref_grads[1], rtol=1e-4, atol=1e-5)
    assert np.all(np.asarray(grads[2]) == 0.0)  # teacher hidden states: exactly no gradient


def test_chunked_without_teacher_and_jit():
    b, t, d, v = 1, 7, 4, 5
    rng = np.random.default_rng(14)
    hidden = rng.normal(size=(b, t, d)).astype(np.float32)
    w = rng.normal(size=(d, v)).astype(np.float32)
    targets = rng.integers(0, v, size=(b, t))
    fn = jax.jit(lambda h: tg.chunked_token_stats(h, targets, lambda x: x @ w, chunk_size=3))
    stats = fn(hidden)
    assert stats.divergence_BxT is None
    log_p = _np_log_softmax(hidden @ w)
    np.testing.assert_allclose(
        stats.logprob_BxT, np.take_along_axis(log_p, targets[..., None], -1)[..., 0], rtol=1e-5
    )
    np.testing.assert_allclose(stats.entropy_BxT, -(np.exp(log_p) * log_p).sum(-1), rtol=1e-5)


# --- step 4: masks ---------------------------------------------------------------------------


def test_tg_mask():
    # prompt | turn 1 (failed): think think ans ans | tool obs | turn 2 (passed): think ans | pad
    loss = np.array([[0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 0]], bool)
    think = np.array([[0, 0, 1, 1, 0, 0, 0, 0, 1, 0, 0]], bool)
    failed = np.array([[0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1]], bool)  # junk outside turns is ignored
    distill = np.array([[1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]], bool)

    def mask(hinted=distill, include_thinking=False, gate="failed_turns"):
        return tg_mask(hinted, think, failed, loss, include_thinking=include_thinking, gate=gate)

    np.testing.assert_array_equal(mask(), [[0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(mask(include_thinking=True), [[0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(mask(gate="all_turns"), [[0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 0]])
    np.testing.assert_array_equal(
        mask(include_thinking=True, gate="all_turns"), [[0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 0]]
    )
    no_teacher = distill.copy()
    no_teacher[0, 5] = False  # e.g. truncated from the teacher sequence
    np.testing.assert_array_equal(mask(no_teacher), [[0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0]])


# --- step 5: loss and schedule ---------------------------------------------------------------


def test_tg_loss_values_and_metrics():
    d = jnp.array([[1.0, 2.0, 3.0, jnp.nan], [4.0, 5.0, 6.0, 7.0]])
    m = jnp.array([[1, 1, 0, 0], [0, 1, 1, 0]], bool)
    assistant = jnp.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool)
    req = jnp.array([[0, 1, 1, -1], [-1, 1, 0, 2]])
    loss, met = tg_loss.tg_loss(
        d, m, 0.5, assistant_mask_BxT=assistant, requirement_ids_BxT=req, num_requirements=3,
        normalize="token_mean",
    )  # fmt: skip
    np.testing.assert_allclose(loss, 0.5 * (1 + 2 + 5 + 6) / 4, rtol=1e-6)
    np.testing.assert_allclose(met.divergence_mean, 14 / 4, rtol=1e-6)
    np.testing.assert_allclose(met.distilled_fraction, 4 / 7, rtol=1e-6)
    assert int(met.num_distilled) == 4
    np.testing.assert_allclose(met.per_requirement_divergence, [(1 + 6) / 2, (2 + 5) / 2, 0.0])
    np.testing.assert_allclose(met.per_requirement_tokens, [2, 2, 0])
    g = jax.grad(lambda x: tg_loss.tg_loss(x, m, 0.5, normalize="token_mean")[0])(d)
    np.testing.assert_allclose(g, 0.5 * np.asarray(m) / 4)


def test_tg_loss_token_sum():
    d = jnp.array([[1.0, 2.0, 3.0, jnp.nan], [4.0, 5.0, 6.0, 7.0]])
    m = jnp.array([[1, 1, 0, 0], [0, 1, 1, 0]], bool)
    # Sum over M = 1 + 2 + 5 + 6 = 14, divided by N = 2 trajectories x norm_length 8 = 16.
    loss, met = tg_loss.tg_loss(d, m, 0.5, normalize="token_sum", norm_constant=16.0)
    np.testing.assert_allclose(loss, 0.5 * 14 / 16, rtol=1e-6)
    np.testing.assert_allclose(met.divergence_mean, 14 / 4, rtol=1e-6)  # still the mean
    g = jax.grad(
        lambda x: tg_loss.tg_loss(x, m, 0.5, normalize="token_sum", norm_constant=16.0)[0]
    )(d)
    np.testing.assert_allclose(g, 0.5 * np.asarray(m) / 16)
    # Half the failed tokens: token_mean keeps the loss (each token weighs more), token_sum
    # halves it (each token keeps its weight).
    half = m.at[1].set(False)
    mean_half, _ = tg_loss.tg_loss(d, half, 0.5, normalize="token_mean")
    sum_half, _ = tg_loss.tg_loss(d, half, 0.5, normalize="token_sum", norm_constant=16.0)
    np.testing.assert_allclose(mean_half, 0.5 * 3 / 2, rtol=1e-6)
    np.testing.assert_allclose(sum_half, 0.5 * 3 / 16, rtol=1e-6)
    empty, _ = tg_loss.tg_loss(d, jnp.zeros_like(m), 0.5, normalize="token_sum", norm_constant=16.0)
    assert float(empty) == 0.0
    with pytest.raises(ValueError, match="normalize"):
        tg_loss.tg_loss(d, m, 0.5, normalize="seq_mean")


def test_tg_loss_empty_mask_is_exactly_zero():
    d = jnp.array([[1.0, jnp.inf], [2.0, 3.0]])
    empty = jnp.zeros((2, 2), bool)
    loss, met = jax.jit(lambda x: tg_loss.tg_loss(x, empty, 3.0, normalize="token_mean"))(d)
    assert float(loss) == 0.0 and float(met.divergence_mean) == 0.0
    g = jax.grad(lambda x: tg_loss.tg_loss(x, empty, 3.0, normalize="token_mean")[0])(d)
    assert np.all(np.asarray(g) == 0.0)


def test_lambda_tg_and_its_schedule():
    def at(steps, lam, **schedule):
        cfg = TGConfig.from_config(
            ml_collections.ConfigDict(dict(lambda_tg=lam, schedule=schedule))
        )
        fn = jax.jit(lambda s: tg_loss.lambda_tg(s, cfg))
        return [float(fn(s)) for s in steps]

    np.testing.assert_allclose(at([0, 7], 0.1, kind="constant"), [0.1, 0.1], rtol=1e-6)
    got = at([0, 5, 10, 50], 0.2, kind="linear_warmup", warmup_steps=10)
    np.testing.assert_allclose(got, [0.0, 0.1, 0.2, 0.2], rtol=1e-6)
    got = at([0, 2, 4, 9, 14, 100], 1.0, kind="cosine", warmup_steps=4, decay_steps=10,
             final_value=0.1)  # fmt: skip
    want = [0.0, 0.5, 1.0, 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 0.5)), 0.1, 0.1]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert TGConfig().lambda_tg == 0.05  # the shipped recipe
    with pytest.raises(ValueError, match="tg.lambda_tg must be >= 0"):
        TGConfig(lambda_tg=-0.1)
