"""MoE router replay (R3): the trainer's forward routes each token to recorded experts.

Checked against a numpy reference of the replayed block, against the model's own routing
(replaying it changes nothing), and where the routing differs (the logits and the loss move).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_moe import CFG, _numpy_moe
from tg_jax.models import ModelConfig, Transformer, init_params
from tg_jax.models import moe as moe_lib
from tg_jax.models.qwen3 import forward

MODEL = ModelConfig(**CFG)


@pytest.fixture(scope="module")
def setup():
    model = Transformer(MODEL)
    params = init_params(model, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, MODEL.vocab_size, (2, 12))
    return model, params, tokens


def _routing(model, params, tokens, replay=None):
    """(logits, the experts each layer routed to [B, T, L, K])."""
    logits, state = model.apply(
        {"params": params}, tokens, replay_BxTxLxJ=replay, mutable=["intermediates"]
    )
    (ids,) = [v for p, v in jax.tree_util.tree_leaves_with_path(state)
              if "router_ids" in jax.tree_util.keystr(p)]  # fmt: skip
    return np.asarray(logits), np.moveaxis(np.asarray(ids), 0, 2)  # [L, B, T, K] -> [B, T, L, K]


def _shuffled(ids, seed):
    """Other experts for every token: each layer's choice shifted by a random non-zero offset."""
    off = np.random.default_rng(seed).integers(1, MODEL.num_experts, ids.shape[:-1] + (1,))
    return (ids + off) % MODEL.num_experts


@pytest.mark.slow
def test_replaying_the_own_routing_changes_nothing(setup):
    model, params, tokens = setup
    logits, ids = _routing(model, params, tokens)
    replayed, ids2 = _routing(model, params, tokens, jnp.asarray(ids))
    np.testing.assert_array_equal(ids2, ids)
    np.testing.assert_allclose(replayed, logits, atol=1e-6)


def test_replayed_experts_are_the_routing_and_move_the_logits(setup):
    """Other experts replayed: the forward routes by them (captured ids) and its logits move;
    tokens given -1 keep the router's own choice (row 1's first 5: causally before any
    replayed token, so their routing and logits are the unreplayed ones)."""
    model, params, tokens = setup
    logits, own = _routing(model, params, tokens)
    other = _shuffled(own, 1)
    other[1, :5] = -1
    got_logits, got = _routing(model, params, tokens, jnp.asarray(other))
    np.testing.assert_array_equal(got[0], other[0])
    np.testing.assert_array_equal(got[1, 5:], other[1, 5:])
    np.testing.assert_array_equal(got[1, :5], own[1, :5])
    np.testing.assert_allclose(got_logits[1, :5], logits[1, :5], atol=1e-5)
    assert np.abs(got_logits[0] - logits[0]).max() > 1e-3
    assert np.abs(got_logits[1, 5:] - logits[1, 5:]).max() > 1e-3


@pytest.mark.parametrize("norm", [True, False])
def test_replayed_block_matches_numpy(norm):
    """One MoE block with replayed experts against numpy: weights = the router's probabilities
    at the replayed experts (renormalised when norm_topk_prob)."""
    cfg = ModelConfig(**{**CFG, "norm_topk_prob": norm})
    block = moe_lib.MoE(cfg)
    x = jax.random.normal(jax.random.key(1), (1, 6, cfg.d_model))
    p = block.init(jax.random.key(2), x)["params"]
    p = jax.tree.map(lambda a: getattr(a, "value", a), p, is_leaf=lambda a: hasattr(a, "value"))
    replay = np.asarray([[[3, 5], [0, 1], [7, 2], [4, 4], [6, 0], [1, 3]]])
    y = np.asarray(block.apply({"params": p}, x, jnp.asarray(replay)))[0]
    xn = np.asarray(x[0], np.float64)
    logits = xn @ np.asarray(p["router"], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.zeros_like(xn)
    for n, top in enumerate(replay[0]):
        w = probs[n, top] / (probs[n, top].sum() if norm else 1.0)
        for e, we in zip(top, w, strict=True):
            g = xn[n] @ np.asarray(p["gate_proj"][e], np.float64)
            u = xn[n] @ np.asarray(p["up_proj"][e], np.float64)
            want[n] += we * ((g / (1 + np.exp(-g)) * u) @ np.asarray(p["down_proj"][e], np.float64))
    np.testing.assert_allclose(y, want, atol=1e-4)
    # Its own routing replayed: the unreplayed block (the numpy reference of test_moe).
    own = np.asarray(block.apply({"params": p}, x))[0]
    np.testing.assert_allclose(own, _numpy_moe(x[0], p, cfg.experts_per_token, norm), atol=1e-4)


@pytest.mark.slow
def test_replay_changes_the_loss_and_reaches_the_router(setup):
    """A token-level NLL with replayed (other) experts differs from the unreplayed one; its
    gradient reaches the router (through the replayed experts' probabilities)."""
    model, params, tokens = setup
    _, own = _routing(model, params, tokens)
    other = jnp.asarray(_shuffled(own, 2))

    def nll(p, replay):
        logits = forward(model, p, tokens, replay_BxTxLxJ=replay)
        logp = jax.nn.log_softmax(logits[:, :-1], -1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

    base, replayed = nll(params, None), nll(params, other)
    assert abs(float(replayed) - float(base)) > 1e-4
    np.testing.assert_allclose(float(nll(params, jnp.asarray(own))), float(base), atol=1e-6)
    grads = jax.grad(nll)(params, other)
    assert float(jnp.abs(grads["layers"]["mlp"]["router"]).max()) > 0


@pytest.mark.slow
def test_replay_on_a_dense_model_is_refused():
    cfg = ModelConfig(**{**CFG, "num_experts": 0, "experts_per_token": 0, "mlp_dim": 32})
    model = Transformer(cfg)
    params = init_params(model, jax.random.key(0))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        forward(model, params, np.zeros((1, 4), np.int32), replay_BxTxLxJ=np.zeros((1, 4, 2, 2)))
