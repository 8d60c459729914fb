"""The optimizer updates of one train step: micro-batch gradient accumulation and the PPO
update phase (epochs x minibatches over one rollout batch).

With U = `rl.num_updates` epochs and N = `rl.num_minibatches`, one train step (one rollout
batch, one `TrainState.step`) makes U x N optimizer updates (`update_phase`):

 1. Layout. The batch is built with K = N x M chunks (`build_batch(micro_batches=K)`,
    M = `rl.micro_batches`): row b lies in chunk b % K, which carries its own teacher rows
    (compact rows included) with chunk-local indices, so any M chunks make a minibatch of M
    micro-batches (`chunk`).
 2. Proximal log-probs: those of the params at the start of the phase, once per rollout
    batch, without gradient, chunk by chunk (`proximal_logprobs`).
 3. Epoch e shuffles with fold_in(step key, e) (`epoch_chunks`). When the teacher rows are
    aligned with the student rows (the GRPO arm, full per-trajectory rows: `rows_aligned`)
    the rows themselves are permuted and dealt into chunks again; otherwise (compact or
    per-turn teacher rows, whose count per chunk is fixed when the batch is built) the
    chunks are permuted, so the minibatches change from epoch to epoch in units of a chunk.
    Minibatch j of the epoch = chunks [j M, (j + 1) M).
 4. One optimizer update per minibatch, in a `lax.scan` (one compiled body), by the train
    step's `update_fn`: the loss of that minibatch alone with the ratio current / proximal.
 5. Each update's metrics come back stacked [U x N], for the train step to average.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tg_jax import tracing
from tg_jax.rl.batch import Batch, split_microbatches

Metrics = dict[str, jax.Array]


def constrain_micro(x: jax.Array) -> jax.Array:
    """Keeps the batch axis of a [M, B/M, ...] micro-batch array on the data axes."""
    return nn.with_logical_constraint(x, (None, "batch") + (None,) * (x.ndim - 2))


def chunk(rows: Any, num: int) -> Any:
    """[B, ...] leaves -> [num, B / num, ...] (row b in chunk b % num, `split_microbatches`)."""
    return jax.tree.map(constrain_micro, split_microbatches(rows, num))


def unchunk(chunks: Any) -> Any:
    """The inverse of `chunk`: [K, B / K, ...] leaves -> [B, ...] in the original row order."""
    return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(-1, *x.shape[2:]), chunks)


def accumulate_stacked(
    grad_fn: Callable[..., tuple[Any, tuple[Metrics, Metrics]]], params: Any, micro: tuple
) -> tuple[Any, Metrics, Metrics]:
    """(grads, sums, maxes) of `grad_fn(params, *xs)` summed (maxed) over the leading [M]
    axis of the pytrees in `micro`, in a `lax.scan` (one compiled body)."""

    def body(carry, xs):
        g_acc, s_acc, m_acc = carry
        g, (s, m) = grad_fn(params, *xs)
        return (
            jax.tree.map(jnp.add, g_acc, g),
            jax.tree.map(jnp.add, s_acc, s),
            jax.tree.map(jnp.maximum, m_acc, m),
        ), None

    first = jax.tree.map(lambda x: x[0], micro)
    shapes = tracing.eval_shape(lambda p, xs: grad_fn(p, *xs), params, first)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    (grads, sums, maxes), _ = jax.lax.scan(body, (zeros[0], *zeros[1]), micro)
    return grads, sums, maxes


def accumulate_grads(
    grad_fn: Callable[..., tuple[Any, tuple[Metrics, Metrics]]],
    params: Any,
    batch: Batch,
    advantages_B: jax.Array,
    num_micro: int,
) -> tuple[Any, Metrics, Metrics]:
    """(grads, sums, maxes) of `grad_fn` summed (maxed) over `num_micro` micro-batches.

    `grad_fn(params, batch, advantages_B=...)` returns (grads, (sums, maxes)) of one
    micro-batch's share; the micro-batches run in a `lax.scan` (one compiled body).
    """
    if num_micro == 1:
        grads, (sums, maxes) = grad_fn(params, batch, advantages_B=advantages_B)
        return grads, sums, maxes
    micro = chunk((batch, advantages_B), num_micro)
    return accumulate_stacked(lambda p, mb, adv: grad_fn(p, mb, advantages_B=adv), params, micro)


def proximal_logprobs(
    logprob_fn: Callable[[Any, Batch], jax.Array], params: Any, chunks: Batch
) -> jax.Array:
    """[K, B / K, T] log-probs of the targets under `params` (no gradient), chunk by chunk.

    Args:
      logprob_fn: (params, batch [b rows]) -> [b, T] log-probs of batch.targets_BxT.
      params: the params at the start of the update phase.
      chunks: the batch as [K, B / K, ...] chunks (`chunk`).
    """
    params = jax.lax.stop_gradient(params)
    return jax.lax.map(lambda mb: jax.lax.stop_gradient(logprob_fn(params, mb)), chunks)


def rows_aligned(batch: Batch) -> bool:
    """Whether teacher row b belongs to student row b (or there is no teacher): then rows can
    be permuted freely, teacher rows with them (static: from the batch's layout)."""
    # [:-1]: B (or [K, B / K] of a chunked batch) against B_t.
    same_rows = batch.teacher_tokens_BtxTt.shape[:-1] == batch.tokens_BxT.shape[:-1]
    return (
        not batch.teacher_compact and batch.teacher_mode in ("per_trajectory", "none") and same_rows
    )


def _permute_rows(rows: tuple, perm_B: jax.Array, num_chunks: int) -> tuple:
    """Rows (batch first, every leaf [B, ...]) in the order perm_B; per-trajectory teacher
    rows follow their student rows, with the chunk-local indices of the new order."""
    batch, *rest = jax.tree.map(lambda x: x[perm_B], rows)
    if batch.teacher_mode == "per_trajectory":
        B, T = batch.teacher_row_BxT.shape
        local_B = (jnp.arange(B, dtype=jnp.int32) // num_chunks).astype(batch.teacher_row_BxT.dtype)
        batch = batch.replace(teacher_row_BxT=jnp.broadcast_to(local_B[:, None], (B, T)))
    return (batch, *rest)


def epoch_chunks(chunks: tuple, key: jax.Array, aligned: bool) -> tuple:
    """One epoch's chunks [K, B / K, ...], shuffled by `key` (step 3 of the module docstring).

    Args:
      chunks: (batch, ...) pytrees with [K, B / K, ...] leaves, the batch first.
      key: this epoch's PRNG key.
      aligned: `rows_aligned(batch)`: permute rows (else whole chunks).
    """
    num_chunks = jax.tree.leaves(chunks)[0].shape[0]
    if aligned:
        rows = unchunk(chunks)
        num_rows = rows[0].tokens_BxT.shape[0]
        perm_B = jax.random.permutation(key, num_rows)
        return chunk(_permute_rows(rows, perm_B, num_chunks), num_chunks)
    perm_K = jax.random.permutation(key, num_chunks)
    return jax.tree.map(lambda x: x[perm_K], chunks)


def update_phase(
    update_fn: Callable[[Any, tuple], tuple[Any, Any]],
    carry: Any,
    chunks: tuple,
    key: jax.Array,
    *,
    num_updates: int,
    num_minibatches: int,
) -> tuple[Any, Any]:
    """num_updates epochs of num_minibatches updates: (final carry, stacked metrics [U x N]).

    Args:
      update_fn: (carry, minibatch) -> (carry, metrics); a minibatch is `chunks` with
        [M, B / K, ...] leaves (its M micro-batches).
      carry: e.g. (params, opt_state).
      chunks: (batch, ...) with [K, B / K, ...] leaves, K = num_minibatches x M.
      key: the step's key; epoch e shuffles with fold_in(key, e).
      num_updates: U, epochs.
      num_minibatches: N, minibatches per epoch.
    """
    num_chunks = jax.tree.leaves(chunks)[0].shape[0]
    if num_chunks % num_minibatches:
        raise ValueError(f"{num_chunks} chunks do not split into {num_minibatches} minibatches")
    per_mb = num_chunks // num_minibatches
    aligned = rows_aligned(chunks[0])

    def epoch(carry, e):
        shuffled = epoch_chunks(chunks, jax.random.fold_in(key, e), aligned)
        mbs = jax.tree.map(lambda x: x.reshape(num_minibatches, per_mb, *x.shape[1:]), shuffled)
        return jax.lax.scan(update_fn, carry, mbs)

    carry, metrics = jax.lax.scan(epoch, carry, jnp.arange(num_updates))
    return carry, jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), metrics)
