"""The core every method of the loss shares: the batch it reads and the counts it divides by.

`Batch` is the training batch (built on the host by `tg_jax.rl.batch.build_batch`; its
conventions are that module's). `normalizers` counts the whole batch (assistant tokens,
sequences, episodes, |M|) before any micro-batch split, and `shares` gives a micro-batch's
weight in the whole-batch means: every term of the loss (GRPO's, TG's, the peers') divides by
these, so micro-batch shares add up to the big batch's loss.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from tg_jax.rl.step_config import RLConfig, TGConfig


@flax.struct.dataclass
class Batch:
    """A training batch; B rows, T positions, B_t teacher rows of T_t positions.

    Attributes:
      tokens_BxT: int32 student tokens (0 = padding).
      positions_BxT: int32 RoPE positions (0..T-1).
      segment_ids_BxT: int32, 1 on real tokens, 0 on padding (attention ignores 0).
      targets_BxT: int32 tokens[t + 1] (0 at the last position and on padding).
      loss_mask_BxT: bool, the target was produced by the policy (THINK or ANSWER role).
      answer_mask_BxT: bool, the target is an ANSWER token.
      thinking_mask_BxT: bool, the target is a THINK token (<think>...</think>, tags included).
      failed_turn_mask_BxT: bool, the target belongs to an assistant turn that broke at least
        one requirement.
      unmet_turn_mask_BxT: bool, failed, or the environment refused the turn (a requirement
        met there earns no reward: `rl.requirement_credit` "turn" credits it as unmet).
      tg_mask_BxT: bool, M: the tokens the TG term distils (`tg_jax.rl.tg.mask.tg_mask`: the
        produced tokens of targeted turns with a hinted teacher counterpart, thinking tokens
        only with include_thinking; less the host-side cuts of tg.span, tg.mask_hint_copies
        and tg.distill_budget).
      requirement_ids_BxT: int32 index into `requirement_names` of the first targeted
        requirement of the target's turn (sorted names), -1 for none.
      turn_ids_BxT: int32 assistant-turn index of the target, -1 for non-assistant tokens.
      behaviour_logprobs_BxT: float32 sampler log-prob of the target (0 where not sampled).
      teacher_row_BxT: int32 teacher row (local to the micro-batch) for each position.
      teacher_pos_BxT: int32 teacher position whose logits predict the teacher's copy of
        the target.
      teacher_tokens_BtxTt, teacher_positions_BtxTt, teacher_segment_ids_BtxTt: the teacher
        sequences, same conventions as the student's.
      rewards: reward component name -> float32 [B] (0 on padding rows).
      group_ids_B: int32 GRPO group of each row.
      policy_version_B: int32 policy version that sampled each row (-1 on padding rows).
      valid_B: bool, False for padding rows.
      head_B: bool, the row counts its episode in the group statistics and reward metrics
        (`tg_jax.rl.hidden_thinking`: one row per turn, the first counts); None = valid_B.
      teacher_src_row_Bt, teacher_start_Bt: compact teacher rows only (else None): int32 the
        student row (local to the micro-batch) whose prefix the row continues, and the
        student position p of its first hint (`tg_jax.rl.tg.compact`).
      routes_BxTxLxJ, teacher_routes_BtxTtxLxJ: int16 MoE router replay, -1 = the router's
        own choice (`tg_jax.rl.routing`); None without recorded routing.
      requirement_names: static tuple of requirement names (the ids' meaning).
      teacher_mode: static, the `TeacherMode` the teacher rows were built with.
      teacher_compact: static, the teacher rows are compact (`tg_jax.rl.tg.compact`).
      teacher_prefix_len: static, compact rows: the student key/value slots the teacher sees.
    """

    tokens_BxT: Any
    positions_BxT: Any
    segment_ids_BxT: Any
    targets_BxT: Any
    loss_mask_BxT: Any
    answer_mask_BxT: Any
    thinking_mask_BxT: Any
    failed_turn_mask_BxT: Any
    tg_mask_BxT: Any
    requirement_ids_BxT: Any
    turn_ids_BxT: Any
    behaviour_logprobs_BxT: Any
    teacher_row_BxT: Any
    teacher_pos_BxT: Any
    teacher_tokens_BtxTt: Any
    teacher_positions_BtxTt: Any
    teacher_segment_ids_BtxTt: Any
    rewards: dict[str, Any]
    group_ids_B: Any
    policy_version_B: Any
    valid_B: Any
    unmet_turn_mask_BxT: Any = None
    teacher_src_row_Bt: Any = None
    teacher_start_Bt: Any = None
    routes_BxTxLxJ: Any = None
    teacher_routes_BtxTtxLxJ: Any = None
    head_B: Any = None
    requirement_names: tuple[str, ...] = flax.struct.field(pytree_node=False, default=())
    teacher_mode: str = flax.struct.field(pytree_node=False, default="per_trajectory")
    teacher_compact: bool = flax.struct.field(pytree_node=False, default=False)
    teacher_prefix_len: int = flax.struct.field(pytree_node=False, default=0)


class Normalizers(NamedTuple):
    """Whole-batch counts that micro-batch losses are divided by (scalars, R = requirements)."""

    num_tokens: jax.Array  # assistant tokens (loss mask)
    num_seqs: jax.Array  # rows with at least one assistant token
    num_episodes: jax.Array  # of those, the head rows (Batch.head_B; = num_seqs without)
    num_distilled: jax.Array  # |M|
    req_tokens_R: jax.Array  # |M| per requirement


def normalizers(batch: Batch, tg_cfg: TGConfig) -> Normalizers:
    """Counts over the whole batch (before a micro-batch split); |M| is 0 for a method that
    distils nothing (`TGConfig.distils`)."""
    loss_mask_BxT = batch.loss_mask_BxT.astype(bool)
    mask_BxT = batch.tg_mask_BxT.astype(bool) & tg_cfg.distils
    num_req = len(batch.requirement_names)
    onehot_BxTxR = jax.nn.one_hot(batch.requirement_ids_BxT, num_req, dtype=jnp.float32)
    req_tokens_R = (onehot_BxTxR * mask_BxT[..., None].astype(jnp.float32)).sum(axis=(0, 1))
    seqs_B = loss_mask_BxT.sum(axis=-1) > 0
    heads_B = seqs_B if batch.head_B is None else seqs_B & batch.head_B.astype(bool)
    return Normalizers(
        num_tokens=loss_mask_BxT.sum().astype(jnp.float32),
        num_seqs=seqs_B.sum().astype(jnp.float32),
        num_episodes=heads_B.sum().astype(jnp.float32),
        num_distilled=mask_BxT.sum().astype(jnp.float32),
        req_tokens_R=req_tokens_R,
    )


def fraction(local: jax.Array, total: jax.Array) -> jax.Array:
    """local / total, 0 when total is 0: the weight of a micro-batch's mean in the batch mean."""
    return local.astype(jnp.float32) / jnp.maximum(total, 1.0)


class Shares(NamedTuple):
    """A micro-batch's weight in the whole-batch means (scalars)."""

    agg: jax.Array  # of the policy loss's aggregation (tokens or sequences, by agg_mode)
    tokens: jax.Array  # of token means over assistant tokens


def shares(batch: Batch, norms: Normalizers, rl_cfg: RLConfig) -> Shares:
    """This (micro-)batch's `Shares` of the whole batch counted in `norms`."""
    loss_mask_BxT = batch.loss_mask_BxT.astype(bool)
    n_tok = loss_mask_BxT.sum()
    n_seq = (loss_mask_BxT.sum(axis=-1) > 0).sum()
    tokens = fraction(n_tok, norms.num_tokens)
    agg = tokens if rl_cfg.agg_mode == "token_mean" else fraction(n_seq, norms.num_seqs)
    return Shares(agg=agg, tokens=tokens)
