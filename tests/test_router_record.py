"""The rollouts' MoE routing record (router replay, R3, the rollout half): each completion of
the engine, and each row of the lock-step sampler, carries the experts every layer routed each
of its tokens to, which equals the trainer forward's own routing of the same sequence;
prefix-shared, copied-on-write, continued and re-prefilled (preempted) pages carry it like
their keys and values, and so does the sampler's turn cache across turns."""

import functools

import jax
import numpy as np
import pytest

from tg_jax.engine import Engine, Request, paged
from tg_jax.models import ModelConfig, Transformer, init_params
from tg_jax.sampling.sampler import Sampler
from tg_jax.sampling.turn_cache import TurnCache

CFG = ModelConfig(
    vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    mlp_dim=0, max_seq_len=64, num_experts=8, experts_per_token=2, moe_mlp_dim=16,
)  # fmt: skip
GEOMETRY = dict(
    max_slots=4, page_size=4, max_pages_per_seq=12, prefill_chunk=8, prefill_rows=2,
    bucket_pages=False, bucket_slots=False, record_routes=True,
)  # fmt: skip


@pytest.fixture(scope="module")
def setup():
    model = Transformer(CFG)
    params = init_params(model, jax.random.key(3))
    params = jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x, params)  # no near-ties
    return model, params


@functools.cache
def _routing_fn(model):
    """The trainer forward's routing of token rows [B, T] -> [L, B, T, J], compiled once."""

    def fn(params, tokens_BxT):
        _, state = model.apply({"params": params}, tokens_BxT, mutable=["intermediates"])
        (ids,) = [v for p, v in jax.tree_util.tree_leaves_with_path(state)
                  if "router_ids" in jax.tree_util.keystr(p)]  # fmt: skip
        return ids

    return jax.jit(fn)


def _own_routing(model, params, tokens):
    """The trainer forward's routing of one sequence: [n, L, J]. The forward is causal, so the
    sequence's routing is that of its row padded to max_seq_len (one compiled program for
    every length)."""
    row = np.zeros((1, CFG.max_seq_len), np.int32)
    row[0, : len(tokens)] = tokens
    ids = np.asarray(_routing_fn(model)(params, row))
    return np.moveaxis(ids, 0, 2)[0, : len(tokens)]  # [L, 1, T, J] -> [n, L, J]


def _check(model, params, completion, context, start=0):
    """The record of `context` + the completion's tokens, from position `start` on."""
    tokens = list(context) + completion.token_ids
    routes = completion.routed_experts
    assert routes.shape == (len(tokens) - start, CFG.num_layers, CFG.experts_per_token)
    assert routes.dtype == np.int16
    want = _own_routing(model, params, tokens)[start:]
    np.testing.assert_array_equal(routes[:-1], want[:-1])  # every token the engine fed
    assert (routes[-1] == -1).all()  # the last one never was


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, CFG.vocab_size, n)] for n in lengths]


@pytest.mark.slow
def test_routes_equal_the_trainer_forward_shared_prefixes_included(setup):
    """Greedy and sampled requests, more than slots, three sharing one prompt (the followers
    read the leader's pages): every completion's record is the full forward's routing."""
    model, params = setup
    engine = Engine(model, params, **GEOMETRY)
    prompts = _prompts((5, 13, 1, 9, 20)) + [_prompts((11,), seed=7)[0]] * 3
    reqs = [Request(i, p, 10, temperature=0.0 if i % 2 else 1.0, seed=i)
            for i, p in enumerate(prompts)]  # fmt: skip
    done = {c.request_id: c for c in engine.generate(reqs)}
    stats = engine.stats
    assert stats["shared_tokens"] > 0 and stats["cow_copies"] > 0
    for i, p in enumerate(prompts):
        _check(model, params, done[i], p)


@pytest.mark.slow
def test_routes_of_a_continued_and_a_preempted_request(setup):
    """A continuation's record covers its parent's context (kept pages) and its own turn; in a
    pool too small for every sequence, preempted requests re-prefill and still record the
    forward's routing."""
    model, params = setup
    engine = Engine(model, params, **GEOMETRY)
    first = engine.generate([Request("a", _prompts((6,))[0], 5, temperature=0.0)])[0]
    ctx = _prompts((6,))[0] + first.token_ids
    follow = engine.generate([Request("b", [3, 4, 5], 6, temperature=0.0, continue_from="a")])[0]
    _check(model, params, follow, ctx + [3, 4, 5])
    # A multi-turn episode's next turn asks only for its new window (Request.routes_from: its
    # record's last position, the token not fed yet), read from the pages holding it.
    ctx += [3, 4, 5] + follow.token_ids
    for rid, parent, start in (("c", "b", len(ctx) - 1), ("d", "c", 7)):
        turn = engine.generate([Request(rid, [9, 2], 4, temperature=0.0, continue_from=parent,
                                        routes_from=start)])[0]  # fmt: skip
        _check(model, params, turn, ctx + [9, 2], start=start)
        ctx += [9, 2] + turn.token_ids

    small = Engine(model, params, **{**GEOMETRY, "num_pages": 10})
    prompts = _prompts((9, 10, 11, 12), seed=3)
    done = small.generate([Request(i, p, 12, temperature=0.0) for i, p in enumerate(prompts)])
    assert small.stats["preemptions"] > 0
    for c in done:
        _check(model, params, c, prompts[c.request_id])


def test_no_record_unless_asked_and_dense_models_refused(setup):
    model, params = setup
    engine = Engine(model, params, **{**GEOMETRY, "record_routes": False})
    (c,) = engine.generate([Request(0, [1, 2, 3], 4, temperature=0.0)])
    assert c.routed_experts is None and engine.pool.routes is None
    dense = Transformer(ModelConfig(**{**CFG.__dict__, "num_experts": 0, "experts_per_token": 0,
                                       "moe_mlp_dim": 0, "mlp_dim": 32}))  # fmt: skip
    with pytest.raises(ValueError, match="mixture-of-experts"):
        paged.init_pool(dense, 4, 4, routes=True)


@pytest.mark.slow
@pytest.mark.parametrize("segment", [0, 8])
def test_the_lockstep_sampler_records_the_forward_s_routing(setup, segment):
    """One call from the prompts, then three turns through a `TurnCache` (kept contexts,
    appended tokens, rows that shared a prompt): every row's record is the full forward's
    routing of its whole context and turn, the last token unrecorded; the tokens are those
    the sampler draws without recording. With `routes_from` (later turns: from the first
    token not fed yet, as the rollouts ask; one row from 0) only that window comes back."""
    model, params = setup
    recorder = Sampler(model, pad_id=0, length_multiple=16, segment=segment, record_routes=True)
    plain = Sampler(model, pad_id=0, length_multiple=16, segment=segment)
    prompts = _prompts((5, 13, 7)) + [_prompts((9,), seed=4)[0]] * 2
    kw = dict(max_new_tokens=10, temperature=1.0, rng=jax.random.key(1))
    out = recorder.sample(params, prompts, **kw)
    for t, got in zip(out.tokens, plain.sample(params, prompts, **kw).tokens, strict=True):
        np.testing.assert_array_equal(t, got)
    for i, p in enumerate(prompts):
        _check(model, params, _as_completion(out, i), p)
    cache, ctx, rng = TurnCache(), [list(p) for p in prompts], np.random.default_rng(5)
    for turn in range(3):
        keys = list(range(len(ctx)))
        starts = [0] + [len(c) - 4 for c in ctx[1:]] if turn else None
        out = recorder.sample(params, ctx, max_new_tokens=6, temperature=1.0,
                              rng=jax.random.key(turn), cache=cache, keys=keys,
                              routes_from=starts)  # fmt: skip
        for i in range(len(ctx)):
            _check(model, params, _as_completion(out, i), ctx[i], starts[i] if starts else 0)
            ctx[i] = ctx[i] + list(out.tokens[i]) + [int(x) for x in rng.integers(1, 64, 3)]


def _as_completion(out, i):
    class _C:
        token_ids = [int(t) for t in out.tokens[i]]
        routed_experts = out.routes[i]

    return _C()
