"""The attention core (`tg_jax.models.attention.attend`) against a numpy reference, in both key
layouts, with query blocks and the causal key limit; and the one-core rule: no other module
computes a softmax over attention scores."""

import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

from tg_jax.models.attention import attend

B, T, S0, N, K, H = 2, 7, 3, 4, 2, 8  # S0 prefix slots before the T block slots


def _numpy_attention(q, k, v, visible):
    """q [B, T, N, H], k / v [B, S, K, H], visible [B, T, S]: float64, head n reads kv n // G."""
    g = q.shape[2] // k.shape[2]
    k_n, v_n = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # [B, S, N, H]
    scores = np.einsum("btnh,bsnh->bnts", q, k_n) / np.sqrt(q.shape[-1])
    scores = np.where(visible[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", probs, v_n)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, N, H)).astype(np.float32)
    k = rng.normal(size=(B, S0 + T, K, H)).astype(np.float32)
    v = rng.normal(size=(B, S0 + T, K, H)).astype(np.float32)
    # Row 0 sees the whole prefix, row 1 its first slot only; block token j sees block slots
    # <= j (slot S0 + j): a causal block after a prefix, as the TG teacher's.
    prefix = np.array([S0, 1])
    slot = np.arange(S0 + T)[None, None, :]
    visible = np.where(slot < S0, slot < prefix[:, None, None], slot - S0 <= np.arange(T)[:, None])
    return q, k, v, visible


@pytest.mark.slow
@pytest.mark.parametrize("slot_minor", [False, True], ids=["BSKH", "slot_minor"])
@pytest.mark.parametrize("block,causal", [(0, None), (3, None), (3, S0), (2, S0), (100, S0)])
def test_attend_equals_numpy(slot_minor, block, causal):
    q, k, v, visible = _inputs()
    want = _numpy_attention(q.astype(np.float64), k, v, visible)
    keys, values = k, v
    if slot_minor:
        keys, values = np.transpose(k, (0, 2, 3, 1)), np.transpose(v, (0, 2, 1, 3))
    got = attend(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values), jnp.asarray(visible),
                 dtype=jnp.float32, slot_minor=slot_minor, query_block=block,
                 causal_keys=causal)  # fmt: skip
    assert got.shape == (B, T, N, H) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_mask_function_is_called_per_block_over_the_scored_keys():
    q, k, v, visible = _inputs(1)
    calls = []

    def visible_fn(lo, hi, s):
        calls.append((lo, hi, s))
        return jnp.asarray(visible[:, lo:hi, :s])

    got = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), visible_fn, dtype=jnp.float32,
                 query_block=3, causal_keys=S0)  # fmt: skip
    # Blocks [0, 3), [3, 6), [6, 7) score keys [0, S0 + hi).
    assert calls == [(0, 3, S0 + 3), (3, 6, S0 + 6), (6, 7, S0 + 7)]
    np.testing.assert_allclose(got, _numpy_attention(q, k, v, visible), rtol=1e-5, atol=1e-6)


def test_a_masked_slot_changes_nothing_and_bf16_keeps_fp32_scores():
    q, k, v, visible = _inputs(2)
    hidden = visible.copy()
    hidden[:, :, 0] = False  # slot 0 hidden from every query: its key and value are ignored
    k2, v2 = k.copy(), v.copy()
    k2[:, 0], v2[:, 0] = 1e4, -1e4  # finite: a hidden slot weighs exactly 0
    out = attend(jnp.asarray(q), jnp.asarray(k2), jnp.asarray(v2), jnp.asarray(hidden),
                 dtype=jnp.float32)  # fmt: skip
    np.testing.assert_allclose(out, _numpy_attention(q, k, v, hidden), rtol=1e-5, atol=1e-6)
    out_bf16 = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(visible),
                      dtype=jnp.bfloat16)  # fmt: skip
    assert out_bf16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out_bf16, np.float32),
                               _numpy_attention(q, k, v, visible), atol=0.05)  # fmt: skip


def test_no_other_attention_softmax_in_the_package():
    """One attention implementation: the only softmax over scores is the core's."""
    root = pathlib.Path(__file__).resolve().parents[1] / "tg_jax"
    found = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if re.search(r"softmax\(\s*scores", p.read_text())
    ]
    assert found == ["models/attention.py"], found
