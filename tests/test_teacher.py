"""Compact teacher forward (first hint on, the student's prefix keys/values) == full rows."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tg_jax import config_lib
from tg_jax.models import ModelConfig, Transformer, hidden_states, init_params
from tg_jax.models.decode import forward_from_prefix
from tg_jax.rl import teacher
from tg_jax.rl.batch import build_batch
from tg_jax.testing import synthetic_trajectories

TINY = dict(
    vocab_size=272, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    mlp_dim=64, max_seq_len=256,
)  # fmt: skip
MOE = dict(TINY, mlp_dim=0, num_experts=4, experts_per_token=2, moe_mlp_dim=16)


def _model(**overrides):
    model = Transformer(ModelConfig.from_config(config_lib.model_config(**overrides)))
    return model, init_params(model, jax.random.key(0))


def _teacher_at_students(model, params, batch):
    """Teacher hidden states gathered to student positions (the student pass included)."""

    def fn(params, batch):
        _, prefix = teacher.student_forward(model, params, batch, keep_prefix=True)
        rows = teacher.teacher_rows_hidden(model, params, batch, prefix)
        return teacher.gather_teacher(rows, batch)

    return jax.jit(fn)(params, jax.tree.map(jnp.asarray, batch))


@pytest.mark.parametrize(
    "overrides,mode",
    [
        ({}, "per_trajectory"),
        ({"remat_policy": "full", "scan_unroll": 2}, "per_trajectory"),
        ({"attn_query_block": 32}, "per_turn"),
        (MOE, "per_trajectory"),
    ],
)
def test_compact_teacher_hidden_equals_full_rows(overrides, mode):
    model, params = _model(**{**TINY, **overrides})
    trajs = synthetic_trajectories(np.random.default_rng(3), 6, 160, hint_len=7, num_turns=3)
    kw = dict(max_len=192, teacher_max_len=224, mode=mode, max_teacher_rows=24,
              pad_to_multiple=16, micro_batches=2)  # fmt: skip
    full, compact = build_batch(trajs, **kw), build_batch(trajs, **kw, compact=True)
    # Several query blocks (per_turn rows hold one turn each: shorter).
    assert compact.teacher_tokens_BtxTt.shape[1] > (64 if mode == "per_trajectory" else 32)
    mask = compact.distill_mask_BxT
    assert mask.sum() > 50 and (mask == full.distill_mask_BxT).all()
    for b_full, b_compact in zip(_split(full), _split(compact), strict=True):
        want = _teacher_at_students(model, params, b_full)
        got = _teacher_at_students(model, params, b_compact)
        m = b_compact.distill_mask_BxT
        np.testing.assert_allclose(np.asarray(got)[m], np.asarray(want)[m], atol=2e-5, rtol=1e-4)


def _split(batch):
    from tg_jax.rl.batch import split_batch  # noqa: PLC0415

    return split_batch(batch, 2)


def test_forward_from_prefix_continues_a_sequence():
    """A block after a prefix of L_b tokens (per row) == the full forward's positions L_b on."""
    model, params = _model(**TINY)
    b, n, s = 2, 150, 96
    tokens = jax.random.randint(jax.random.key(1), (b, n), 0, 272)
    positions = jnp.broadcast_to(jnp.arange(n), (b, n))
    full = hidden_states(model, params, tokens, positions, jnp.ones_like(tokens))
    lengths = np.array([40, 70])
    fake_batch = _prefix_batch(tokens, positions, s)
    _, prefix = teacher.student_forward(model, params, fake_batch, keep_prefix=True)
    keys, values = teacher._prefix_keys_values(model, params, prefix, fake_batch)
    t = n - int(lengths.max())
    block = jnp.stack([tokens[r, lengths[r] : lengths[r] + t] for r in range(b)])
    block_pos = jnp.asarray(lengths)[:, None] + jnp.arange(t)[None]
    seg = jnp.ones_like(block).at[0, t - 5 :].set(0)  # padding at the end of row 0
    fn = jax.jit(functools.partial(forward_from_prefix, model))
    out = fn(params, block, block_pos, seg, keys, values, jnp.asarray(lengths))
    for r in range(b):
        real = int(seg[r].sum())
        np.testing.assert_allclose(
            out[r, :real], full[r, lengths[r] : lengths[r] + real], atol=2e-5, rtol=1e-4
        )


def _prefix_batch(tokens, positions, s):
    """A stand-in `Batch` with what `student_forward` / `_prefix_keys_values` read."""
    import dataclasses  # noqa: PLC0415

    @dataclasses.dataclass
    class _B:
        tokens_BxT: jax.Array
        positions_BxT: jax.Array
        segment_ids_BxT: jax.Array
        teacher_src_row_Bt: jax.Array
        teacher_prefix_len: int

    return _B(tokens, positions, jnp.ones_like(tokens), jnp.arange(tokens.shape[0]), s)
