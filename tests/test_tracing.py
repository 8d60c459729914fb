"""One thread traces at a time (tg_jax.tracing): the race that crashed the demo, reproduced
with its window widened, and the model built and traced by two threads at once with the fix."""

import ast
import dataclasses
import pathlib
import threading
import time
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import kw_only_dataclasses

from tg_jax import tracing
from tg_jax.models import ModelConfig, Transformer, qwen3
from tg_jax.sampling.sampler import Sampler

PACKAGE = pathlib.Path(tracing.__file__).parent
CFG = ModelConfig(
    vocab_size=32, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32
)


@pytest.fixture
def wide_window(monkeypatch):
    """Flax builds a module class by reading its bases' `__dataclass_fields__` and removing
    (then restoring) their keyword-only fields. The demo crashed when two threads did this at
    once; the window is microseconds wide, so here every field read sleeps 2 ms."""

    def slow_fields(obj):
        out = []
        for f in obj.__dataclass_fields__.values():  # the live dict, as dataclasses reads it
            time.sleep(0.002)
            if f._field_type is dataclasses._FIELD:
                out.append(f)
        return tuple(out)

    class _Proxy(types.ModuleType):
        def __getattr__(self, name):
            return getattr(dataclasses, name)

    proxy = _Proxy("dataclasses")
    proxy.fields = slow_fields
    monkeypatch.setattr(kw_only_dataclasses, "dataclasses", proxy)


def _in_threads(fn, n=2):
    """Runs fn(i) in n threads at once; returns (results, errors)."""
    results, errors = [None] * n, []
    barrier = threading.Barrier(n)

    def run(i):
        barrier.wait()
        try:
            results[i] = fn(i)
        except Exception as e:  # noqa: BLE001 (collected and asserted on)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


def _build_scan_class(_):
    """What Transformer.setup did on every trace before the fix: a new scanned class."""
    for _ in range(4):
        nn.scan(
            qwen3.DecoderLayer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast),
            length=2,
        )


def test_the_race_reproduces_when_classes_are_built_per_call(wide_window):
    _, errors = _in_threads(_build_scan_class)
    assert errors, "two threads building Flax classes at once should collide"
    assert any("dictionary changed size during iteration" in str(e) for e in errors), errors


@pytest.mark.slow
def test_two_threads_build_and_trace_the_model_at_once(wide_window):
    """Each thread builds its own Transformer and traces its forward (a new jit each, so both
    trace), then both sample with one shared Sampler (one jitted function, traced for two
    shapes): no error, and every result equals the same computation run alone."""
    params = nn.unbox(
        Transformer(CFG).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    )
    tokens = [jnp.arange(5, dtype=jnp.int32)[None] % 32, jnp.arange(7, dtype=jnp.int32)[None]]
    sampler = Sampler(Transformer(CFG), pad_id=0, length_multiple=8)
    prompts = [[[1, 2, 3]], [[4, 5, 6, 7, 8, 9, 10, 11, 12]]]

    def forward(i):
        model = Transformer(CFG)
        return tracing.jit(lambda p, t: qwen3.forward(model, p, t))(params, tokens[i])

    def sample(i):
        out = sampler.sample(params, prompts[i], max_new_tokens=4 + 8 * i, rng=jax.random.key(i))
        return np.asarray(out.tokens[0])

    for fn in (forward, sample):
        together, errors = _in_threads(fn)
        assert not errors, errors
        for i in range(2):
            np.testing.assert_allclose(np.asarray(together[i]), np.asarray(fn(i)), atol=1e-6)


def test_the_scanned_layer_class_is_built_once():
    a = qwen3.scanned_layers("none", 2, 1)
    assert qwen3.scanned_layers("none", 2, 1) is a
    assert qwen3.scanned_layers("full", 2, 1) is not a


def test_a_locked_call_holds_the_lock_and_a_nested_one_reenters():
    seen = []

    def inner(x):
        seen.append(tracing.TRACE_LOCK._is_owned())
        return x + 1

    inner_jit = tracing.jit(inner)
    outer = tracing.jit(lambda x: inner_jit(x) * 2)
    assert float(outer(jnp.float32(1.0))) == 4.0
    assert seen == [True]
    assert not tracing.TRACE_LOCK._is_owned()


def test_no_bare_jit_or_eval_shape_in_the_package():
    """Every trace in tg_jax goes through tracing.jit / tracing.eval_shape (the lock)."""
    bare = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "tracing.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "jax"
                and node.attr in ("jit", "eval_shape", "pmap")
            ):
                bare.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} jax.{node.attr}")
    assert not bare, "use tg_jax.tracing instead:\n" + "\n".join(bare)


def test_one_hf_tokenizer_encodes_and_decodes_in_many_threads_at_once(make_bpe_renderer):
    """docs/design.md section 6 keeps one tokenizer for every thread: tg_jax only encodes and
    decodes with it (the Rust tokenizer's shared borrows; never truncation or padding, whose
    setters need an exclusive one and fail "Already borrowed" beside a running encode)."""
    texts = [f"def f(x): return x * {i} + {i % 7}  # case {i}" for i in range(64)]
    tok = make_bpe_renderer(texts, 300).tokenizer
    want = [tok.encode(t) for t in texts]

    def work(i):
        out = []
        for _ in range(20):
            for t, ids in zip(texts, want, strict=True):
                got = tok.encode(t)
                out.append(got == ids and tok.decode(got) == t)
        return all(out)

    results, errors = _in_threads(work, n=8)
    assert not errors, errors
    assert all(results)
