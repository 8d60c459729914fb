"""The KV-cache sampler against full recomputation, Hugging Face `generate`, and by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.hf_reference import make_hf_qwen3
from tg_jax.models import ModelConfig, Transformer, forward, init_params
from tg_jax.sampling.methods import filter_logits
from tg_jax.sampling.rows import batch_bucket, length_bucket
from tg_jax.sampling.sampler import Sampler, logprob_mismatch, sequence_logprobs

PAD = 0
CFG = ModelConfig(
    vocab_size=96, d_model=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    mlp_dim=80, rope_theta=10_000.0, max_seq_len=128,
)  # fmt: skip


@pytest.fixture(scope="module")
def setup():
    hf_model, params = make_hf_qwen3(CFG, seed=3, std=0.2)
    model = Transformer(CFG)
    # Segments of 8 steps: the tests below run the segmented decode loop (segment_ends).
    sampler = Sampler(model, pad_id=PAD, length_multiple=32, segment=8)
    return hf_model, model, jax.tree.map(jnp.asarray, params), sampler


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(1, CFG.vocab_size, n)) for n in lengths]


WIDTH = 64  # Recomputations pad to one width (causal: padding after a token cannot change it).


@jax.jit
def _logits(params, tokens_BxT):
    return forward(Transformer(CFG), params, tokens_BxT)


def _padded(seq, width=WIDTH):
    return jnp.asarray([list(seq) + [PAD] * (width - len(seq))], jnp.int32)


def _greedy_by_recompute(logits_fn, prompt, n, width=WIDTH):
    """n greedy tokens after `prompt`, each from a full forward `logits_fn([1, width] ids)`."""
    seq = list(prompt)
    for _ in range(n):
        logits = logits_fn(_padded(seq, width))
        seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    return seq[len(prompt) :]


@pytest.mark.slow
def test_greedy_matches_full_recompute_and_hf(setup):
    import torch

    hf_model, model, params, sampler = setup
    lengths = (5, 13, 1, 9)  # different prompt lengths share one right-padded block
    prompts = _prompts(lengths)
    out = sampler.sample(params, prompts, max_new_tokens=12, temperature=0.0, rng=jax.random.key(0))
    for prompt, toks in zip(prompts, out.tokens, strict=True):
        assert len(toks) == 12
        assert list(toks) == _greedy_by_recompute(lambda t: _logits(params, t), prompt, 12)
        ids = torch.tensor([prompt])
        ref = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
            do_sample=False, eos_token_id=None, pad_token_id=PAD,
        )  # fmt: skip
        assert list(toks) == ref[0, len(prompt) :].tolist()
    assert all(np.all(lp == 0.0) for lp in out.logprobs)  # greedy: point mass


@pytest.mark.slow
def test_long_prompts_prefill_in_query_blocks_like_the_model():
    """Prompt blocks longer than the prefill's query block (128): the next-token logits and
    the greedy continuation equal full recomputation by the model."""
    import dataclasses

    from tg_jax.models.decode import prefill

    cfg = dataclasses.replace(CFG, max_seq_len=512)
    model = Transformer(cfg)
    params = init_params(model, jax.random.key(2))
    lengths = (300, 129, 7)
    prompts = _prompts(lengths, seed=5)
    block = np.zeros((3, 320), np.int32)
    for i, pr in enumerate(prompts):
        block[i, : len(pr)] = pr
    logits, _ = jax.jit(prefill, static_argnums=(0, 4))(
        model, params, jnp.asarray(block), jnp.asarray(lengths), 8
    )
    fwd = jax.jit(lambda t: forward(model, params, t))
    full = fwd(jnp.asarray(block))
    last = full[np.arange(3), np.asarray(lengths) - 1]
    np.testing.assert_allclose(logits, last, atol=1e-4)
    out = Sampler(model, pad_id=PAD).sample(
        params, prompts, max_new_tokens=6, temperature=0.0, rng=jax.random.key(0)
    )
    for prompt, toks in zip(prompts, out.tokens, strict=True):
        assert list(toks) == _greedy_by_recompute(fwd, prompt, 6, width=320)


@pytest.mark.slow
def test_moe_sampler_matches_full_recompute():
    """A Qwen3-MoE model through the sampler's own prefill and decode steps (MoE block)."""
    cfg = ModelConfig(
        vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        mlp_dim=0, max_seq_len=64, num_experts=4, experts_per_token=2, moe_mlp_dim=16,
    )  # fmt: skip
    model = Transformer(cfg)
    params = init_params(model, jax.random.key(1))
    prompts = [[3, 9, 4], [7, 1, 5, 5, 2, 8, 6]]
    out = Sampler(model, pad_id=PAD, length_multiple=16, segment=4).sample(
        params, prompts, max_new_tokens=10, temperature=0.0, rng=jax.random.key(0)
    )
    logits_fn = jax.jit(lambda t: forward(model, params, t))
    for prompt, toks in zip(prompts, out.tokens, strict=True):
        assert list(toks) == _greedy_by_recompute(logits_fn, prompt, 10, width=32)


@pytest.mark.slow
def test_logprobs_match_trainer_recompute(setup):
    _, model, params, sampler = setup
    prompts = _prompts((7, 3, 12, 6), seed=1)
    out = sampler.sample(params, prompts, max_new_tokens=20, rng=jax.random.key(1))
    seqs = [list(p) + list(t) for p, t in zip(prompts, out.tokens, strict=True)]
    width = max(map(len, seqs))
    tokens = np.zeros((len(seqs), width), np.int32)
    behaviour = np.zeros((len(seqs), width), np.float32)
    mask = np.zeros((len(seqs), width), np.float32)
    for i, (p, s) in enumerate(zip(prompts, seqs, strict=True)):
        tokens[i, : len(s)] = s
        behaviour[i, len(p) : len(s)] = out.logprobs[i]
        mask[i, len(p) : len(s)] = 1
        np.testing.assert_array_equal(out.logprobs[i], out.raw_logprobs[i])  # T = 1, no filter
    trainer = np.asarray(jax.jit(sequence_logprobs, static_argnums=0)(model, params, tokens))
    assert np.min(trainer * mask) < -1.0  # real, non-degenerate log-probs
    gap = logprob_mismatch(behaviour, trainer, mask)
    assert float(gap["max_abs"]) < 1e-5, gap
    off = logprob_mismatch(behaviour + 0.5 * mask, trainer, mask)
    np.testing.assert_allclose([off["mean_abs"], off["max_abs"]], [0.5, 0.5], atol=1e-5)


def test_top_k_one_and_tiny_top_p_are_greedy(setup):
    _, _, params, sampler = setup
    prompts = _prompts((4, 10, 2), seed=2)
    kw = dict(max_new_tokens=10, rng=jax.random.key(5))
    traces = sampler.num_traces
    greedy = sampler.sample(params, prompts, temperature=0.0, **kw)
    top1 = sampler.sample(params, prompts, temperature=1.3, top_k=1, **kw)
    tiny_p = sampler.sample(params, prompts, temperature=0.7, top_p=1e-6, **kw)
    for g, a, b in zip(greedy.tokens, top1.tokens, tiny_p.tokens, strict=True):
        np.testing.assert_array_equal(g, a)
        np.testing.assert_array_equal(g, b)
    np.testing.assert_allclose(np.concatenate(top1.logprobs), 0.0, atol=1e-6)
    assert sampler.num_traces <= traces + 1  # temperature / top-k / top-p are arrays


def test_top_k_logprob_is_the_filtered_distribution(setup):
    _, model, params, sampler = setup
    prompts = _prompts((6, 6), seed=3)
    t, k = 0.8, 5
    out = sampler.sample(
        params, prompts, max_new_tokens=8, temperature=t, top_k=k, rng=jax.random.key(9)
    )
    for p, toks, lps in zip(prompts, out.tokens, out.logprobs, strict=True):
        seq = list(p) + list(toks)
        logits = np.asarray(_logits(params, _padded(seq)))[0, len(p) - 1 : len(seq) - 1] / t
        for row, tok, lp in zip(logits, toks, lps, strict=True):
            top = np.sort(row)[-k:]
            assert row[tok] >= top[0]  # drawn from the top k
            expected = row[tok] - np.log(np.sum(np.exp(top - top.max()))) - top.max()
            np.testing.assert_allclose(lp, expected, atol=1e-5)


def test_filter_logits_by_hand():
    logits = jnp.log(jnp.array([[0.5, 0.2, 0.2, 0.1], [0.1, 0.7, 0.15, 0.05]]))
    ones = jnp.ones((2,))
    # top-p 0.6: row 0 keeps {0.5, 0.2, 0.2} (0.5 < 0.6; ties at the cut-off kept), row 1 {0.7}.
    out = np.asarray(filter_logits(logits, ones, jnp.zeros((2,), jnp.int32), 0.6 * ones))
    assert (out > -1e29).tolist() == [[True, True, True, False], [False, True, False, False]]
    # top-k 2 and top-p 1.
    out = np.asarray(filter_logits(logits, ones, jnp.array([2, 2]), ones))
    assert (out > -1e29).sum(axis=1).tolist() == [3, 2]  # row 0: the tie at 0.2 is kept
    np.testing.assert_allclose(np.asarray(filter_logits(logits, 2 * ones, jnp.zeros(2, int), ones)),
                               np.asarray(logits) / 2, rtol=1e-6)  # fmt: skip


@pytest.mark.slow
def test_stop_ids_and_max_new_per_row(setup):
    _, _, params, sampler = setup
    prompts = _prompts((5, 8, 3), seed=4)
    kw = dict(temperature=0.0, rng=jax.random.key(0))
    base = sampler.sample(params, prompts, max_new_tokens=16, **kw)
    # Row 0 stops at the first occurrence of its 4th token; row 1 never sees its stop id; row 2
    # has a budget of 3 tokens.
    stop0 = int(base.tokens[0][3])
    first0 = list(base.tokens[0]).index(stop0)
    absent = next(t for t in range(1, CFG.vocab_size) if t not in base.tokens[1])
    out = sampler.sample(
        params, prompts, max_new_tokens=[16, 16, 3], stop_ids=[[stop0], [absent], []],
        **kw,
    )  # fmt: skip
    np.testing.assert_array_equal(out.tokens[0], base.tokens[0][: first0 + 1])
    np.testing.assert_array_equal(out.tokens[1], base.tokens[1])
    np.testing.assert_array_equal(out.tokens[2], base.tokens[2][:3])
    assert out.stopped.tolist() == [True, False, False]


@pytest.mark.slow
def test_no_retrace_within_buckets():
    model = Transformer(CFG)
    params = jax.tree.map(jnp.asarray, make_hf_qwen3(CFG, seed=0)[1])
    sampler = Sampler(model, pad_id=PAD, length_multiple=32)
    for i, lengths in enumerate([(3, 17, 30), (32, 20, 5, 6), (19, 1, 2), (25, 1, 2, 4)]):
        sampler.sample(
            params, _prompts(lengths, seed=i), max_new_tokens=[5 + i] * len(lengths),
            stop_ids=[7, 8], temperature=0.5 * i, top_k=i, rng=jax.random.key(i),
        )  # fmt: skip
    assert sampler.num_traces == 1
    sampler.sample(params, _prompts((40,)), max_new_tokens=4, rng=jax.random.key(0))
    assert sampler.num_traces == 2  # a longer prompt moves to the next bucket


def test_buckets():
    sizes = (1, 8, 9, 33, 64, 65, 200)
    assert [length_bucket(n, 64) for n in sizes] == [8, 8, 16, 64, 64, 128, 256]
    assert [batch_bucket(n, 1) for n in (1, 3, 8, 9)] == [1, 4, 8, 16]
    assert batch_bucket(3, 8) == 8


@pytest.mark.slow
def test_sharded_sampler_matches_single_device(setup):
    from tg_jax import config_lib, sharding

    _, model, params, sampler = setup
    mesh_cfg = config_lib.mesh_config()
    mesh = sharding.make_mesh(mesh_cfg)
    rules = sharding.logical_rules(mesh_cfg)
    shardings = sharding.param_partition_specs(model, mesh, rules)
    sharded_params = jax.device_put(params, shardings)
    sharded = Sampler(
        model, pad_id=PAD, length_multiple=32, mesh=mesh, rules=rules,
        batch_divisor=sharding.batch_divisor(mesh, rules),
    )  # fmt: skip
    prompts = _prompts((5, 13, 1), seed=7)
    kw = dict(max_new_tokens=[10, 6, 12], temperature=0.0, rng=jax.random.key(0))
    ref = sampler.sample(params, prompts, **kw)
    out = sharded.sample(sharded_params, prompts, **kw)
    for a, b in zip(ref.tokens, out.tokens, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_data_parallel_sampler_runs_a_loop_per_shard_and_matches_single_device(setup):
    """Rows split over all devices with replicated params: each device runs its own decode loop
    (shard_map) on its rows' slice of the same random numbers, so even sampled (temperature,
    top-k, top-p) tokens equal the single-device sampler's, and log-probs to float rounding."""
    from tg_jax.sampling.loop import data_parallel_mesh

    _, model, params, sampler = setup
    devices = jax.local_devices()[:4]
    mesh, rules = data_parallel_mesh(devices)
    split = Sampler(model, pad_id=PAD, length_multiple=32, mesh=mesh, rules=rules,
                    batch_divisor=len(devices))  # fmt: skip
    assert split._row_axes() == ("sampler",)
    replicated = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.P()))
    prompts = _prompts((5, 13, 1, 9, 30, 2), seed=11)
    for settings in ({"temperature": 1.0}, {"temperature": 0.8, "top_k": 20, "top_p": 0.9}):
        kw = dict(max_new_tokens=[10, 6, 12, 40, 3, 25], stop_ids=[7, 8], rng=jax.random.key(5))
        ref = sampler.sample(params, prompts, **kw, **settings)
        out = split.sample(replicated, prompts, **kw, **settings)
        np.testing.assert_array_equal(ref.stopped, out.stopped)
        for i in range(len(prompts)):
            np.testing.assert_array_equal(ref.tokens[i], out.tokens[i])
            np.testing.assert_allclose(ref.logprobs[i], out.logprobs[i], atol=1e-5)
            np.testing.assert_allclose(ref.raw_logprobs[i], out.raw_logprobs[i], atol=1e-5)
    assert sum(len(t) for t in ref.tokens) > 40  # sampled, not stopped at once


@pytest.mark.slow
def test_segment_ends_by_hand():
    from tg_jax.models.decode import extend, prefill
    from tg_jax.sampling.rows import segment_ends

    assert segment_ends(128, 0) == [128]
    assert segment_ends(128, 64) == [64, 128]
    assert segment_ends(100, 32) == [32, 64, 96, 100]
    assert segment_ends(16, 64) == [16]
    with pytest.raises(ValueError, match="segment must be >= 0"):
        segment_ends(16, -1)
    with pytest.raises(ValueError, match="segment must be >= 0"):
        Sampler(Transformer(CFG), pad_id=PAD, segment=-8)
    # The cache grows by empty slots; it never shrinks.
    model = Transformer(CFG)
    params = init_params(model, jax.random.key(0))
    prompt = jnp.ones((2, 4), jnp.int32)
    _, cache = prefill(model, params, prompt, jnp.array([4, 2]), max_new=16, slots=8)
    assert cache.k[0].shape[-1] == cache.v[0].shape[2] == 12
    assert cache.rope_cos.shape == (20, CFG.head_dim // 2)  # every position P + R
    grown = extend(cache, 16)
    assert grown.k[0].shape[-1] == grown.v[0].shape[2] == 20
    np.testing.assert_array_equal(grown.k[1][..., :12], cache.k[1])
    np.testing.assert_array_equal(grown.v[1][:, :, 12:], 0.0)
    with pytest.raises(ValueError, match="cannot shrink"):
        extend(grown, 8)


@pytest.mark.slow
def test_segmented_loop_samples_what_one_loop_samples(setup):
    """Segments change how many cache slots a step reads (masked ones weigh exactly 0), not
    what is sampled: tokens equal one loop over all slots, log-probs to float rounding."""
    _, model, params, segmented = setup
    one_loop = Sampler(model, pad_id=PAD, length_multiple=32)
    prompts = _prompts((3, 17, 8, 1), seed=4)
    kw = dict(max_new_tokens=[30, 12, 41, 5], temperature=1.0, rng=jax.random.key(2))
    ref, out = one_loop.sample(params, prompts, **kw), segmented.sample(params, prompts, **kw)
    for i in range(len(prompts)):
        np.testing.assert_array_equal(ref.tokens[i], out.tokens[i])
        np.testing.assert_allclose(ref.logprobs[i], out.logprobs[i], atol=1e-5)
    assert max(map(len, ref.tokens)) > 16  # ran past the first segments


def test_blocked_cumsum_is_the_cumulative_sum():
    from tg_jax.sampling.methods import blocked_cumsum

    x = np.random.default_rng(0).random((3, 37)).astype(np.float32)  # 37: a partial block
    for block in (1, 4, 16, 64):
        np.testing.assert_allclose(blocked_cumsum(jnp.asarray(x), block), np.cumsum(x, -1),
                                   rtol=1e-6)  # fmt: skip
    np.testing.assert_array_equal(blocked_cumsum(jnp.asarray([[1.0, 2.0, 3.0]]), 2), [[1, 3, 6]])


def test_step_uniforms_are_the_per_step_draws():
    """The loop's random numbers, drawn up front, are those of `fold_in(rng, step)` per step."""
    from tg_jax.sampling.methods import step_uniforms, uniforms

    rng = jax.random.key(9)
    u = np.asarray(step_uniforms(rng, 6, 5))
    assert u.shape == (6, 5) and (u > 0).all() and (u < 1).all()
    for i in range(5):
        np.testing.assert_array_equal(u[:, i], uniforms(jax.random.fold_in(rng, i), 6))


def test_draw_frequencies_follow_the_sampling_distribution():
    from tg_jax.sampling.methods import draw_with_uniforms, uniforms

    rows = 20_000
    logits = jnp.broadcast_to(jnp.array([2.0, 1.0, 0.5, 0.0, -1.0, 3.0]), (rows, 6))
    t, k = 0.7, 4
    ones = jnp.ones((rows,))
    tokens, lp, raw = jax.jit(draw_with_uniforms)(
        uniforms(jax.random.key(0), rows), logits, t * ones, jnp.full((rows,), k, jnp.int32), ones
    )
    z = np.asarray(logits[0]) / t
    keep = z >= np.sort(z)[-k]
    q = np.where(keep, np.exp(z - z.max()), 0.0)
    q /= q.sum()
    freq = np.bincount(np.asarray(tokens), minlength=6) / rows
    np.testing.assert_allclose(freq, q, atol=4 * np.sqrt(q.max() / rows))  # ~4 sigma
    assert freq[~keep].sum() == 0  # filtered tokens are never drawn
    np.testing.assert_allclose(np.asarray(lp), np.log(q[np.asarray(tokens)]), atol=1e-5)
    log_softmax = np.asarray(jax.nn.log_softmax(logits[0]))
    np.testing.assert_allclose(np.asarray(raw), log_softmax[np.asarray(tokens)], atol=1e-5)


def test_precomputed_rope_equals_the_model_rope():
    from tg_jax.models.layers import apply_rope, rope, rope_tables

    x = jax.random.normal(jax.random.key(0), (3, 1, 4, 16))
    positions = jnp.array([[0], [7], [300]], jnp.int32)
    expected = rope(x, positions, 10_000.0)
    np.testing.assert_array_equal(apply_rope(x, *rope_tables(positions, 16, 10_000.0)), expected)
    # The decode loop gathers rows of tables computed for every position at once.
    cos_1xSx1xH2, sin_1xSx1xH2 = jax.jit(rope_tables, static_argnums=(1, 2))(
        jnp.arange(301, dtype=jnp.int32)[None, :], 16, 10_000.0
    )
    gathered = (cos_1xSx1xH2[0, positions], sin_1xSx1xH2[0, positions])  # [3, 1, 1, H / 2]
    # (compiled trigonometry of large angles may round differently from eager: float level)
    np.testing.assert_allclose(apply_rope(x, *gathered), expected, atol=1e-5)


def _turns(sampler, params, *, cached: bool, stops, turns: int = 3, seed: int = 0, **kw):
    """Multi-turn contexts driven like a rollout: per call, every live row's sampled tokens
    (and a closing token when its turn was cut) plus a random number of appended tokens; rows
    end after different turns. Rows 0-1 and 2-4 start from one prompt each (GRPO groups).

    With `cached` the calls go through one TurnCache; else every call re-prefills every
    context (the reference). `stops`: the stop ids of each row (key). Returns per call (live
    keys, SampleResult, context lengths)."""
    from tg_jax.sampling.turn_cache import TurnCache

    gen = np.random.default_rng(seed)
    a, b, c = _prompts((5, 13, 3), seed=seed)
    contexts = {k: list(p) for k, p in enumerate((a, a, b, b, b, c))}
    appended = {(k, t): list(gen.integers(1, CFG.vocab_size, gen.integers(1, 12)))
                for k in contexts for t in range(turns)}  # fmt: skip
    ends = {0: 2, 1: 0, 2: 2, 3: 1, 4: 2, 5: 1}  # the last turn of each row
    budgets = {0: 10, 1: 6, 2: 12, 3: 20, 4: 3, 5: 15}
    cache = TurnCache() if cached else None
    live, calls = list(contexts), []
    for turn in range(turns):
        out = sampler.sample(
            params, [contexts[k] for k in live], max_new_tokens=[budgets[k] for k in live],
            stop_ids=[stops[k] for k in live], rng=jax.random.fold_in(jax.random.key(seed), turn),
            cache=cache, keys=live if cached else None, **kw,
        )  # fmt: skip
        calls.append((list(live), out, [len(contexts[k]) for k in live]))
        for i, k in enumerate(live):
            contexts[k] += [int(t) for t in out.tokens[i]] + ([] if out.stopped[i] else [9])
            contexts[k] += [int(t) for t in appended[k, turn]]
        live = [k for k in live if ends[k] > turn]
    return calls


def _assert_same_turns(ref_calls, calls, atol=1e-5):
    for (keys, ref, _), (keys2, out, _) in zip(ref_calls, calls, strict=True):
        assert keys == keys2
        np.testing.assert_array_equal(ref.stopped, out.stopped)
        for i in range(len(keys)):
            np.testing.assert_array_equal(ref.tokens[i], out.tokens[i])
            np.testing.assert_allclose(ref.logprobs[i], out.logprobs[i], atol=atol)
            np.testing.assert_allclose(ref.raw_logprobs[i], out.raw_logprobs[i], atol=atol)


# Wide stop lists on rows 2 and 4: turns end on a stop id at different lengths.
TURN_STOPS = {0: [7, 8], 1: [8], 2: list(range(1, 12)), 3: [], 4: list(range(40, 60)), 5: [5]}


@pytest.mark.slow
def test_turn_cache_samples_what_reprefill_samples_and_prefills_only_appended_tokens(setup):
    """Kept keys/values across calls: the same tokens as re-prefilling every context (same
    random numbers), log-probs to float rounding; a call prefills only what was appended (the
    previous turn's last drawn token included) and a shared prompt once."""
    _, _, params, sampler = setup
    for settings in ({"temperature": 1.0}, {"temperature": 0.8, "top_k": 20, "top_p": 0.9}):
        ref = _turns(sampler, params, cached=False, stops=TURN_STOPS, **settings)
        out = _turns(sampler, params, cached=True, stops=TURN_STOPS, **settings)
        _assert_same_turns(ref, out)
        stopped = np.concatenate([r.stopped for _, r, _ in out])
        assert stopped.any() and not stopped.all()
    first = out[0][1]
    np.testing.assert_allclose(first.prefill_tokens, [5 / 2, 5 / 2, 13 / 3, 13 / 3, 13 / 3, 3])
    for _, res, lengths in ref:
        np.testing.assert_array_equal(res.prefill_tokens, lengths)  # re-prefill: everything
    for (prev_keys, prev, prev_lengths), (keys, res, lengths) in zip(out, out[1:], strict=False):
        cached = zip(prev_keys, prev_lengths, prev.tokens, strict=True)
        before = {k: n + len(t) - 1 for k, n, t in cached}  # the last drawn token was not fed
        expected = [n - before[k] for k, n in zip(keys, lengths, strict=True)]
        np.testing.assert_array_equal(res.prefill_tokens, expected)
    assert [len(k) for k, _, _ in out] == [6, 5, 3]  # rows ended after different turns


@pytest.mark.slow
def test_turn_cache_sharded_matches_single_device(setup):
    """The cached multi-turn calls on 8 devices (params sharded, one loop under the activation
    rules) and split over 4 devices (one loop per shard) sample what one device samples."""
    from tg_jax import config_lib, sharding
    from tg_jax.sampling.loop import data_parallel_mesh

    _, model, params, sampler = setup
    mesh_cfg = config_lib.mesh_config()
    mesh = sharding.make_mesh(mesh_cfg)
    rules = sharding.logical_rules(mesh_cfg)
    sharded = Sampler(
        model, pad_id=PAD, length_multiple=32, segment=8, mesh=mesh, rules=rules,
        batch_divisor=sharding.batch_divisor(mesh, rules),
    )  # fmt: skip
    sharded_params = jax.device_put(params, sharding.param_partition_specs(model, mesh, rules))
    devices = jax.local_devices()[:4]
    dp_mesh, dp_rules = data_parallel_mesh(devices)
    split = Sampler(model, pad_id=PAD, length_multiple=32, segment=8, mesh=dp_mesh,
                    rules=dp_rules, batch_divisor=len(devices))  # fmt: skip
    replicated = jax.device_put(params, jax.sharding.NamedSharding(dp_mesh, jax.P()))
    kw = dict(cached=True, stops=TURN_STOPS, temperature=1.0, seed=3)
    ref = _turns(sampler, params, **kw)
    _assert_same_turns(ref, _turns(sharded, sharded_params, **kw))
    _assert_same_turns(ref, _turns(split, replicated, **kw))


@pytest.mark.slow
def test_turn_cache_rejects_contexts_that_do_not_extend_the_cached_ones(setup):
    from tg_jax.sampling.turn_cache import TurnCache

    _, _, params, sampler = setup
    cache, prompt = TurnCache(), _prompts((6,), seed=2)[0]
    kw = dict(max_new_tokens=4, temperature=0.0, rng=jax.random.key(0), cache=cache)
    with pytest.raises(ValueError, match="one distinct key per prompt"):
        sampler.sample(params, [prompt, prompt], keys=["a", "a"], **kw)
    out = sampler.sample(params, [prompt], keys=["a"], **kw)
    assert cache.cached["a"] == prompt + out.tokens[0][:-1].tolist()
    with pytest.raises(ValueError, match="does not extend"):
        sampler.sample(params, [prompt[:-1] + [1, 2]], keys=["a"], **kw)  # rewritten
    with pytest.raises(ValueError, match="does not extend"):
        sampler.sample(params, [prompt + out.tokens[0][:-1].tolist()], keys=["a"], **kw)  # none
    with pytest.raises(ValueError, match="does not extend"):
        sampler.sample(params, [prompt], keys=["b"], **kw)  # not cached
