"""The teacher forward of targeted guidance, and the student forward that feeds it.

The teacher is the policy's own weights on the hinted context, under stop-gradient. Two
layouts of its rows (`tg_jax.rl.batch`):

  * full rows (build_batch(compact=False), or compact=True where compaction would save little,
    `tg_jax.rl.tg.compact.compaction_pays`): the whole hinted sequence, run through the model
    like the student (optionally with its attention in causal query blocks, `teacher_model`);
  * compact rows (compact=True, `tg_jax.rl.tg.compact`): only the targeted trajectories (turns),
    from the first hint on. Before the first hint the hinted sequence is token for token the
    student's, so its keys and values are the student's: the student forward hands out each
    layer's attention input (after `attn_norm`) and normalised keys (after `k_norm`), which
    give the prefix's values (one [D, K * H] projection of the prefix tokens: the only prefix
    work redone) and keys (RoPE at the student positions). The teacher then runs its tokens
    from the first hint over those prefix slots (`models.decode.forward_from_prefix`).

Both give the same teacher hidden states at every distilled position (up to float rounding:
the compact pass uses the decode path's fused matmuls). Full rows are gathered to the student
positions (`gather_teacher`) and the divergence runs over all B x T of them; with compact rows
it runs over the B_t x T_t teacher slots instead (`slot_divergence`: the student's hidden
states are gathered to the slots through the inverted index map, `teacher_slots`), so the
full-vocabulary work also shrinks with the share of failed trajectories.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from tg_jax.models import hidden_states
from tg_jax.models.decode import forward_from_prefix
from tg_jax.models.layers import RMSNorm, rope
from tg_jax.models.moe import load_balancing_loss
from tg_jax.rl.core import Batch
from tg_jax.rl.tg.divergence import chunked_divergence


class StudentPrefix(NamedTuple):
    """What the compact teacher reads from the student forward (L layers, all B rows).

    attn_in_LxBxTxD: each layer's attention input (the `attn_norm` output).
    k_normed_LxBxTxKxH: each layer's keys after `k_norm`, before RoPE.
    """

    attn_in_LxBxTxD: jax.Array
    k_normed_LxBxTxKxH: jax.Array


def _capture(module: nn.Module, method: str) -> bool:
    return isinstance(module, RMSNorm) and module.name in ("attn_norm", "k_norm")


def student_forward(
    model: nn.Module, params: Any, batch: Batch, *, keep_prefix: bool, router_loss: bool = False
) -> tuple[jax.Array, StudentPrefix | None, jax.Array | None]:
    """Student final hidden states [B, T, D]; with keep_prefix the `StudentPrefix`; with
    router_loss (MoE) the load-balancing loss of this forward (`moe.load_balancing_loss`:
    router_aux_loss_coef x HF's Switch-style loss, from the routers' sown loads). Routed by the
    batch's recorded routing where it has one (`Batch.routes_BxTxLxJ`, router replay)."""
    tokens, positions, segments = batch.tokens_BxT, batch.positions_BxT, batch.segment_ids_BxT
    replay = batch.routes_BxTxLxJ
    if not keep_prefix and not router_loss:
        return hidden_states(model, params, tokens, positions, segments, replay), None, None
    hidden_BxTxD, state = model.apply(
        {"params": params},
        tokens,
        positions,
        segments,
        True,
        replay,
        capture_intermediates=_capture if keep_prefix else False,
        mutable=["intermediates"],
    )
    prefix = aux = None
    if keep_prefix:
        layers = state["intermediates"]["layers"]
        prefix = StudentPrefix(
            attn_in_LxBxTxD=layers["attn_norm"]["__call__"][0],
            k_normed_LxBxTxKxH=layers["attn"]["k_norm"]["__call__"][0],
        )
    if router_loss:
        aux = load_balancing_loss(state["intermediates"], model.config)
    return hidden_BxTxD, prefix, aux


def _prefix_keys_values(
    model: nn.Module, params: Any, prefix: StudentPrefix, batch: Batch
) -> tuple[jax.Array, jax.Array]:
    """Keys and values [L, B_t, S, K, H] of the first S = teacher_prefix_len student slots of
    each teacher row's source row, as the student's attention computed them."""
    cfg = model.config
    dt = cfg.jnp_dtype
    s = batch.teacher_prefix_len
    src_Bt = batch.teacher_src_row_Bt
    attn_in = prefix.attn_in_LxBxTxD[:, src_Bt, :s]
    k_normed = prefix.k_normed_LxBxTxKxH[:, src_Bt, :s]
    positions_BtxS = batch.positions_BxT[src_Bt, :s]
    w_v = params["layers"]["attn"]["v_proj"]  # [L, D, K, H]
    values = jnp.einsum("lbsd,ldkh->lbskh", attn_in.astype(dt), w_v.astype(dt))
    keys = jax.vmap(lambda k: rope(k, positions_BtxS, cfg.rope_theta))(k_normed)
    return keys, values


# The full-row teacher forward (the reference teacher's rows, and rows left uncompacted)
# attends in causal query blocks of this many tokens when the model's own `attn_query_block`
# is 0 (one block): exact up to float rounding, since teacher rows are plain causal sequences,
# and keys past a block's last query are never scored. 0 = the model's own attention.
TEACHER_QUERY_BLOCK = 128


def teacher_model(model: nn.Module) -> nn.Module:
    """The model the full-row teacher forward runs: the same params and layers, attention in
    causal query blocks (`TEACHER_QUERY_BLOCK`) unless the model already uses them."""
    cfg = model.config
    if cfg.attn_query_block > 0 or TEACHER_QUERY_BLOCK <= 0:
        return model
    return model.clone(config=dataclasses.replace(cfg, attn_query_block=TEACHER_QUERY_BLOCK))


def teacher_rows_hidden(
    model: nn.Module, params: Any, batch: Batch, prefix: StudentPrefix | None
) -> jax.Array:
    """Teacher hidden states [B_t, T_t, D] of the batch's teacher rows, without gradient.

    Args:
      params: the policy's params (stop-gradiented here).
      batch: a batch (or micro-batch) with teacher rows.
      prefix: the student's `StudentPrefix` for compact rows (None for full rows).
    Routed by the batch's teacher routing where it has one (`Batch.teacher_routes_BtxTtxLxJ`).
    """
    params = jax.lax.stop_gradient(params)
    replay = batch.teacher_routes_BtxTtxLxJ
    if not batch.teacher_compact:
        return hidden_states(
            teacher_model(model),
            params,
            batch.teacher_tokens_BtxTt,
            batch.teacher_positions_BtxTt,
            batch.teacher_segment_ids_BtxTt,
            replay,
        )
    if prefix is None:
        raise ValueError("compact teacher rows need the student's StudentPrefix")
    keys, values = _prefix_keys_values(model, params, jax.lax.stop_gradient(prefix), batch)
    return forward_from_prefix(
        model,
        params,
        batch.teacher_tokens_BtxTt,
        batch.teacher_positions_BtxTt,
        batch.teacher_segment_ids_BtxTt,
        keys,
        values,
        batch.teacher_start_Bt,
        replay,
    )


def gather_teacher(teacher_hidden_BtxTtxD: jax.Array, batch: Batch) -> jax.Array:
    """Teacher hidden states at the student positions of the index map -> [B, T, D].

    per_trajectory (full rows): teacher row b serves student row b, so the gather stays within
    a row (and within a device's shard); per_turn and compact rows: a general row gather.
    """
    pos_BxT, mode = batch.teacher_pos_BxT, batch.teacher_mode
    if mode == "per_trajectory" and not batch.teacher_compact:
        if teacher_hidden_BtxTtxD.shape[0] != pos_BxT.shape[0]:
            raise ValueError("per_trajectory needs one teacher row per student row")
        return jax.vmap(lambda h_TtxD, p_T: h_TtxD[p_T])(teacher_hidden_BtxTtxD, pos_BxT)
    if mode in ("per_trajectory", "per_turn"):
        return teacher_hidden_BtxTtxD[batch.teacher_row_BxT, pos_BxT]
    raise ValueError(f"TG needs a batch built with teacher rows, got teacher_mode {mode!r}")


# `slot_divergence` is used when the teacher slots are at most this share of the B x T student
# positions; above it, D over all positions (one student log-softmax shared with the policy
# loss, no scatter in the backward pass) costs less, and gives the same loss and gradients.
MAX_SLOT_SHARE = 0.5


def divergence_at_slots(batch: Batch) -> bool:
    """Whether the train step computes D at the teacher's slots (`slot_divergence`): compact
    rows whose B_t x T_t slots are at most `MAX_SLOT_SHARE` of the B x T student positions
    (static: from the shapes)."""
    if not batch.teacher_compact:
        return False
    slots, positions = batch.teacher_tokens_BtxTt.size, batch.targets_BxT.size
    return slots <= MAX_SLOT_SHARE * positions


def teacher_slots(batch: Batch, mask_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The compact index map inverted on `mask_BxT`: for each teacher slot (r, j), the student
    position t (in row `teacher_src_row_Bt[r]`) whose target the slot's logits predict.

    The map is one to one on the distilled positions (a student target has one teacher copy,
    a teacher token copies one student target), so the scatter has no collisions there.

    Args:
      batch: a batch (or micro-batch) with compact teacher rows.
      mask_BxT: [B, T] the student positions to invert (M, `Batch.tg_mask_BxT`).

    Returns:
      pos_BtxTt: int32 student position of each slot, 0 where none.
      valid_BtxTt: bool, the slot predicts the target of a masked student position.
    """
    t_rows, t_len = batch.teacher_tokens_BtxTt.shape
    size = t_rows * t_len
    slot_BxT = batch.teacher_row_BxT * t_len + batch.teacher_pos_BxT
    slot_N = jnp.where(mask_BxT.astype(bool), slot_BxT, size).reshape(-1)  # size: dropped
    pos_BxT = jnp.broadcast_to(jnp.arange(mask_BxT.shape[1], dtype=jnp.int32), mask_BxT.shape)
    pos = jnp.zeros((size,), jnp.int32).at[slot_N].set(pos_BxT.reshape(-1), mode="drop")
    valid = jnp.zeros((size,), bool).at[slot_N].set(True, mode="drop")
    return pos.reshape(t_rows, t_len), valid.reshape(t_rows, t_len)


def slot_divergence(
    student_hidden_BxTxD: jax.Array,
    teacher_hidden_BtxTtxD: jax.Array,
    batch: Batch,
    unembed_fn: Callable[[jax.Array], jax.Array],
    mask_BxT: jax.Array,
    **options: Any,
) -> jax.Array:
    """D_t on `mask_BxT`, computed in the compact teacher rows' layout, 0 elsewhere.

    The full-vocabulary divergence runs over the B_t x T_t teacher slots, not all B x T
    student positions: each slot that predicts a masked student target gets that student
    position's hidden state and target (`teacher_slots`), `chunked_divergence` compares the
    two distributions there, and the result is read back through the index map. Empty slots
    (hint tokens, untargeted stretches, padding) see zero hidden states on both sides, so
    they are finite and get no gradient.

    Args:
      student_hidden_BxTxD: [B, T, D] student final hidden states (differentiated).
      teacher_hidden_BtxTtxD: [B_t, T_t, D] `teacher_rows_hidden` (stop-gradiented).
      batch: a batch (or micro-batch) with compact teacher rows.
      unembed_fn: hidden -> logits, as for `chunked_token_stats`.
      mask_BxT: [B, T] the distilled positions M (`Batch.tg_mask_BxT`).
      **options: chunk_size, kind, beta, estimator, top_k of `chunked_divergence`.

    Returns:
      divergence_BxT: float32 [B, T].
    """
    if not batch.teacher_compact:
        raise ValueError("slot_divergence needs compact teacher rows")
    pos_BtxTt, valid_BtxTt = teacher_slots(batch, mask_BxT)
    src_Bt = batch.teacher_src_row_Bt
    take = jax.vmap(lambda x_TxD, p_Tt: x_TxD[p_Tt])
    valid_BtxTtx1 = valid_BtxTt[..., None]
    student_BtxTtxD = jnp.where(valid_BtxTtx1, take(student_hidden_BxTxD[src_Bt], pos_BtxTt), 0)
    teacher_BtxTtxD = jnp.where(valid_BtxTtx1, jax.lax.stop_gradient(teacher_hidden_BtxTtxD), 0)
    targets_BtxTt = take(batch.targets_BxT[src_Bt], pos_BtxTt)
    d_BtxTt = chunked_divergence(
        student_BtxTtxD, teacher_BtxTtxD, targets_BtxTt, unembed_fn, **options
    )
    d_BxT = jnp.where(valid_BtxTt, d_BtxTt, 0.0)[batch.teacher_row_BxT, batch.teacher_pos_BxT]
    return jnp.where(mask_BxT.astype(bool), d_BxT, 0.0)
