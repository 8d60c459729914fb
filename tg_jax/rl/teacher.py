"""The teacher forward of targeted guidance, and the student forward that feeds it.

The teacher is the policy's own weights on the hinted context, under stop-gradient. Two
layouts of its rows (`tg_jax.rl.batch`):

  * full rows (build_batch(compact=False)): the whole hinted sequence, run through the model
    like the student;
  * compact rows (compact=True, `tg_jax.rl.compact`): only the targeted trajectories (turns),
    from the first hint on. Before the first hint the hinted sequence is token for token the
    student's, so its keys and values are the student's: the student forward hands out each
    layer's attention input (after `attn_norm`) and normalised keys (after `k_norm`), which
    give the prefix's values (one [D, K * H] projection of the prefix tokens: the only prefix
    work redone) and keys (RoPE at the student positions). The teacher then runs its tokens
    from the first hint over those prefix slots (`models.decode.forward_from_prefix`).

Both give the same teacher hidden states at every distilled position (up to float rounding:
the compact pass uses the decode path's fused matmuls).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from tg_jax.models import hidden_states
from tg_jax.models.decode import forward_from_prefix
from tg_jax.models.layers import RMSNorm, rope
from tg_jax.rl.batch import Batch


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
    model: nn.Module, params: Any, batch: Batch, *, keep_prefix: bool
) -> tuple[jax.Array, StudentPrefix | None]:
    """Student final hidden states [B, T, D], and with keep_prefix the `StudentPrefix`."""
    tokens, positions, segments = batch.tokens_BxT, batch.positions_BxT, batch.segment_ids_BxT
    if not keep_prefix:
        return hidden_states(model, params, tokens, positions, segments), None
    hidden_BxTxD, state = model.apply(
        {"params": params}, tokens, positions, segments, True,
        capture_intermediates=_capture, mutable=["intermediates"],
    )  # fmt: skip
    layers = state["intermediates"]["layers"]
    prefix = StudentPrefix(
        attn_in_LxBxTxD=layers["attn_norm"]["__call__"][0],
        k_normed_LxBxTxKxH=layers["attn"]["k_norm"]["__call__"][0],
    )
    return hidden_BxTxD, prefix


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


def teacher_rows_hidden(
    model: nn.Module, params: Any, batch: Batch, prefix: StudentPrefix | None
) -> jax.Array:
    """Teacher hidden states [B_t, T_t, D] of the batch's teacher rows, without gradient.

    Args:
      params: the policy's params (stop-gradiented here).
      batch: a batch (or micro-batch) with teacher rows.
      prefix: the student's `StudentPrefix` for compact rows (None for full rows).
    """
    params = jax.lax.stop_gradient(params)
    if not batch.teacher_compact:
        return hidden_states(
            model, params, batch.teacher_tokens_BtxTt, batch.teacher_positions_BtxTt,
            batch.teacher_segment_ids_BtxTt,
        )  # fmt: skip
    if prefix is None:
        raise ValueError("compact teacher rows need the student's StudentPrefix")
    keys, values = _prefix_keys_values(model, params, jax.lax.stop_gradient(prefix), batch)
    return forward_from_prefix(
        model, params, batch.teacher_tokens_BtxTt, batch.teacher_positions_BtxTt,
        batch.teacher_segment_ids_BtxTt, keys, values, batch.teacher_start_Bt,
    )  # fmt: skip


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
