"""The per-token divergence D_t between the hinted teacher and the student, chunk by chunk.

Per student token t (the token the policy produced at that position) D_t compares the two
next-token distributions over the full vocabulary:

    D_t = KL( sg p_theta(. | s_k + h_r, y_<t) || p_theta(. | s_k, y_<t) )   (tg.kind forward)

 1. The caller runs the model on the student sequence -> final hidden states [B, T, D], and on
    the hinted teacher sequence -> teacher hidden states, which it gathers to student positions
    through the batch's student->teacher index map and stop-gradients. Both are aligned with
    `targets_BxT`: index t holds the hidden state that predicts targets[t], the token the policy
    produced. Every [B, T] array here uses that alignment.
 2. `chunked_token_stats` walks over T in chunks of C positions. Per chunk it unembeds student
    and teacher hidden states into fp32 logits [B, C, V], takes the student's log-prob of the
    target (for the policy loss), its entropy, and D_t (`token_divergence`). The chunk body is
    rematerialised, so neither pass ever holds [B, T, V]; only [B, C, V] and [B, T] outputs.
 3. `token_divergence` turns a pair of logits into D_t: forward KL, reverse KL or
    JSD(beta); over the full vocabulary, as a single-sample estimate from the produced token
    (with a score-function gradient), or over the student's top-k tokens plus one tail bucket.

The TG term over these D_t is `tg_jax.rl.tg.loss`; the peers' methods (`tg_jax.rl.peers`) pass
a per-token callable as the estimator. Suffix `_xV`: any shape, then the vocabulary.
"""

import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from tg_jax import tracing
from tg_jax.rl.step_config import TGConfig

DivergenceKind = Literal["reverse", "forward", "jsd"]
Estimator = Literal["full", "sampled"]

# Log-probs are floored at this finite value instead of -inf (a vocabulary entry masked with
# -inf, or an empty top-k tail bucket): p = exp(floor) is exactly 0, so p * (log p - log q)
# is 0 rather than 0 * inf = NaN, in the value and in the gradient.
LOG_FLOOR = -1e30


# ---------------------------------------------------------------------------------------------
# Step 3: per-token divergences.
# ---------------------------------------------------------------------------------------------


def _log_probs(logits_xV: jax.Array) -> jax.Array:
    """fp32 log-softmax over the last axis, floored at LOG_FLOOR."""
    return jnp.maximum(jax.nn.log_softmax(logits_xV.astype(jnp.float32), axis=-1), LOG_FLOOR)


def _kl(log_p_xV: jax.Array, log_q_xV: jax.Array) -> jax.Array:
    """KL(p || q) = sum_v p (log p - log q) over the last axis, from floored log-probs."""
    return jnp.sum(jnp.exp(log_p_xV) * (log_p_xV - log_q_xV), axis=-1)


def _log_mixture(log_s: jax.Array, log_t: jax.Array, beta: float) -> jax.Array:
    """log m for m = beta * p_teacher + (1 - beta) * p_student, computed stably."""
    return jnp.logaddexp(log_t + math.log(beta), log_s + math.log1p(-beta))


def full_divergence(
    log_s_xV: jax.Array, log_t_xV: jax.Array, kind: DivergenceKind, beta: float
) -> jax.Array:
    """Exact divergence between two (floored) log-prob vectors over the last axis."""
    if kind == "reverse":
        return _kl(log_s_xV, log_t_xV)
    if kind == "forward":
        return _kl(log_t_xV, log_s_xV)
    log_m_xV = _log_mixture(log_s_xV, log_t_xV, beta)
    return beta * _kl(log_t_xV, log_m_xV) + (1.0 - beta) * _kl(log_s_xV, log_m_xV)


def _sampled_divergence(
    log_s_xV: jax.Array,
    log_t_xV: jax.Array,
    token_x: jax.Array,
    kind: DivergenceKind,
    beta: float,
) -> jax.Array:
    """Single-sample estimate from the produced token y, with a score-function gradient.

    With ls = log p_s(y), lt = log p_t(y), w = p_t(y) / p_s(y) and lm = log m(y):
      kind     value v(y)                               score coefficient c(y)
      reverse  ls - lt                                   ls - lt
      forward  w (lt - ls)                               -w
      jsd      beta w (lt - lm) + (1 - beta)(ls - lm)    (1 - beta)(ls - lm)
    The returned D = sg(v) + sg(c) * (ls - sg(ls)) has value v and gradient c * grad log p_s(y).
    For y ~ p_s, E[v] is the full divergence and E[c grad log p_s(y)] its full gradient, because
    c(y) is the derivative of the divergence w.r.t. p_s(y) up to a constant, and
    E[grad log p_s(y)] = 0. That same identity is why differentiating v itself would be wrong:
    grad v = grad ls for reverse KL, whose expectation is 0.
    """
    ls_x = jnp.take_along_axis(log_s_xV, token_x[..., None], axis=-1)[..., 0]
    lt_x = jnp.take_along_axis(log_t_xV, token_x[..., None], axis=-1)[..., 0]
    ls_sg_x = jax.lax.stop_gradient(ls_x)
    if kind == "reverse":
        value_x = coef_x = ls_sg_x - lt_x
    elif kind == "forward":
        w_x = jnp.exp(lt_x - ls_sg_x)
        value_x, coef_x = w_x * (lt_x - ls_sg_x), -w_x
    else:
        lm_x = _log_mixture(ls_sg_x, lt_x, beta)
        w_x = jnp.exp(lt_x - ls_sg_x)
        value_x = beta * w_x * (lt_x - lm_x) + (1.0 - beta) * (ls_sg_x - lm_x)
        coef_x = (1.0 - beta) * (ls_sg_x - lm_x)
    value_x, coef_x = jax.lax.stop_gradient(value_x), jax.lax.stop_gradient(coef_x)
    return value_x + coef_x * (ls_x - ls_sg_x)


def _top_k_buckets(log_s_xV: jax.Array, log_t_xV: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Log-masses of both distributions on the student's top-k tokens plus one tail bucket.

    Returns:
      Two [..., k + 1] arrays; the last entry is the log of the mass outside the top k.
    """
    vocab = log_s_xV.shape[-1]
    _, idx_xK = jax.lax.top_k(jax.lax.stop_gradient(log_s_xV), k)
    top_s_xK = jnp.take_along_axis(log_s_xV, idx_xK, axis=-1)
    top_t_xK = jnp.take_along_axis(log_t_xV, idx_xK, axis=-1)
    # Scatter a top-k membership mask on a flattened copy of the leading axes (a threshold on
    # the k-th logit would over-select on ties).
    idx_NxK = idx_xK.reshape(-1, k)
    rows_Nx1 = jnp.arange(idx_NxK.shape[0])[:, None]
    in_top_NxV = jnp.zeros((idx_NxK.shape[0], vocab), bool).at[rows_Nx1, idx_NxK].set(True)
    in_top_xV = in_top_NxV.reshape(log_s_xV.shape)
    # Floored, not -inf, so that k = V (empty tail) stays finite in value and gradient.
    tail_s_x = jax.nn.logsumexp(jnp.where(in_top_xV, LOG_FLOOR, log_s_xV), axis=-1)
    tail_t_x = jax.nn.logsumexp(jnp.where(in_top_xV, LOG_FLOOR, log_t_xV), axis=-1)
    buckets_s = jnp.concatenate([top_s_xK, jnp.maximum(tail_s_x, LOG_FLOOR)[..., None]], -1)
    buckets_t = jnp.concatenate([top_t_xK, jnp.maximum(tail_t_x, LOG_FLOOR)[..., None]], -1)
    return buckets_s, buckets_t


def divergence_from_log_probs(
    log_s_xV: jax.Array,
    log_t_xV: jax.Array,
    *,
    kind: DivergenceKind,
    beta: float,
    estimator: Estimator,
    sampled_token: jax.Array | None,
    top_k: int | None,
) -> jax.Array:
    """`token_divergence` on already computed (floored, fp32) log-probs; teacher already sg.
    A callable estimator (a peer method's, `tg_jax.rl.peers`) maps (log_s, log_t, y) -> D."""
    if callable(estimator):
        return estimator(log_s_xV, log_t_xV, sampled_token)
    if estimator == "sampled":
        return _sampled_divergence(log_s_xV, log_t_xV, sampled_token, kind, beta)
    if top_k is not None:
        log_s_xV, log_t_xV = _top_k_buckets(log_s_xV, log_t_xV, top_k)
    return full_divergence(log_s_xV, log_t_xV, kind, beta)


def _check_divergence_options(
    kind: str, beta: float, estimator: str, top_k: int | None, vocab: int
) -> None:
    if kind not in ("reverse", "forward", "jsd"):
        raise ValueError(f"unknown divergence kind {kind!r}")
    if not callable(estimator) and estimator not in ("full", "sampled"):
        raise ValueError(f"unknown estimator {estimator!r}")
    if kind == "jsd" and not 0.0 < beta < 1.0:
        raise ValueError(f"jsd needs 0 < beta < 1 (use reverse/forward for the limits): {beta}")
    if top_k is not None and estimator == "sampled":
        raise ValueError("top_k applies to the full estimator only")
    if top_k is not None and not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must be in [1, {vocab}], got {top_k}")


def token_divergence(
    student_logits_xV: jax.Array,
    teacher_logits_xV: jax.Array,
    *,
    kind: DivergenceKind,
    beta: float = 0.5,
    estimator: Estimator = "full",
    sampled_token: jax.Array | None = None,
    top_k: int | None = None,
) -> jax.Array:
    """Per-token divergence D between student and teacher next-token distributions, in fp32.

    Kinds (p_s student, p_t teacher; the teacher logits are always stop-gradiented):
      forward: KL(p_t || p_s) = sum_v p_t (log p_t - log p_s). Mass-covering; its gradient in
               the student's logits, p_s - p_t, does not vanish on near-disjoint distributions.
      reverse: KL(p_s || p_t) = sum_v p_s (log p_s - log p_t). Mode-seeking.
      jsd:     with the mixture m = beta p_t + (1 - beta) p_s,
               JSD_beta = beta KL(p_t || m) + (1 - beta) KL(p_s || m)
               (the generalised JSD of GKD, Agarwal et al. 2024, same convention as TRL's GKD).
               beta = 0.5 is the symmetric Jensen-Shannon divergence, bounded by log 2. Both
               endpoints make it vanish (m becomes one of the two distributions), so beta must
               lie strictly inside (0, 1); near them it approaches a scaled KL:
               JSD_beta / beta -> forward KL as beta -> 0, and
               JSD_beta / (1 - beta) -> reverse KL as beta -> 1.

    Estimators:
      full:    exact sum over the vocabulary.
      full + top_k: the student's top-k tokens are kept exactly and the remaining mass of each
               distribution is lumped into one tail bucket; the divergence is taken over these
               k + 1 buckets. The student side chooses the tokens because the reverse KL is
               an expectation under p_s, so its large terms sit on the student's top
               tokens. Coarse-graining can only lower an f-divergence, so this is a lower bound
               on the full value, exact when k = V (or when both distributions agree on how
               the tail mass splits). The top-k selection itself gets no gradient.
      sampled: only the produced token y = `sampled_token` (drawn from the student, i.e. the
               on-policy sample): for reverse KL the value is log p_s(y) - log p_t(y). The
               gradient is the score-function (REINFORCE) term
               c(y) grad log p_s(y), with c(y) = log p_s(y) - log p_t(y) for reverse KL
               (other kinds: see `_sampled_divergence`), so that both the value and the
               gradient are unbiased for the full divergence when y ~ p_s. Differentiating
               the plain estimate would give grad log p_s(y), whose expectation is 0. Samples
               from a stale or tempered behaviour policy make it biased (no importance
               correction); forward and jsd carry an importance weight p_t(y) / p_s(y) and
               have high variance.

    Args:
      student_logits_xV: [..., V] student logits (any float dtype; upcast to fp32).
      teacher_logits_xV: [..., V] teacher logits for the same positions.
      kind: "reverse", "forward" or "jsd".
      beta: mixture weight of the teacher in jsd, in (0, 1).
      estimator: "full" or "sampled".
      sampled_token: [...] int token ids in [0, V), required by the sampled estimator.
      top_k: keep the student's top-k tokens plus a tail bucket (full estimator only).

    Returns:
      D: [...] float32.
    """
    _check_divergence_options(kind, beta, estimator, top_k, student_logits_xV.shape[-1])
    if estimator == "sampled" and sampled_token is None:
        raise ValueError("the sampled estimator needs sampled_token")
    log_s_xV = _log_probs(student_logits_xV)
    log_t_xV = _log_probs(jax.lax.stop_gradient(teacher_logits_xV))
    return divergence_from_log_probs(
        log_s_xV,
        log_t_xV,
        kind=kind,
        beta=beta,
        estimator=estimator,
        sampled_token=sampled_token,
        top_k=top_k,
    )


# ---------------------------------------------------------------------------------------------
# Step 2: chunked logits -> per-token statistics.
# ---------------------------------------------------------------------------------------------


class TokenStats(NamedTuple):
    """Per-token outputs of `chunked_token_stats`, aligned with the targets.

    Attributes:
      logprob_BxT: float32 log p_s(targets[t]), differentiable (the policy loss's logp).
      entropy_BxT: float32 entropy of p_s at t, differentiable.
      divergence_BxT: float32 D_t vs the teacher, or None when no teacher was given.
    """

    logprob_BxT: jax.Array
    entropy_BxT: jax.Array
    divergence_BxT: jax.Array | None


def _scan_chunks(
    body: Callable[..., tuple[jax.Array | None, ...]],
    xs: tuple[jax.Array | None, ...],
    chunk_size: int,
) -> tuple[jax.Array | None, ...]:
    """`body` over axis 1 of the [R, N, ...] arrays `xs` (None passes through), C =
    min(chunk_size, N) positions at a time (N zero-padded to a multiple of C); its [R, C]
    outputs are stitched back to [R, N]. The body is rematerialised (`jax.checkpoint`): the
    backward pass recomputes each chunk's [R, C, V] logits instead of keeping them."""
    rows, length = next(x for x in xs if x is not None).shape[:2]
    chunk = min(chunk_size, length)
    num_chunks = -(-length // chunk)
    padded = num_chunks * chunk

    def to_chunks(x_RxN_: jax.Array | None) -> jax.Array | None:
        """[R, N, ...] -> [num_chunks, R, C, ...], zero-padded along N."""
        if x_RxN_ is None:
            return None
        pad = [(0, 0)] * x_RxN_.ndim
        pad[1] = (0, padded - length)
        x = jnp.pad(x_RxN_, pad).reshape(rows, num_chunks, chunk, *x_RxN_.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    def from_chunks(y_KxRxC: jax.Array | None) -> jax.Array | None:
        if y_KxRxC is None:
            return None
        return jnp.moveaxis(y_KxRxC, 0, 1).reshape(rows, padded)[:, :length]

    # prevent_cse=False: scan already keeps the recomputation from being CSE'd away.
    step = jax.checkpoint(body, prevent_cse=False)
    chunks = tuple(to_chunks(x) for x in xs)
    _, ys = jax.lax.scan(lambda c, x: (c, step(*x)), None, chunks)
    return tuple(from_chunks(y) for y in ys)


def _check_static_options(hidden_RxNxD: jax.Array, unembed_fn: Callable, options: dict) -> None:
    """`_check_divergence_options` once, outside the traced loop (V from `unembed_fn`)."""
    vocab = tracing.eval_shape(unembed_fn, hidden_RxNxD[:, :1]).shape[-1]
    _check_divergence_options(**options, vocab=vocab)


def chunked_token_stats(
    student_hidden_BxTxD: jax.Array,
    targets_BxT: jax.Array,
    unembed_fn: Callable[[jax.Array], jax.Array],
    *,
    teacher_hidden_BxTxD: jax.Array | None = None,
    teacher_unembed_fn: Callable[[jax.Array], jax.Array] | None = None,
    chunk_size: int = 512,
    kind: DivergenceKind | None = None,
    beta: float = 0.5,
    estimator: Estimator = "full",
    top_k: int | None = None,
) -> TokenStats:
    """Target log-probs, entropies and TG divergences without materialising [B, T, V].

    T is padded to a multiple of C = min(chunk_size, T) and scanned chunk by chunk. The chunk
    body is wrapped in `jax.checkpoint`, so the backward pass recomputes each chunk's logits
    instead of keeping them: peak memory holds a few [B, C, V] fp32 arrays, not [B, T, V].
    The sampled estimator uses `targets_BxT` as the produced tokens. Sampling temperature, if
    the behaviour log-probs used one, belongs in `unembed_fn` (divide the logits by it).

    Args:
      student_hidden_BxTxD: [B, T, D] final hidden states of the student sequence.
      targets_BxT: [B, T] int token ids in [0, V) predicted at each position.
      unembed_fn: hidden_BxCxD -> logits_BxCxV (cast to fp32 here); the same function serves
        the teacher, since the teacher is the same weights, unless `teacher_unembed_fn`
        (a teacher with weights of its own) is given.
      teacher_hidden_BxTxD: optional [B, T, D] teacher hidden states already gathered to
        student positions; stop-gradiented here again, and so are the teacher logits, so the
        unembedding gets no gradient through the teacher either. Where only a few positions
        have a teacher, `chunked_divergence` on those positions is cheaper.
      chunk_size: positions per chunk.
      kind, beta, estimator, top_k: see `token_divergence` (kind is required with a teacher).

    Returns:
      `TokenStats` with [B, T] arrays.
    """
    options = dict(kind=kind, beta=beta, estimator=estimator, top_k=top_k)
    if teacher_hidden_BxTxD is not None:
        _check_static_options(student_hidden_BxTxD, unembed_fn, options)
        teacher_hidden_BxTxD = jax.lax.stop_gradient(teacher_hidden_BxTxD)

    def chunk_body(
        hidden_BxCxD: jax.Array, targets_BxC: jax.Array, teacher_BxCxD: jax.Array | None
    ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        log_s_BxCxV = _log_probs(unembed_fn(hidden_BxCxD))
        logprob_BxC = jnp.take_along_axis(log_s_BxCxV, targets_BxC[..., None], axis=-1)[..., 0]
        entropy_BxC = -jnp.sum(jnp.exp(log_s_BxCxV) * log_s_BxCxV, axis=-1)
        if teacher_BxCxD is None:
            return logprob_BxC, entropy_BxC, None
        teacher_logits_BxCxV = (teacher_unembed_fn or unembed_fn)(teacher_BxCxD)
        log_t_BxCxV = _log_probs(jax.lax.stop_gradient(teacher_logits_BxCxV))
        divergence_BxC = divergence_from_log_probs(
            log_s_BxCxV, log_t_BxCxV, sampled_token=targets_BxC, **options
        )
        return logprob_BxC, entropy_BxC, divergence_BxC

    xs = (student_hidden_BxTxD, targets_BxT, teacher_hidden_BxTxD)
    logprob, entropy, divergence = _scan_chunks(chunk_body, xs, chunk_size)
    return TokenStats(logprob_BxT=logprob, entropy_BxT=entropy, divergence_BxT=divergence)


def chunked_divergence(
    student_hidden_RxNxD: jax.Array,
    teacher_hidden_RxNxD: jax.Array,
    targets_RxN: jax.Array,
    unembed_fn: Callable[[jax.Array], jax.Array],
    *,
    chunk_size: int = 512,
    kind: DivergenceKind,
    beta: float = 0.5,
    estimator: Estimator = "full",
    top_k: int | None = None,
) -> jax.Array:
    """The divergence D of `chunked_token_stats` alone, at any [R, N] layout of positions.

    The caller gathers the student's hidden states and targets to the positions that have a
    teacher (`tg_jax.rl.tg.teacher.slot_divergence`: the compact teacher rows' slots), so the
    full-vocabulary work is done there only; same chunks along N, rematerialisation and
    stop-gradient on the teacher as `chunked_token_stats`.

    Args:
      student_hidden_RxNxD, teacher_hidden_RxNxD: [R, N, D] hidden states at the positions.
      targets_RxN: [R, N] the produced tokens there (the sampled estimator's samples).
      unembed_fn, chunk_size, kind, beta, estimator, top_k: see `chunked_token_stats`.

    Returns:
      divergence_RxN: float32.
    """
    options = dict(kind=kind, beta=beta, estimator=estimator, top_k=top_k)
    _check_static_options(student_hidden_RxNxD, unembed_fn, options)

    def chunk_body(hidden_RxCxD, teacher_RxCxD, targets_RxC) -> tuple[jax.Array]:
        log_s_RxCxV = _log_probs(unembed_fn(hidden_RxCxD))
        log_t_RxCxV = _log_probs(jax.lax.stop_gradient(unembed_fn(teacher_RxCxD)))
        return (
            divergence_from_log_probs(
                log_s_RxCxV, log_t_RxCxV, sampled_token=targets_RxC, **options
            ),
        )

    xs = (student_hidden_RxNxD, jax.lax.stop_gradient(teacher_hidden_RxNxD), targets_RxN)
    return _scan_chunks(chunk_body, xs, chunk_size)[0]


def divergence_options(tg_cfg: TGConfig) -> dict[str, Any]:
    """kind, beta, estimator and top_k of TG's D_t (tg.kind, tg.beta, tg.estimator, tg.top_k),
    the options of `chunked_token_stats`."""
    return dict(kind=tg_cfg.kind, beta=tg_cfg.beta, estimator=tg_cfg.estimator, top_k=tg_cfg.top_k)
