"""Compact teacher forward (first hint on, the student's prefix keys/values) == full rows; the
divergence at the compact rows' slots (loss and gradients) == over all student positions."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tg_jax import config_files, config_lib
from tg_jax.models import ModelConfig, Transformer, forward, hidden_states, init_params
from tg_jax.models.decode import forward_from_prefix
from tg_jax.rl import train_step
from tg_jax.rl.batch import build_batch
from tg_jax.rl.step_config import StepConfig
from tg_jax.rl.tg import teacher
from tg_jax.rl.tg.divergence import chunked_token_stats
from tg_jax.testing import synthetic_trajectories

TINY = dict(
    vocab_size=272, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    mlp_dim=64, max_seq_len=256,
)  # fmt: skip
MOE = dict(TINY, mlp_dim=0, num_experts=4, experts_per_token=2, moe_mlp_dim=16)


def _model(**overrides):
    """(model, params), made once per model config for the whole module."""
    return _cached_model(tuple(sorted(overrides.items())))


@functools.cache
def _cached_model(items):
    model = Transformer(ModelConfig.from_config(config_lib.model_config(**dict(items))))
    return model, init_params(model, jax.random.key(0))


_JITTED = {}


def _jitted(key, make):
    """One jitted function per key (a model's id, a step config): traced once per shape."""
    if key not in _JITTED:
        _JITTED[key] = jax.jit(make())
    return _JITTED[key]


def _teacher_at_students(model, params, batch):
    """Teacher hidden states gathered to student positions (the student pass included)."""

    def make():
        def fn(params, batch):
            _, prefix, _ = teacher.student_forward(model, params, batch, keep_prefix=True)
            rows = teacher.teacher_rows_hidden(model, params, batch, prefix)
            return teacher.gather_teacher(rows, batch)

        return fn

    fn = _jitted(("teacher_at_students", id(model)), make)
    return fn(params, jax.tree.map(jnp.asarray, batch))


@pytest.mark.slow
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
    mask = compact.tg_mask_BxT
    assert mask.sum() > 50 and (mask == full.tg_mask_BxT).all()
    for b_full, b_compact in zip(_split(full), _split(compact), strict=True):
        want = _teacher_at_students(model, params, b_full)
        got = _teacher_at_students(model, params, b_compact)
        m = b_compact.tg_mask_BxT
        np.testing.assert_allclose(np.asarray(got)[m], np.asarray(want)[m], atol=2e-5, rtol=1e-4)


def _split(batch):
    from tg_jax.rl.batch import split_batch  # noqa: PLC0415

    return split_batch(batch, 2)


@pytest.mark.slow
def test_forward_from_prefix_continues_a_sequence():
    """A block after a prefix of L_b tokens (per row) == the full forward's positions L_b on."""
    model, params = _model(**TINY)
    b, n, s = 2, 150, 96
    tokens = jax.random.randint(jax.random.key(1), (b, n), 0, 272)
    positions = jnp.broadcast_to(jnp.arange(n), (b, n))
    full = hidden_states(model, params, tokens, positions, jnp.ones_like(tokens))
    lengths = np.array([40, 70])
    fake_batch = _prefix_batch(tokens, positions, s)
    _, prefix, _ = teacher.student_forward(model, params, fake_batch, keep_prefix=True)
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

    @dataclasses.dataclass
    class _B:
        tokens_BxT: jax.Array
        positions_BxT: jax.Array
        segment_ids_BxT: jax.Array
        teacher_src_row_Bt: jax.Array
        teacher_prefix_len: int
        routes_BxTxLxJ: None = None

    return _B(tokens, positions, jnp.ones_like(tokens), jnp.arange(tokens.shape[0]), s)


# ---------------------------------------------------------------------------------------------
# The divergence at the compact teacher rows' slots (`teacher.slot_divergence`).
# ---------------------------------------------------------------------------------------------


def _failing(trajs, which):
    """Verdicts: no turn fails ("none"), a mix ("some": turn k of row i fails when
    (i + k) % 3 == 0, so some rows have none, some one and some two), every turn ("all")."""
    out = []
    for i, t in enumerate(trajs):
        fail = [{"none": False, "some": (i + k) % 3 == 0, "all": True}[which]
                for k in range(t.num_turns)]  # fmt: skip
        out.append(dataclasses.replace(t, turn_verdicts=[{"fence": not f} for f in fail]))
    return out


def _slot_batches(which, mode, gate="failed_turns", micro_batches=1):
    trajs = _failing(synthetic_trajectories(np.random.default_rng(5), 6, 60, hint_len=5,
                                            num_turns=3), which)  # fmt: skip
    kw = dict(max_len=64, teacher_max_len=80, mode=mode, gate=gate, max_teacher_rows=24,
              requirement_names=("fence",), pad_to_multiple=16,
              micro_batches=micro_batches)  # fmt: skip
    return build_batch(trajs, **kw), build_batch(trajs, **kw, compact=True)


@pytest.mark.parametrize("mode", ["per_trajectory", "per_turn"])
def test_teacher_slots_invert_the_index_map(mode):
    """Batch contract: where M is set (`tg_mask_BxT`) the map points at the
    teacher's copy of the target in a row that continues that student row, one to one;
    `teacher_slots` inverts it exactly there and marks every other slot empty."""
    _, batch = _slot_batches("some", mode, micro_batches=2)
    assert batch.tg_mask_BxT.sum() > 20
    slots = jax.jit(teacher.teacher_slots)
    for mb in _split(batch):
        mask = mb.tg_mask_BxT
        b_idx, t_idx = np.nonzero(mask)
        rows, pos = mb.teacher_row_BxT[b_idx, t_idx], mb.teacher_pos_BxT[b_idx, t_idx]
        np.testing.assert_array_equal(mb.teacher_tokens_BtxTt[rows, pos + 1], mb.targets_BxT[mask])
        assert mb.teacher_segment_ids_BtxTt[rows, pos + 1].all()
        np.testing.assert_array_equal(mb.teacher_src_row_Bt[rows], b_idx)
        assert len(set(zip(rows.tolist(), pos.tolist(), strict=True))) == len(rows)
        pos_BtxTt, valid_BtxTt = map(np.asarray, slots(jax.tree.map(jnp.asarray, mb), mask))
        assert valid_BtxTt.sum() == mask.sum() and valid_BtxTt[rows, pos].all()
        np.testing.assert_array_equal(pos_BtxTt[rows, pos], t_idx)
        assert (pos_BtxTt[~valid_BtxTt] == 0).all()


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,estimator,top_k", [("reverse", "full", None), ("forward", "full", None),
                             ("jsd", "full", 5), ("jsd", "sampled", None)],
)  # fmt: skip
def test_slot_divergence_equals_divergence_at_student_positions(kind, estimator, top_k):
    """Pure check on random hidden states: D (value and gradient) at the teacher's slots ==
    D over all B x T positions with the teacher gathered there, on the mask; exactly 0 off it,
    and finite with NaN in the empty slots of the teacher."""
    _, batch = _slot_batches("some", "per_trajectory")
    batch = jax.tree.map(jnp.asarray, batch)
    rows, length = batch.targets_BxT.shape
    t_rows, t_len = batch.teacher_tokens_BtxTt.shape
    k1, k2, k3, k4 = jax.random.split(jax.random.key(2), 4)
    h_BxTxD = jax.random.normal(k1, (rows, length, 8))
    t_BtxTtxD = jax.random.normal(k2, (t_rows, t_len, 8))
    w_DxV = jax.random.normal(k3, (8, 24))
    weight_BxT = jax.random.uniform(k4, (rows, length))
    targets = batch.targets_BxT % 24
    batch = batch.replace(targets_BxT=targets)
    mask = batch.tg_mask_BxT & (jnp.arange(length) % 4 != 0)[None]  # a strict subset
    opts = dict(chunk_size=16, kind=kind, beta=0.3, estimator=estimator, top_k=top_k)

    def unembed(x):
        return x @ w_DxV

    def reference(h):
        gathered = t_BtxTtxD[batch.teacher_row_BxT, batch.teacher_pos_BxT]
        d = chunked_token_stats(h, targets, unembed, teacher_hidden_BxTxD=gathered, **opts)
        return jnp.where(mask, d.divergence_BxT, 0.0)

    def slots(h, t=t_BtxTtxD):
        return teacher.slot_divergence(h, t, batch, unembed, mask, **opts)

    want, got = jax.jit(reference)(h_BxTxD), jax.jit(slots)(h_BxTxD)
    assert float(jnp.abs(want).sum()) > 1.0
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)
    assert (np.asarray(got)[~np.asarray(mask)] == 0).all()
    g_want = jax.grad(lambda h: (reference(h) * weight_BxT).sum())(h_BxTxD)
    g_got = jax.grad(lambda h: (slots(h) * weight_BxT).sum())(h_BxTxD)
    assert float(jnp.abs(g_want).max()) > 1e-3
    np.testing.assert_allclose(g_got, g_want, atol=1e-6, rtol=1e-5)
    # NaN teacher states in slots that predict no masked target reach neither D nor grads.
    _, valid = teacher.teacher_slots(batch, mask)
    poisoned = jnp.where(valid[..., None], t_BtxTtxD, jnp.nan)
    g_poisoned = jax.grad(lambda h: (slots(h, poisoned) * weight_BxT).sum())(h_BxTxD)
    np.testing.assert_allclose(slots(h_BxTxD, poisoned), got, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(g_poisoned, g_got, atol=1e-6, rtol=1e-5)


def _loss_and_grads(cfg, batch, model, params):
    typed = StepConfig.from_config(cfg)

    def make():
        fn = functools.partial(train_step.loss_fn, model=model, rl_cfg=typed.rl, tg_cfg=typed.tg)
        return jax.value_and_grad(fn, has_aux=True)

    fn = _jitted(("loss", typed, id(model)), make)
    (loss, (sums, _)), grads = fn(params, jax.tree.map(jnp.asarray, batch))
    return loss, sums, grads


def _on_policy(batch, model, params):
    """The batch with behaviour log-probs = the model's own (ratios 1: the PG term's gradient
    is not clipped away)."""
    fwd = _jitted(("forward", id(model)), lambda: functools.partial(forward, model))
    logits = fwd(params, batch.tokens_BxT, batch.positions_BxT, batch.segment_ids_BxT)
    logp = np.asarray(jax.nn.log_softmax(logits, -1))
    logp = np.take_along_axis(logp, batch.targets_BxT[..., None], -1)[..., 0]
    return dataclasses.replace(batch, behaviour_logprobs_BxT=np.where(
        batch.loss_mask_BxT, logp, 0.0).astype(np.float32))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "which,mode,overrides",
    [
        ("none", "per_trajectory", {}),
        ("some", "per_trajectory", {}),
        ("all", "per_trajectory", {"tg.kind": "forward", "tg.include_thinking": True}),
        ("some", "per_turn", {"tg.kind": "jsd", "tg.include_thinking": True}),
        ("all", "per_turn", {"tg.kind": "jsd", "tg.beta": 0.3}),
        ("some", "per_trajectory", {"tg.gate": "all_turns", "tg.kind": "forward"}),
        ("none", "per_turn", {"tg.gate": "all_turns"}),
        ("some", "per_trajectory", {"tg.estimator": "sampled", "tg.kind": "jsd"}),
        ("some", "per_turn", {"tg.top_k": 64}),
    ],
)
def test_compact_step_loss_and_grads_equal_full_rows(which, mode, overrides, monkeypatch):
    """The train step's loss, metrics and gradients with compact rows (D at the teacher's
    slots, forced on at any share of slots) == full rows (D over all B x T positions): the
    reference path of tg.compact=False. Without a targeted turn the TG step is the GRPO step
    exactly."""
    monkeypatch.setattr(teacher, "MAX_SLOT_SHARE", 10.0)
    model, params = _model(**TINY)
    cfg = ml_collections.ConfigDict()
    cfg.model = config_lib.model_config(**TINY)
    cfg.rl = config_lib.rl_config(reward_weights={"task": 1.0, "fence": 0.5})
    cfg.tg = config_lib.tg_config(chunk_size=16, max_teacher_rows=24, teacher_mode=mode)
    cfg.tg.lambda_tg = 1.0  # the TG term at GRPO's scale, so the tolerances below bite
    cfg.optim = config_lib.optim_config()
    cfg = config_files.apply_overrides(cfg, overrides)
    full, compact = _slot_batches(which, mode, gate=cfg.tg.gate)
    assert teacher.divergence_at_slots(compact) and not teacher.divergence_at_slots(full)
    full, compact = _on_policy(full, model, params), _on_policy(compact, model, params)
    np.testing.assert_array_equal(compact.tg_mask_BxT, full.tg_mask_BxT)
    loss_a, sums_a, grads_a = _loss_and_grads(cfg, full, model, params)
    loss_b, sums_b, grads_b = _loss_and_grads(cfg, compact, model, params)
    targeted = which != "none" or cfg.tg.gate == "all_turns"
    assert (float(sums_a["tg_loss"]) > 0.0) == targeted  # exactly 0 without a targeted turn
    for k in sums_a:
        np.testing.assert_allclose(sums_a[k], sums_b[k], rtol=1e-5, atol=1e-7, err_msg=k)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6, atol=1e-7)
    for x, y in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6, rtol=1e-4)
    if not targeted:
        grpo = _loss_and_grads(config_files.apply_overrides(cfg, {"tg.enabled": False}), compact,
                               model, params)  # fmt: skip
        assert float(grpo[0]) == float(loss_b)
        # Two programs (the TG term compiled in or not): equal to float32 rounding, as the
        # compiler orders their sums (tests/compile_settings.py).
        for x, y in zip(jax.tree.leaves(grpo[2]), jax.tree.leaves(grads_b), strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-8)


def test_divergence_at_slots_only_when_the_slots_are_few():
    _, some = _slot_batches("some", "per_trajectory")
    _, every = _slot_batches("all", "per_trajectory")
    share = lambda b: b.teacher_tokens_BtxTt.size / b.targets_BxT.size  # noqa: E731
    assert share(some) <= teacher.MAX_SLOT_SHARE < share(every)
    assert teacher.divergence_at_slots(some) and not teacher.divergence_at_slots(every)


# ---------------------------------------------------------------------------------------------
# The layout choice (compact rows only where they pay) and the full-row teacher forward.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["per_trajectory", "per_turn"])
def test_compact_rows_only_where_they_pay(mode):
    """build_batch(compact=True, min_compact_saving=s) keeps compact rows exactly when their
    B_t x T_t token slots are at most (1 - s) of the full rows' (the rule's full-row shape is
    the real one), and otherwise gives the full-rows batch, array for array."""
    trajs = _failing(synthetic_trajectories(np.random.default_rng(5), 6, 60, hint_len=5,
                                            num_turns=3), "all")  # fmt: skip
    kw = dict(max_len=64, teacher_max_len=80, mode=mode, max_teacher_rows=24,
              requirement_names=("fence",), pad_to_multiple=16)  # fmt: skip
    full, forced = build_batch(trajs, **kw), build_batch(trajs, **kw, compact=True)
    saving = 1.0 - forced.teacher_tokens_BtxTt.size / full.teacher_tokens_BtxTt.size
    assert forced.teacher_compact and 0.1 < saving < 0.9
    kept = build_batch(trajs, **kw, compact=True, min_compact_saving=saving - 1e-6)
    assert kept.teacher_compact
    for x, y in zip(jax.tree.leaves(kept), jax.tree.leaves(forced), strict=True):
        np.testing.assert_array_equal(x, y)
    fallback = build_batch(trajs, **kw, compact=True, min_compact_saving=saving + 1e-6)
    assert not fallback.teacher_compact and fallback.teacher_prefix_len == 0
    for x, y in zip(jax.tree.leaves(fallback), jax.tree.leaves(full), strict=True):
        np.testing.assert_array_equal(x, y)


def test_default_rule_keeps_compact_rows_that_save_the_prefix():
    """The benchmark's rule (MIN_COMPACT_SAVING): every turn failed still saves the prefix
    before the first hint (20% of the slots here), enough to keep compact rows; a saving
    below the bar falls back to full rows."""
    from tg_jax.rl.tg.compact import MIN_COMPACT_SAVING, compaction_pays  # noqa: PLC0415

    kw = dict(max_len=64, teacher_max_len=80, requirement_names=("fence",), pad_to_multiple=16,
              compact=True, min_compact_saving=MIN_COMPACT_SAVING)  # fmt: skip
    base = synthetic_trajectories(np.random.default_rng(5), 6, 60, hint_len=5, num_turns=3)
    assert build_batch(_failing(base, "all"), **kw).teacher_compact
    assert build_batch(_failing(base, "some"), **kw).teacher_compact
    assert compaction_pays(90, 100, MIN_COMPACT_SAVING)
    assert not compaction_pays(91, 100, MIN_COMPACT_SAVING)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [{}, {"attn_query_block": 48}, MOE])
def test_full_row_teacher_in_query_blocks_equals_model_forward(overrides, monkeypatch):
    """Full teacher rows run in causal query blocks (`teacher_model`) == the model's own
    forward (one block) on every real teacher token; a model with query blocks keeps its own."""
    monkeypatch.setattr(teacher, "TEACHER_QUERY_BLOCK", 128)
    model, params = _model(**{**TINY, **overrides})
    tm = teacher.teacher_model(model)
    want_block = overrides.get("attn_query_block", teacher.TEACHER_QUERY_BLOCK)
    assert tm.config.attn_query_block == want_block
    assert (tm is model) == ("attn_query_block" in overrides)
    trajs = synthetic_trajectories(np.random.default_rng(3), 4, 200, hint_len=7, num_turns=3)
    batch = build_batch(trajs, max_len=256, teacher_max_len=256, pad_to_multiple=16)
    assert batch.teacher_tokens_BtxTt.shape[1] > want_block  # several blocks
    batch = jax.tree.map(jnp.asarray, batch)
    got = jax.jit(lambda p: teacher.teacher_rows_hidden(model, p, batch, None))(params)
    one_block = model.clone(config=dataclasses.replace(model.config, attn_query_block=0))
    want = jax.jit(lambda p: hidden_states(
        one_block, p, batch.teacher_tokens_BtxTt, batch.teacher_positions_BtxTt,
        batch.teacher_segment_ids_BtxTt))(params)  # fmt: skip
    real = np.asarray(batch.teacher_segment_ids_BtxTt) > 0
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-5, rtol=1e-4)
