"""The Qwen3 model against Hugging Face transformers, its decode path, masking and remat."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.hf_reference import hf_logits, make_hf_qwen3
from tg_jax.models import (
    ModelConfig,
    Transformer,
    decode_one,
    decode_weights,
    forward,
    init_params,
    prefill,
)
from tg_jax.models.checkpoint_io import params_to_hf


def _cfg(**kw):
    base = dict(
        vocab_size=96, d_model=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        mlp_dim=80, rope_theta=10_000.0, max_seq_len=64,
    )  # fmt: skip
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.slow
@pytest.mark.parametrize(
    "tie,kv_heads",
    [(True, 4), (False, 4), (True, 2), (False, 1)],
    ids=["tied-mha", "untied-mha", "tied-gqa2", "untied-mqa"],
)
def test_logits_match_transformers(tie, kv_heads):
    # head_dim (16) * heads (4) != d_model (48): head_dim is independent, as in Qwen3.
    cfg = _cfg(tie_embeddings=tie, num_kv_heads=kv_heads)
    hf_model, params = make_hf_qwen3(cfg, seed=1)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(3, 21))
    ours = np.asarray(forward(Transformer(cfg), params, jnp.asarray(tokens, jnp.int32)))
    ref = hf_logits(hf_model, tokens)
    assert ours.shape == ref.shape
    assert np.abs(ref).max() > 0.5  # the comparison is not between near-zero logits
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_causal_query_blocks_match_transformers():
    # Blocks of 8 over 21 tokens: 8 + 8 + 5, the last block shorter.
    cfg = _cfg(attn_query_block=8)
    hf_model, params = make_hf_qwen3(cfg, seed=2)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, 21))
    ours = np.asarray(forward(Transformer(cfg), params, jnp.asarray(tokens, jnp.int32)))
    np.testing.assert_allclose(ours, hf_logits(hf_model, tokens), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_causal_query_blocks_equal_one_block_on_packed_rows():
    """Same logits and gradients with and without query blocks: packed segments, padding."""
    params = init_params(Transformer(_cfg()), jax.random.key(8))
    rng = np.random.default_rng(9)
    tokens = jnp.asarray(rng.integers(1, 96, (2, 16)), jnp.int32)
    seg = jnp.asarray([[1] * 6 + [2] * 7 + [0] * 3, [1] * 16])
    pos = jnp.asarray([list(range(6)) + list(range(7)) + [0] * 3, list(range(16))])

    def loss(p, block):
        logits = forward(Transformer(_cfg(attn_query_block=block)), p, tokens, pos, seg)
        return jnp.mean(jnp.where(seg[..., None] > 0, logits, 0.0) ** 2), logits

    (v0, l0), g0 = jax.value_and_grad(loss, has_aux=True)(params, 0)
    (v1, l1), g1 = jax.value_and_grad(loss, has_aux=True)(params, 5)
    real = np.asarray(seg) > 0
    np.testing.assert_allclose(np.asarray(l1)[real], np.asarray(l0)[real], atol=1e-5)
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6), g1, g0)


@pytest.mark.parametrize("moe", [False, True])
def test_hf_round_trip_is_exact(moe):
    """params -> HF tensors -> params, dense and MoE (per-expert tensors, and the fused
    gate_up / down tensors transformers 5 keeps in memory)."""
    from tg_jax.models.checkpoint_io import params_from_tensors

    extra = dict(mlp_dim=0, num_experts=4, experts_per_token=2, moe_mlp_dim=8) if moe else {}
    cfg = _cfg(tie_embeddings=False, **extra)
    params = jax.tree.map(np.asarray, init_params(Transformer(cfg), jax.random.key(0)))
    state = params_to_hf(params, cfg)
    jax.tree.map(np.testing.assert_array_equal, params_from_tensors(state, cfg), params)
    if not moe:
        return
    fused = {k: v for k, v in state.items() if ".experts." not in k}
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}.mlp.experts."
        experts = [{p: state[f"{pre}{j}.{p}_proj.weight"] for p in ("gate", "up", "down")}
                   for j in range(cfg.num_experts)]  # fmt: skip
        fused[pre + "gate_up_proj"] = np.stack(
            [np.concatenate([x["gate"], x["up"]]) for x in experts]
        )
        fused[pre + "down_proj"] = np.stack([x["down"] for x in experts])
    jax.tree.map(np.testing.assert_array_equal, params_from_tensors(fused, cfg), params)


@pytest.mark.slow
def test_kv_cache_decoding_matches_full_forward():
    """The decode path (prefill, then one token per step) gives the full forward's logits."""
    cfg = _cfg()
    model = Transformer(cfg)
    params = init_params(model, jax.random.key(3))
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    full = np.asarray(forward(model, params, tokens))
    n_prompt = 5
    prefill_fn = jax.jit(lambda p, t, n: prefill(model, p, t, n, 12 - n_prompt))
    # Prefill's logits at the last prompt token, for every prompt length: every block position.
    for length in range(1, n_prompt + 1):
        logits, cache = prefill_fn(params, tokens[:, :n_prompt], jnp.full((2,), length, jnp.int32))
        np.testing.assert_allclose(np.asarray(logits), full[:, length - 1], atol=1e-5)
    weights = decode_weights(model, params)
    step_fn = jax.jit(lambda w, t, i, c: decode_one(model, w, t, i, c))
    steps = [np.asarray(logits)]
    for i, t in enumerate(range(n_prompt, 12)):
        logits, cache = step_fn(weights, tokens[:, t], jnp.int32(i), cache)
        steps.append(np.asarray(logits))
    np.testing.assert_allclose(np.stack(steps, axis=1), full[:, n_prompt - 1 :], atol=1e-5)


@pytest.mark.slow
def test_kv_cache_per_row_lengths():
    """Rows with different prompt lengths (right padding) decode like their own full forward."""
    cfg = _cfg()
    model = Transformer(cfg)
    params = init_params(model, jax.random.key(4))
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, cfg.vocab_size, n) for n in (9, 4)]
    lens = np.array([6, 2])
    block = np.zeros((2, 6), np.int32)
    for i, s in enumerate(seqs):
        block[i, : lens[i]] = s[: lens[i]]
    weights = decode_weights(model, params)
    logits, cache = prefill(
        model, params, jnp.asarray(block), jnp.asarray(lens), 10, weights=weights
    )
    got = {0: [np.asarray(logits[0])], 1: [np.asarray(logits[1])]}
    # Feed each row's next true token (at its own position L_b + step).
    for step in range(2):
        toks = np.array([seqs[0][lens[0] + step], seqs[1][lens[1] + step]], np.int32)
        logits, cache = decode_one(model, weights, jnp.asarray(toks), jnp.int32(step), cache)
        for i in range(2):
            got[i].append(np.asarray(logits[i]))
    for i in range(2):
        n = lens[i] + 2
        ref = np.asarray(forward(model, params, jnp.asarray(seqs[i][None, :n], jnp.int32)))[0]
        np.testing.assert_allclose(np.stack(got[i]), ref[lens[i] - 1 : n], atol=1e-5)


@pytest.mark.slow
def test_packed_segments_equal_separate_sequences():
    cfg = _cfg()
    model = Transformer(cfg)
    params = init_params(model, jax.random.key(5))
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, cfg.vocab_size, 7), rng.integers(0, cfg.vocab_size, 5)
    packed = np.concatenate([a, b, np.zeros(4, int)])[None]
    seg = np.array([[1] * 7 + [2] * 5 + [0] * 4])
    pos = np.array([list(range(7)) + list(range(5)) + [0] * 4])
    out = np.asarray(
        forward(model, params, jnp.asarray(packed, jnp.int32), jnp.asarray(pos), jnp.asarray(seg))
    )[0]
    ref_a = np.asarray(forward(model, params, jnp.asarray(a[None], jnp.int32)))[0]
    ref_b = np.asarray(forward(model, params, jnp.asarray(b[None], jnp.int32)))[0]
    np.testing.assert_allclose(out[:7], ref_a, atol=1e-5)
    np.testing.assert_allclose(out[7:12], ref_b, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_same_values_and_grads(policy):
    cfg = _cfg()
    cfg_remat = _cfg(remat_policy=policy)
    params = init_params(Transformer(cfg), jax.random.key(6))
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 10)), jnp.int32)

    def loss(p, c):
        return jnp.mean(forward(Transformer(c), p, tokens) ** 2)

    v0, g0 = jax.value_and_grad(loss)(params, cfg)
    v1, g1 = jax.value_and_grad(loss)(params, cfg_remat)
    np.testing.assert_allclose(v0, v1, rtol=1e-6)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7), g0, g1)


def test_bf16_compute_close_to_fp32():
    cfg = _cfg()
    params = init_params(Transformer(cfg), jax.random.key(7))
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 10)), jnp.int32)
    ref = forward(Transformer(cfg), params, tokens)
    low = forward(Transformer(_cfg(dtype="bfloat16")), params, tokens)
    assert low.dtype == jnp.float32  # logits come back in fp32 whatever the compute dtype
    assert float(jnp.max(jnp.abs(low - ref))) < 0.05 * float(jnp.max(jnp.abs(ref))) + 0.05


def test_invalid_model_config_is_clear():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        _cfg(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="attn_query_block must be >= 0"):
        _cfg(attn_query_block=-1)
    with pytest.raises(ValueError, match=r"model has unknown fields \[.num_layerz.\]"):
        ModelConfig.from_config({**_cfg().__dict__, "num_layerz": 2})
