"""Looking inside a TG batch at small scale: both next-token distributions, divergences, roles.

What the trainer computes in chunks without ever holding [B, T, V] (tg_jax.rl.train_step), this
module computes in one go for a handful of short sequences, so that notebooks can show it:

  * `next_token_logits`: the student logits on the plain sequence and the teacher logits on
    the hinted sequence, gathered to the student positions through the batch's index map.
    Both are aligned with `targets_BxT` (index t predicts token t + 1), like every batch mask.
  * `divergences`: per-token D_t of each KL direction (tg_jax.rl.tg.divergence.token_divergence).
  * `teacher_roles`: `Role` codes of a teacher row (inserted hint tokens are HINT).
  * `to_tokens`: moves a target-aligned array onto the tokens it describes, for display.
  * `top_tokens` / `plot_top_tokens`: the plain vs hinted next-token distribution at one
    position, as table rows and as a bar plot.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tg_jax import tracing
from tg_jax.models import Transformer, forward
from tg_jax.rl.batch import Batch
from tg_jax.rl.tg.divergence import token_divergence
from tg_jax.sampling.trajectory import Role, Trajectory
from tg_jax.text import Tokenizer

KINDS = ("reverse", "forward", "jsd")
# One compilation per option set instead of one per primitive (eager dispatch is slow on CPU).
_token_divergence = tracing.jit(token_divergence, static_argnames=("kind", "beta", "estimator"))


def failed_turns(traj: Trajectory) -> list[int]:
    """Assistant turns that broke at least one requirement (a None verdict is not a failure)."""
    return [k for k, v in enumerate(traj.turn_verdicts) if any(ok is False for ok in v.values())]


@functools.partial(tracing.jit, static_argnames="model")
def _both_logits(model: Transformer, params: Any, batch: Batch) -> tuple[jax.Array, jax.Array]:
    student_BxTxV = forward(
        model, params, batch.tokens_BxT, batch.positions_BxT, batch.segment_ids_BxT
    )
    teacher_BtxTtxV = forward(
        model,
        params,
        batch.teacher_tokens_BtxTt,
        batch.teacher_positions_BtxTt,
        batch.teacher_segment_ids_BtxTt,
    )
    teacher_BxTxV = teacher_BtxTtxV[batch.teacher_row_BxT, batch.teacher_pos_BxT]
    return student_BxTxV, jax.lax.stop_gradient(teacher_BxTxV)


def next_token_logits(model: Transformer, params: Any, batch: Batch) -> tuple[np.ndarray, ...]:
    """Student and hinted-teacher next-token logits of every student position.

    Args:
      model, params: the policy (the teacher is the same weights).
      batch: a `Batch` with teacher rows (teacher_mode per_trajectory or per_turn), one
        micro-batch.

    Returns:
      (student_logits_BxTxV, teacher_logits_BxTxV) fp32 numpy arrays; position t of both
      predicts targets[b, t]; the teacher row is meaningful where `tg_mask_BxT` is set.
    """
    if batch.teacher_mode == "none":
        raise ValueError("the batch has no teacher rows (built with mode='none')")
    student, teacher = _both_logits(model, params, jax.tree.map(jnp.asarray, batch))
    return np.asarray(student, np.float32), np.asarray(teacher, np.float32)


def divergences(
    student_logits_BxTxV: np.ndarray,
    teacher_logits_BxTxV: np.ndarray,
    *,
    kinds: Sequence[str] = KINDS,
    beta: float = 0.5,
    targets_BxT: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Per-token divergence D_t of each kind, over the full vocabulary.

    Args:
      student_logits_BxTxV, teacher_logits_BxTxV: from `next_token_logits`.
      kinds: any of "reverse", "forward", "jsd".
      beta: teacher weight of the JSD mixture.
      targets_BxT: when given, also "<kind>/sampled": the single-sample estimate from the
        produced tokens (the `sampled` estimator of the TG loss).

    Returns:
      name -> [B, T] float32 D (defined at every position; only the mask decides what counts).
    """
    out = {}
    for kind in kinds:
        d = _token_divergence(student_logits_BxTxV, teacher_logits_BxTxV, kind=kind, beta=beta)
        out[kind] = np.asarray(d)
        if targets_BxT is not None:
            s = _token_divergence(
                student_logits_BxTxV,
                teacher_logits_BxTxV,
                kind=kind,
                beta=beta,
                estimator="sampled",
                sampled_token=jnp.asarray(targets_BxT),
            )
            out[f"{kind}/sampled"] = np.asarray(s)
    return out


def to_tokens(x_xT: np.ndarray, fill: Any = 0) -> np.ndarray:
    """A target-aligned array (index t describes token t + 1) moved onto the tokens: out[..., j]
    = x[..., j - 1], and `fill` at token 0 (which no position predicts)."""
    x = np.asarray(x_xT)
    first = np.full(x.shape[:-1] + (1,), fill, dtype=np.result_type(x.dtype, np.asarray(fill)))
    return np.concatenate([first, x[..., :-1]], axis=-1)


def teacher_roles(batch: Batch, row: int, student_roles: Sequence[int]) -> np.ndarray:
    """`Role` codes of the teacher row of student row `row` (per_trajectory batches).

    Student token j >= 1 sits at teacher index teacher_pos[row, j - 1] + 1 (the index map) and
    keeps its role; token 0 is teacher token 0; every other real teacher token is an inserted
    hint (HINT). Padding is PROMPT.

    Returns:
      [T_t] int8 role codes.
    """
    if batch.teacher_mode != "per_trajectory":
        raise ValueError(f"teacher_roles needs a per_trajectory batch, got {batch.teacher_mode}")
    student_roles = np.asarray(student_roles)
    n = len(student_roles)
    t_row = int(np.asarray(batch.teacher_row_BxT)[row, 0])
    real = np.asarray(batch.teacher_segment_ids_BtxTt)[t_row] > 0
    roles = np.where(real, int(Role.HINT), int(Role.PROMPT)).astype(np.int8)
    index = np.concatenate([[0], np.asarray(batch.teacher_pos_BxT)[row, : n - 1] + 1])
    roles[index] = student_roles
    return roles


def turn_positions(batch: Batch, row: int, turn: int) -> np.ndarray:
    """Target positions t of row `row` whose target is a produced token of assistant turn
    `turn` (in order; the first one predicts the turn's first token)."""
    sel = (np.asarray(batch.turn_ids_BxT)[row] == turn) & np.asarray(batch.loss_mask_BxT)[row]
    return np.flatnonzero(sel)


def _softmax(logits_V: np.ndarray) -> np.ndarray:
    z = np.asarray(logits_V, np.float64)
    p = np.exp(z - z.max())
    return p / p.sum()


def top_tokens(
    tokenizer: Tokenizer,
    student_logits_V: np.ndarray,
    teacher_logits_V: np.ndarray,
    *,
    k: int = 8,
    target: int | None = None,
) -> list[dict[str, Any]]:
    """The union of the student's and the teacher's top-k next tokens, most likely first.

    Args:
      tokenizer: names the tokens.
      student_logits_V, teacher_logits_V: [V] logits at one position (plain, hinted).
      k: tokens from each side.
      target: the token actually produced there, flagged in the rows.

    Returns:
      Rows {"token" (repr of its text), "id", "p_plain", "p_hinted", "rank_plain",
      "rank_hinted", "produced"}, sorted by max(p_plain, p_hinted), descending.
    """
    p_s, p_t = _softmax(student_logits_V), _softmax(teacher_logits_V)
    rank_s = np.empty(len(p_s), int)
    rank_s[np.argsort(-p_s, kind="stable")] = np.arange(1, len(p_s) + 1)
    rank_t = np.empty(len(p_t), int)
    rank_t[np.argsort(-p_t, kind="stable")] = np.arange(1, len(p_t) + 1)
    ids = sorted(
        set(np.argsort(-p_s)[:k].tolist()) | set(np.argsort(-p_t)[:k].tolist()),
        key=lambda i: -max(p_s[i], p_t[i]),
    )
    return [
        {
            "token": repr(tokenizer.decode([i])),
            "id": int(i),
            "p_plain": float(p_s[i]),
            "p_hinted": float(p_t[i]),
            "rank_plain": int(rank_s[i]),
            "rank_hinted": int(rank_t[i]),
            "produced": target is not None and int(i) == int(target),
        }
        for i in ids
    ]


def plot_top_tokens(rows: Sequence[dict[str, Any]], *, ax=None, title: str = ""):
    """Grouped bars of p_plain vs p_hinted for `top_tokens` rows; returns the axes."""
    import matplotlib.pyplot as plt  # noqa: PLC0415 (plots only)

    if ax is None:
        _, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(rows) + 1.5), 3.0))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["p_plain"] for r in rows], 0.4, label="plain (student)")
    ax.bar(x + 0.2, [r["p_hinted"] for r in rows], 0.4, label="hinted (teacher)")
    labels = [r["token"] + (" *" if r.get("produced") else "") for r in rows]
    ax.set_xticks(x, labels, rotation=60, fontsize=8)
    ax.set_ylabel("probability")
    ax.set_title(title or "next-token distribution (* = produced token)", fontsize=9)
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax
