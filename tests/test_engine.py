"""The rollout engine (tg_jax.engine): continuous batching, paged KV, prefix sharing with
copy-on-write, multi-turn continuation, preemption, errors, exactness against the `Sampler`
and the full forward, and no recompilation in steady state."""

import jax
import numpy as np
import pytest

from tg_jax.engine import Engine, Request, paged
from tg_jax.engine.pages import PageAllocator, PrefixIndex
from tg_jax.models import ModelConfig, Transformer, init_params
from tg_jax.sampling.sampler import Sampler, sequence_logprobs

CFG = ModelConfig(
    vocab_size=96, d_model=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    mlp_dim=80, rope_theta=10_000.0, max_seq_len=128,
)  # fmt: skip
# One engine geometry for most tests, unbucketed: the jitted calls compile once (buckets:
# test_no_recompilation_after_warmup).
GEOMETRY = dict(
    max_slots=4, page_size=4, max_pages_per_seq=12, prefill_chunk=8, prefill_rows=2,
    bucket_pages=False, bucket_slots=False,
)  # fmt: skip


@pytest.fixture(scope="module")
def setup():
    model = Transformer(CFG)
    params = init_params(model, jax.random.key(3))
    # Larger weights: peaked next-token distributions, so greedy draws have no near-ties.
    params = jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x, params)
    return model, params


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, CFG.vocab_size, n)] for n in lengths]


def _engine(setup, **kw):
    model, params = setup
    return Engine(model, params, **{**GEOMETRY, **kw})


def _requests(prompts, n=12, temperature=0.0, **kw):
    return [Request(i, p, n, temperature=temperature, **kw) for i, p in enumerate(prompts)]


def _release_all(engine, ids):
    for i in ids:
        engine.release(i)


@pytest.mark.slow
def test_greedy_and_sampled_draws_equal_the_sampler(setup):
    """More requests than slots: greedy tokens equal `Sampler`'s; sampled tokens equal its
    draws with row_ids = the requests' seeds (per-request streams); slots are refilled."""
    model, params = setup
    prompts = _prompts((5, 13, 1, 9, 20, 3, 7))
    sampler = Sampler(model, pad_id=0, length_multiple=32, segment=8)
    engine = _engine(setup)
    ref = sampler.sample(params, prompts, max_new_tokens=12, temperature=0.0, rng=jax.random.key(0))
    out = engine.generate(_requests(prompts))
    assert [c.token_ids for c in out] == [list(map(int, t)) for t in ref.tokens]
    assert all(c.finish_reason == "length" and np.all(c.logprobs == 0.0) for c in out)
    stats = engine.stats
    assert stats["decode_tokens"] == 7 * 12
    # 7 requests over 4 slots: at most 4 decode per step, and the refilled slots keep it busy.
    assert 12 * 7 / 4 <= stats["decode_steps"] < 12 * 7 / 4 + 12
    assert stats["decode_occupancy"] > 0.6

    rng = jax.random.key(5)
    ref = sampler.sample(params, prompts, max_new_tokens=12, temperature=1.0, rng=rng,
                         row_ids=list(range(7)))  # fmt: skip
    out = _engine(setup, rng=rng).generate(_requests(prompts, temperature=1.0))
    assert [c.token_ids for c in out] == [list(map(int, t)) for t in ref.tokens]
    for c, lp in zip(out, ref.logprobs, strict=True):
        np.testing.assert_allclose(c.logprobs, lp, atol=1e-5)
        assert np.min(c.logprobs) < -0.5  # real draws, not a point mass


@pytest.mark.slow
def test_moe_model_greedy_equals_the_sampler():
    """A Qwen3-MoE model through the engine's paged layers (the decode path's MoE block). The
    engine's weights hold the stacked experts it was given (the same arrays: no second copy
    of the largest weights) and a call slices its layer's."""
    cfg = ModelConfig(
        vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        mlp_dim=0, max_seq_len=64, num_experts=4, experts_per_token=2, moe_mlp_dim=16,
    )  # fmt: skip
    model = Transformer(cfg)
    params = jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x,
                          init_params(model, jax.random.key(1)))  # fmt: skip
    prompts = [[3, 9, 4], [7, 1, 5, 5, 2, 8, 6, 9, 9, 3, 1]]
    ref = Sampler(model, pad_id=0, length_multiple=16, segment=4).sample(
        params, prompts, max_new_tokens=10, temperature=0.0, rng=jax.random.key(0)
    )
    engine = Engine(model, params, **GEOMETRY)
    held = jax.tree.leaves(engine._weights.params["layers"]["mlp"])
    assert held and all(
        a is b for a, b in zip(held, jax.tree.leaves(params["layers"]["mlp"]), strict=True)
    )
    assert all("mlp" not in layer for layer in engine._weights.layers)
    out = engine.generate(_requests(prompts, n=10))
    assert [c.token_ids for c in out] == [list(map(int, t)) for t in ref.tokens]


def test_logprobs_equal_the_full_forward(setup):
    model, params = setup
    prompts = _prompts((6, 11, 2), seed=1)
    reqs = [Request(i, p, 16, temperature=1.0, stop_ids=(7,)) for i, p in enumerate(prompts)]
    out = _engine(setup, rng=jax.random.key(2)).generate(reqs)
    width = 32
    tokens = np.zeros((3, width), np.int32)
    for i, (p, c) in enumerate(zip(prompts, out, strict=True)):
        tokens[i, : len(p) + len(c.token_ids)] = p + c.token_ids
    full = np.asarray(jax.jit(sequence_logprobs, static_argnums=0)(model, params, tokens))
    for i, (p, c) in enumerate(zip(prompts, out, strict=True)):
        n = len(c.token_ids)
        assert n == 16 or (c.finish_reason == "stop" and c.token_ids[-1] == 7)
        np.testing.assert_allclose(c.logprobs, full[i, len(p) : len(p) + n], atol=1e-4)
        np.testing.assert_allclose(c.raw_logprobs, c.logprobs, atol=1e-6)  # T = 1, no filter
    assert np.mean(np.concatenate([c.logprobs for c in out])) < -0.3


def test_pages_are_held_for_live_tokens_and_returned(setup):
    engine = _engine(setup)
    prompts = _prompts((5, 9, 14, 3, 8, 6), seed=2)
    out = engine.generate(_requests(prompts, n=10))
    assert all(len(c.token_ids) == 10 for c in out)
    assert engine._results == {}  # handed over, not kept
    # Finished requests keep their written tokens' pages (for continuation): positions
    # 0..L+9-1 (the last drawn token is never fed), ceil(that / 4) pages each.
    held = sum(-(-(len(p) + 9) // 4) for p in prompts)
    assert engine.stats["pages_used"] == engine.stats["peak_pages_used"] == held
    _release_all(engine, range(len(prompts)))
    assert engine.stats["pages_used"] == 0
    assert engine.allocator.num_free == engine.allocator.capacity == 48
    assert np.all(engine.allocator.refcount == 0)


def test_identical_prompts_share_pages_copy_on_write(setup):
    """A group of 4 identical prompts: the full pages are shared by refcount, the partial
    last page is copied on the first write; the tokens equal an unshared run's."""
    prompt = _prompts((11,), seed=3)[0]
    reqs = [Request(i, prompt, 8, temperature=1.0, seed=i) for i in range(4)]
    shared, unshared = _engine(setup), _engine(setup, prefix_sharing=False)
    out_shared, out_unshared = shared.generate(reqs), unshared.generate(reqs)
    for a, b in zip(out_shared, out_unshared, strict=True):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert len({tuple(c.token_ids) for c in out_shared}) > 1  # different seeds, different draws
    s, u = shared.stats, unshared.stats
    assert u["shared_tokens"] == 0 and u["cow_copies"] == 0 and u["prefill_tokens"] == 4 * 11
    # Followers reuse positions 0..9 (two full pages and two tokens of the third): they
    # prefill only the last prompt token, and copy the partial page before writing to it.
    assert s["shared_tokens"] == 3 * 10 and s["prefill_tokens"] == 11 + 3 * 1
    assert s["cow_copies"] == 3
    # Positions 0..17 per request: 5 pages unshared, 3 private + 2 shared when shared.
    assert u["pages_used"] == 4 * 5 and s["pages_used"] == 2 + 4 * 3
    first_pages = shared._kept[0].pages[:2]
    assert all(shared._kept[i].pages[:2] == first_pages for i in range(4))
    assert [int(shared.allocator.refcount[p]) for p in first_pages] == [4, 4]
    _release_all(shared, range(4))
    assert shared.allocator.num_free == shared.allocator.capacity


def test_continuation_equals_the_whole_context_run_fresh(setup):
    """A second turn continues the first's pages (prefilling only the appended tokens and the
    turn's last drawn token) and samples what a fresh run of the whole context samples."""
    p1, appended = _prompts((9, 6), seed=4)
    for sharing in (True, False):
        engine = _engine(setup, prefix_sharing=sharing, rng=jax.random.key(1))
        (t1,) = engine.generate([Request("t1", p1, 7, temperature=1.0, seed=11)])
        (t2,) = engine.generate(
            [Request("t2", appended, 9, temperature=1.0, continue_from="t1", seed=12)]
        )
        assert t2.prefill_tokens == len(appended) + 1
        assert "t1" not in engine._kept  # the turn's pages moved to its continuation
        fresh = _engine(setup, rng=jax.random.key(1), prefix_sharing=False)
        (ref,) = fresh.generate([Request("x", p1 + t1.token_ids + appended, 9, temperature=1.0,
                                         seed=12)])  # fmt: skip
        assert ref.prefill_tokens == len(p1) + 7 + len(appended)
        assert t2.token_ids == ref.token_ids
        np.testing.assert_allclose(t2.logprobs, ref.logprobs, atol=1e-5)
        engine.release("t2")
        assert engine.allocator.num_free == engine.allocator.capacity


def test_preemption_requeues_and_samples_what_an_unpreempted_run_samples(setup):
    prompts = _prompts((10, 7, 12, 9, 5), seed=5)
    reqs = [Request(i, p, 14, temperature=t, seed=i) for i, p in enumerate(prompts)
            for t in [(0.0, 1.0)[i % 2]]]  # fmt: skip
    big = _engine(setup, rng=jax.random.key(3))
    ref = big.generate(reqs)
    assert big.stats["preemptions"] == 0
    # 12 usable pages of 4 slots; one request needs up to ceil(25 / 4) = 7.
    small = _engine(setup, rng=jax.random.key(3), num_pages=13)
    out = small.generate(reqs)
    stats = small.stats
    assert stats["preemptions"] >= 1 and stats["peak_pages_used"] <= 12
    assert sum(c.preemptions for c in out) == stats["preemptions"]
    # Re-prefills (contexts and generated tokens) are counted as prefill.
    assert stats["prefill_tokens"] > sum(map(len, prompts))
    for a, b in zip(out, ref, strict=True):
        assert a.finish_reason == "length" and a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    _release_all(small, range(5))
    assert small.allocator.num_free == 12


def test_too_long_request_is_an_error_and_the_others_complete(setup):
    prompts = _prompts((5, 40, 8), seed=6)
    engine = _engine(setup)
    reqs = _requests(prompts, n=10)
    reqs.append(Request("ghost", [3], 5, continue_from="nobody"))
    out = engine.generate(reqs)
    assert [c.finish_reason for c in out] == ["length", "error", "length", "error"]
    assert "exceeds the per-sequence limit 48" in out[1].message and out[1].token_ids == []
    assert "nobody" in out[3].message
    assert engine.stats["errors"] == 2
    alone = _engine(setup).generate([reqs[0], reqs[2]])
    assert [c.token_ids for c in alone] == [out[0].token_ids, out[2].token_ids]


def test_stop_ids_end_a_request_with_the_stop_token(setup):
    prompts = _prompts((6, 9), seed=9)
    engine = _engine(setup)
    free = engine.generate(_requests(prompts, n=12))
    stop = free[0].token_ids[3]
    first = free[0].token_ids.index(stop)  # the first occurrence ends it
    out = _engine(setup).generate(
        [Request(i, p, 12, temperature=0.0, stop_ids=(stop,)) for i, p in enumerate(prompts)]
    )
    assert out[0].finish_reason == "stop" and out[0].token_ids == free[0].token_ids[: first + 1]
    if stop in free[1].token_ids:
        cut = free[1].token_ids.index(stop) + 1
        assert out[1].finish_reason == "stop" and out[1].token_ids == free[1].token_ids[:cut]
    else:
        assert out[1].finish_reason == "length" and out[1].token_ids == free[1].token_ids


def test_agent_threads_submit_turns_while_one_thread_steps(setup):
    """Episodes in their own threads submit their next turn as soon as the last one returns
    (continue_from); the main thread alone steps. The turns equal a sequential run's."""
    import threading

    prompts, obs = _prompts((7, 4, 10), seed=10), _prompts((3, 5), seed=11)

    def episode(engine, e, out):
        previous = None
        for k in range(3):
            prompt = prompts[e] if k == 0 else obs[k - 1]
            engine.submit(Request((e, k), prompt, 4 + 2 * k, temperature=1.0,
                                  continue_from=previous, seed=10 * e + k))  # fmt: skip
            out[(e, k)] = engine.result((e, k), timeout=120).token_ids
            previous = (e, k)

    threaded, sequential = {}, {}
    engine = _engine(setup, rng=jax.random.key(4))
    threads = [threading.Thread(target=episode, args=(engine, e, threaded)) for e in range(3)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        if engine.has_work():
            engine.step()
    ref = _engine(setup, rng=jax.random.key(4))
    for e in range(3):
        worker = threading.Thread(target=episode, args=(ref, e, sequential))
        worker.start()
        while worker.is_alive():
            ref.step()
    assert len(threaded) == 9 and threaded == sequential
    assert sum(map(len, threaded.values())) == 3 * (4 + 6 + 8)


def test_weights_update_pause_and_policy_version(setup):
    model, params = setup
    engine = _engine(setup)
    prompt = _prompts((6,), seed=7)[0]
    (before,) = engine.generate([Request("a", prompt, 6, temperature=0.0)])
    assert before.policy_version == 0
    engine.submit(Request("b", prompt, 6, temperature=0.0, policy_version=1))
    assert engine.run_until_done() == [] and not engine.has_work()  # waits for version 1
    other = jax.tree.map(lambda x: -x if x.ndim >= 2 else x, params)
    engine.update_weights(other, version=1)
    engine.pause()
    steps = engine.stats["steps"]
    assert engine.step() == [] and engine.stats["steps"] == steps
    engine.resume()
    (after,) = engine.run_until_done()
    assert after.request_id == "b" and after.policy_version == after.first_policy_version == 1
    assert after.token_ids != before.token_ids
    assert after.prefill_tokens == 6  # nothing shared with "a", cached under the old weights


@pytest.mark.slow
def test_no_recompilation_after_warmup(setup):
    """Everything that varies between steps is an array or a bucket (decode rows, page-table
    width): after `warmup` (prefill per width, decode per rows and width, the page copy), new
    prompts, lengths, sampling settings, continuations, sharing and preemption trace nothing."""
    geometry = dict(max_slots=2, page_size=8, max_pages_per_seq=4, prefill_chunk=8,
                    prefill_rows=2, num_pages=5, min_bucket=1)  # fmt: skip
    model, params = setup
    engine = Engine(model, params, **geometry)
    assert engine.page_buckets() == [1, 2, 4] and engine.slot_buckets() == [1, 2]
    before = engine.num_traces  # the weights' conversion when first in this process
    engine.warmup()
    warm = engine.num_traces
    assert warm - before == 3 + 3 * 2 + 1  # (this geometry was not compiled before)
    prompts = _prompts((3, 12, 10, 10, 20), seed=8)
    prompts[3] = prompts[2]  # shared prefix, copy-on-write
    reqs = [Request(i, p, 6 + i, temperature=0.5 * i, top_k=i, top_p=0.9, stop_ids=(5, 6))
            for i, p in enumerate(prompts)]  # fmt: skip
    out = engine.generate(reqs)
    out += engine.generate([Request("c", [4, 4], 5, continue_from=0)])
    assert len(out) == 6 and all(c.finish_reason in ("stop", "length") for c in out), out
    assert engine.stats["preemptions"] >= 1 and engine.stats["cow_copies"] >= 1, engine.stats
    engine.generate([Request(i, p, 5, seed=i) for i, p in enumerate(prompts[:3])])
    assert engine.num_traces == warm
    # The compiled calls are shared: another engine of this model and geometry traces nothing.
    other = Engine(model, params, **geometry)
    assert [c.token_ids for c in other.generate(reqs[:2])] == [c.token_ids for c in out[:2]]
    assert other.num_traces == 0


def test_buckets_by_hand(setup):
    """Powers of two from the minimum bucket, then the limit; the engine's default minimum
    (16) leaves a small engine one bucket per dimension."""
    assert paged.buckets(8) == [1, 2, 4, 8] and paged.buckets(8, on=False) == [8]
    assert paged.buckets(64, True, 16) == [16, 32, 64]
    assert paged.buckets(100, True, 16) == [16, 32, 64, 100]
    assert paged.buckets(10, True, 16) == [10] and paged.buckets(1024, True, 16)[0] == 16
    model, params = setup
    engine = Engine(model, params, max_slots=32, page_size=8, max_pages_per_seq=12)
    assert engine.slot_buckets() == [16, 32] and engine.page_buckets() == [12]


def test_page_allocator_and_prefix_index_by_hand():
    alloc = PageAllocator(4)
    assert [alloc.alloc(), alloc.alloc(), alloc.alloc(), alloc.alloc()] == [1, 2, 3, None]
    alloc.incref(2)
    assert not alloc.decref(2) and alloc.decref(2) and alloc.num_free == 1
    assert alloc.alloc() == 2 and alloc.peak_used == 3
    with pytest.raises(ValueError):
        PageAllocator(4).decref(1)

    index = PrefixIndex(page_size=2)
    from tg_jax.engine.pages import chain_key

    root = index.root()
    index.register(5, root, [1, 2])
    index.register(6, chain_key(root, [1, 2]), [3, 4])
    index.register(7, chain_key(root, [1, 2]), [3])
    assert index.match([1, 2, 3, 4, 9], 5) == ([5, 6], 4)
    assert index.match([1, 2, 3, 8], 4) == ([5, 6], 3)  # ties: the lowest page
    assert index.match([1, 9], 2) == ([5], 1)
    assert index.match([2, 2], 2) == ([], 0)
    index.write(6, 1, [8])  # page 6 now holds [3, 8]: [3, 4] no longer matches it
    assert index.match([1, 2, 3, 4], 4) == ([5, 6], 3)
    index.forget(5)
    assert index.match([1, 2, 3, 4], 4) == ([], 0)


def test_page_table_writes_copy_a_shared_partial_page_first_by_hand():
    """PageTable with pages of 2: a follower sharing its leader's pages [1, 2] at 3 cached
    tokens writes its 4th position into page 2, shared: a fresh page takes page 2's contents
    (the copy callback) and its record, the follower holds [1, new], page 2 keeps one ref."""
    from tg_jax.engine.pages import PageTable
    from tg_jax.engine.requests import Sequence

    table = PageTable(num_pages=8, page_size=2)

    def alloc(seq):  # the engine's policy (evict, preempt) is not needed: pages are free
        return table.allocator.alloc()

    leader = Sequence(Request("a", [1, 2, 3], max_new_tokens=2))
    leader.tokens = [1, 2, 3]
    assert table.prepare_write(leader, 3, alloc, None)
    table.record_write(leader, 3)
    assert leader.pages == [1, 2] and leader.cached == 3 and table.index.tokens(2) == [3]
    follower = Sequence(Request("b", [1, 2, 3, 7], max_new_tokens=2))
    follower.tokens = [1, 2, 3, 7]
    pages, matched = table.index.match(follower.tokens, 3)
    assert (pages, matched) == ([1, 2], 3)
    for p in pages:
        table.allocator.incref(p)
    follower.pages, follower.cached = list(pages), matched
    copies = []
    assert table.prepare_write(follower, 1, alloc, lambda o, n: copies.append((o, n)))
    assert copies == [(2, 3)] and follower.pages == [1, 3]
    assert list(table.allocator.refcount[:4]) == [0, 2, 1, 1]
    table.record_write(follower, 1)
    assert table.index.tokens(3) == [3, 7] and table.index.tokens(2) == [3]
    grid = table.table([leader, None, follower], widths=[1, 2, 4])
    assert grid.tolist() == [[1, 2], [0, 0], [1, 3]]  # unused rows: the scratch page 0
    table.free(leader)
    assert leader.pages == [] and list(table.allocator.refcount[:4]) == [0, 1, 0, 1]
    assert table.index.tokens(2) == []  # a freed page leaves the index


@pytest.mark.slow
def test_agentic_bench_section_runs_both_arms_on_one_workload():
    """tg_jax.bench.agentic at toy sizes: both arms generate the workload's tokens, at equal
    KV bytes, and the figures are finite."""
    from tg_jax.bench.agentic import agentic_section, make_workload

    w = make_workload(3, 2, median_tokens=4, max_tokens=8, median_tool_s=0.002, vocab=96)
    tools = np.concatenate(w.tool_s)
    assert np.mean(tools >= 10 * np.median(tools)) >= 0.1  # the heavy tail
    fields = dict(vocab_size=96, d_model=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, mlp_dim=80, max_seq_len=128)  # fmt: skip
    out = agentic_section(
        episodes=3, max_turns=2, median_tokens=4, max_tokens=8, median_tool_s=0.002,
        page_size=4, prefill_chunk=8, model_fields=fields, warmup=False,
        engine_options=dict(bucket_pages=False, bucket_slots=False),
        step_episodes=5, step_rows=2, swe_runner="sandbox",
    )  # fmt: skip
    assert all(np.isfinite(v) for v in out.values())
    assert out["agentic/tokens"] == sum(map(sum, w.turn_tokens))
    assert out["agentic/kv_bytes"] == out["agentic/lockstep_kv_bytes"]
    # No engine beats the slowest episode's own tool seconds: the bound is the lock-step wall
    # (tokens / tok_s) over them.
    lock_wall = out["agentic/tokens"] / out["agentic/lockstep_tok_s"]
    slowest = max(sum(t) for t in w.tool_s)
    assert out["agentic/speedup_tool_bound"] == pytest.approx(lock_wall / slowest, rel=1e-6)
    # The RL step's shape: 5 episodes, 2 rows at a time for the lock-step sampler; equal bytes.
    step = make_workload(5, 2, median_tokens=4, max_tokens=8, median_tool_s=0.002, vocab=96)
    assert out["agentic/step_tokens"] == sum(map(sum, step.turn_tokens))
    assert out["agentic/step_kv_bytes"] == out["agentic/step_lockstep_kv_bytes"]
    assert out["agentic/step_kv_bytes"] < out["agentic/kv_bytes"]  # 2 rows' cache, not 3
    # Real tools: every call ran a SWE task's tests in the sandbox.
    assert out["agentic/swe_tool_s_median"] > 0 and out["agentic/swe_speedup"] > 0
    slot_bytes = 2 * 2 * 2 * 16 * 4  # k and v, 2 layers, 2 kv heads, head dim 16, fp32
    assert out["agentic/kv_bytes_per_live_token"] >= slot_bytes
    assert out["agentic/tok_s"] > 0 and out["agentic/lockstep_tok_s"] > 0
    assert 0 < out["agentic/slot_occupancy"] <= 1


@pytest.mark.slow
def test_multi_step_decode_draws_what_single_steps_draw(setup):
    """decode_steps=5: up to 5 tokens a row per decode call, the same tokens and log-probs as
    one a call, through slot refills, stop ids (one checked on the device, one only on the
    host: stop_width=1), token budgets that are no multiple of 5, preemption and a
    continuation; about a fifth of the scheduling steps."""
    prompts = _prompts((5, 13, 1, 9, 20, 3), seed=11)
    free = _engine(setup).generate(_requests(prompts, n=12))
    stops = (free[1].token_ids[6], free[4].token_ids[2])  # the second: host-checked only
    reqs = [Request(i, p, 7 + i, temperature=(0.0, 1.0)[i % 2], seed=i, stop_ids=stops)
            for i, p in enumerate(prompts)]  # fmt: skip
    cont = [Request("c", [7, 8], 9, temperature=1.0, continue_from=2)]
    for geometry in ({}, {"num_pages": 13}):  # the second: preemption
        one = _engine(setup, rng=jax.random.key(4), **geometry)
        ref = one.generate(reqs) + one.generate(cont)
        many = _engine(setup, rng=jax.random.key(4), decode_steps=5, stop_width=1, **geometry)
        out = many.generate(reqs) + many.generate(cont)
        assert [c.finish_reason for c in out] == [c.finish_reason for c in ref]
        assert any(c.finish_reason == "stop" and c.token_ids[-1] == stops[1] for c in out)
        for a, b in zip(out, ref, strict=True):
            assert a.token_ids == b.token_ids
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
            np.testing.assert_allclose(a.raw_logprobs, b.raw_logprobs, atol=1e-5)
        assert many.stats["decode_tokens"] == one.stats["decode_tokens"]
        if not geometry:
            assert many.stats["steps"] < one.stats["steps"] / 3, (many.stats, one.stats)
        else:
            assert many.stats["preemptions"] >= 1
    with pytest.raises(ValueError, match="decode_steps"):
        _engine(setup, decode_steps=0)
