"""Targeted guidance (TG): distil the hinted policy into the unhinted one on failed turns.

A turn that breaks requirement r is a *failed turn*. The *teacher* is the same weights run on
the context with the hint h_r inserted right before that turn, under stop-gradient; the
*student* is the policy on the original context. Per student token t (the token the policy
produced at that position) the loss compares the two next-token distributions over the full
vocabulary:

    D_t = KL( sg p_theta(. | s_k + h_r, y_<t) || p_theta(. | s_k, y_<t) )   (tg.kind forward)
    L_TG = lambda_tg * sum_{t in M} D_t / (trajectories x tg.norm_length)   (tg.normalize token_sum)
    L = L_GRPO + L_TG  (+ optional reference KL, see policy_loss.py)

The algorithm, in the order the code below implements it:

 1. The caller runs the model on the student sequence -> final hidden states [B, T, D], and on
    the hinted teacher sequence -> teacher hidden states, which it gathers to student positions
    through the batch's student->teacher index map and stop-gradients. Both are aligned with
    `targets_BxT`: index t holds the hidden state that predicts targets[t], the token the policy
    produced. Every [B, T] array here (masks included) uses that alignment.
 2. `chunked_token_stats` walks over T in chunks of C positions. Per chunk it unembeds student
    and teacher hidden states into fp32 logits [B, C, V], takes the student's log-prob of the
    target (for the policy loss), its entropy, and D_t (`token_divergence`). The chunk body is
    rematerialised, so neither pass ever holds [B, T, V]; only [B, C, V] and [B, T] outputs.
 3. `token_divergence` turns a pair of logits into D_t: forward KL, reverse KL or
    JSD(beta); over the full vocabulary, as a single-sample estimate from the produced token
    (with a score-function gradient), or over the student's top-k tokens plus one tail bucket.
 4. `tg_mask` builds M: the answer tokens of failed turns (optionally their thinking tokens
    too; optionally every assistant turn). Prompt, environment and tool tokens never count.
 5. `tg_loss` sums D over M and divides by a fixed constant (normalize="token_sum":
    trajectories x tg.norm_length), or averages it over M ("token_mean"), and scales by
    lambda_tg (`lambda_schedule`); it is exactly 0 when M is empty, so a batch without failed
    turns is plain GRPO.

The recipe (kind, normalize, lambda_tg) is TGConfig's (tg_jax.rl.step_config; its defaults are
the shipped one), passed in with no defaults here. Suffix `_xV`: any shape, then the vocabulary.
"""

import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from tg_jax import tracing
from tg_jax.rl.step_config import LambdaSchedule

DivergenceKind = Literal["reverse", "forward", "jsd"]
Estimator = Literal["full", "sampled"]
Gate = Literal["failed_turns", "all_turns"]
Normalize = Literal["token_mean", "token_sum"]

# Log-probs are floored at this finite value instead of -inf (a vocabulary entry masked with
# -inf, or an empty top-k tail bucket): p = exp(floor) is exactly 0, so p * (log p - log q)
# is 0 rather than 0 * inf = NaN, in the value and in the gradient.
_LOG_FLOOR = -1e30


# ---------------------------------------------------------------------------------------------
# Step 3: per-token divergences.
# ---------------------------------------------------------------------------------------------


def _log_probs(logits_xV: jax.Array) -> jax.Array:
    """fp32 log-softmax over the last axis, floored at _LOG_FLOOR."""
    return jnp.maximum(jax.nn.log_softmax(logits_xV.astype(jnp.float32), axis=-1), _LOG_FLOOR)


def _kl(log_p_xV: jax.Array, log_q_xV: jax.Array) -> jax.Array:
    """KL(p || q) = sum_v p (log p - log q) over the last axis, from floored log-probs."""
    return jnp.sum(jnp.exp(log_p_xV) * (log_p_xV - log_q_xV), axis=-1)


def _log_mixture(log_s: jax.Array, log_t: jax.Array, beta: float) -> jax.Array:
    """log m for m = beta * p_teacher + (1 - beta) * p_student, computed stably."""
    return jnp.logaddexp(log_t + math.log(beta), log_s + math.log1p(-beta))


def _full_divergence(
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
    tail_s_x = jax.nn.logsumexp(jnp.where(in_top_xV, _LOG_FLOOR, log_s_xV), axis=-1)
    tail_t_x = jax.nn.logsumexp(jnp.where(in_top_xV, _LOG_FLOOR, log_t_xV), axis=-1)
    buckets_s = jnp.concatenate([top_s_xK, jnp.maximum(tail_s_x, _LOG_FLOOR)[..., None]], -1)
    buckets_t = jnp.concatenate([top_t_xK, jnp.maximum(tail_t_x, _LOG_FLOOR)[..., None]], -1)
    return buckets_s, buckets_t


def _divergence_from_log_probs(
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
    return _full_divergence(log_s_xV, log_t_xV, kind, beta)


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
    return _divergence_from_log_probs(
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
        divergence_BxC = _divergence_from_log_probs(
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
        return (_divergence_from_log_probs(log_s_RxCxV, log_t_RxCxV, sampled_token=targets_RxC,
                                           **options),)  # fmt: skip

    xs = (student_hidden_RxNxD, jax.lax.stop_gradient(teacher_hidden_RxNxD), targets_RxN)
    return _scan_chunks(chunk_body, xs, chunk_size)[0]


# ---------------------------------------------------------------------------------------------
# Step 4: which tokens are distilled.
# ---------------------------------------------------------------------------------------------


def tg_mask(
    distill_mask_BxT: jax.Array,
    thinking_mask_BxT: jax.Array,
    failed_turn_mask_BxT: jax.Array,
    loss_mask_BxT: jax.Array,
    *,
    include_thinking: bool = False,
    gate: Gate = "failed_turns",
) -> jax.Array:
    """The distillation mask M.

    Inputs (all [B, T], aligned with the targets; bool or {0, 1}):
      loss_mask_BxT: assistant tokens the policy produced (answer and thinking, end-of-turn
        token included). Prompt, environment/tool observation and padding tokens are 0; hint
        tokens never appear in the student sequence.
      thinking_mask_BxT: the assistant tokens inside a `<think>...</think>` span (tags
        included). Values outside `loss_mask_BxT` are ignored.
      failed_turn_mask_BxT: every token of an assistant turn that broke at least one
        requirement. Values outside `loss_mask_BxT` are ignored.
      distill_mask_BxT: tokens that have a usable teacher counterpart: the index map points
        to a teacher token whose context holds the hint (0 e.g. where the teacher sequence
        was truncated). With gate="all_turns" the batch must give hinted contexts, and set
        this mask, for every turn it wants distilled.

    Rule:
      answer   = loss_mask & ~thinking
      eligible = loss_mask (answer + thinking) if include_thinking else answer
      M        = eligible & failed_turn & distill   (gate="failed_turns", the method's default)
      M        = eligible & distill                 (gate="all_turns": feedback on every turn)

    Args:
      distill_mask_BxT, thinking_mask_BxT, failed_turn_mask_BxT, loss_mask_BxT: see above.
      include_thinking: also distil the thinking tokens of the selected turns.
      gate: "failed_turns" or "all_turns".

    Returns:
      mask_BxT: bool [B, T].
    """
    if gate not in ("failed_turns", "all_turns"):
        raise ValueError(f"unknown gate {gate!r}")
    assistant_BxT = loss_mask_BxT.astype(bool)
    eligible_BxT = assistant_BxT
    if not include_thinking:
        eligible_BxT = eligible_BxT & ~thinking_mask_BxT.astype(bool)
    if gate == "failed_turns":
        eligible_BxT = eligible_BxT & failed_turn_mask_BxT.astype(bool)
    return eligible_BxT & distill_mask_BxT.astype(bool)


# ---------------------------------------------------------------------------------------------
# Step 5: the loss and its weight.
# ---------------------------------------------------------------------------------------------


class TGMetrics(NamedTuple):
    """Diagnostics of the TG loss.

    Attributes:
      loss: lambda_tg * sum_{t in M} D_t / N (scalar; N: see `tg_loss`).
      divergence_mean: mean D over distilled tokens, 0 if none (scalar).
      distilled_fraction: |M| / |assistant tokens| (scalar).
      num_distilled: |M| (scalar).
      per_requirement_divergence: [R] mean D over distilled tokens of each requirement.
      per_requirement_tokens: [R] number of distilled tokens of each requirement.
    """

    loss: jax.Array
    divergence_mean: jax.Array
    distilled_fraction: jax.Array
    num_distilled: jax.Array
    per_requirement_divergence: jax.Array
    per_requirement_tokens: jax.Array


def tg_loss(
    divergence_BxT: jax.Array,
    mask_BxT: jax.Array,
    lambda_tg: float | jax.Array,
    *,
    assistant_mask_BxT: jax.Array | None = None,
    requirement_ids_BxT: jax.Array | None = None,
    num_requirements: int = 0,
    normalize: Normalize,
    norm_constant: float | jax.Array = 1.0,
) -> tuple[jax.Array, TGMetrics]:
    """L_TG = lambda_tg * sum_{t in M} D_t / N; exactly 0.0 when M is empty.

    N = max(|M|, 1) with normalize="token_mean" (every distilled token weighs 1/|M|, so the
    fewer failed turns a batch has, the more each of their tokens weighs), N = norm_constant
    with "token_sum" (a token's weight does not depend on how many others are distilled).

    Args:
      divergence_BxT: [B, T] D_t (from `chunked_token_stats`).
      mask_BxT: [B, T] M (from `tg_mask`).
      lambda_tg: weight (a float or a traced scalar from `lambda_schedule`).
      assistant_mask_BxT: [B, T] assistant tokens, the denominator of `distilled_fraction`
        (default: every position).
      requirement_ids_BxT: [B, T] int, the requirement whose hint the teacher saw at each
        token, -1 for none; ids >= num_requirements are ignored.
      num_requirements: R, static.
      normalize: "token_mean" or "token_sum" (static).
      norm_constant: N of "token_sum" (> 0), e.g. trajectories x tg.norm_length.

    Returns:
      loss: scalar float32.
      metrics: `TGMetrics` (divergence_mean is the mean over M in both modes).
    """
    if normalize not in ("token_mean", "token_sum"):
        raise ValueError(f"unknown normalize {normalize!r}")
    mask_BxT = mask_BxT.astype(bool)
    # where, not multiply: garbage (inf/NaN) at unmasked positions must not reach the sum.
    d_BxT = jnp.where(mask_BxT, divergence_BxT.astype(jnp.float32), 0.0)
    num_distilled = mask_BxT.sum()
    divergence_mean = d_BxT.sum() / jnp.maximum(num_distilled, 1).astype(jnp.float32)
    if normalize == "token_mean":
        loss = jnp.asarray(lambda_tg, jnp.float32) * divergence_mean
    else:
        loss = jnp.asarray(lambda_tg, jnp.float32) * d_BxT.sum() / norm_constant

    if assistant_mask_BxT is None:
        num_assistant = jnp.asarray(mask_BxT.size, jnp.float32)
    else:
        num_assistant = jnp.maximum(assistant_mask_BxT.astype(bool).sum(), 1).astype(jnp.float32)
    if requirement_ids_BxT is None or num_requirements == 0:
        per_req_sum_R = per_req_count_R = jnp.zeros((num_requirements,), jnp.float32)
    else:
        # one_hot maps -1 (and out-of-range ids) to an all-zero row.
        onehot_BxTxR = jax.nn.one_hot(requirement_ids_BxT, num_requirements, dtype=jnp.float32)
        onehot_BxTxR = onehot_BxTxR * mask_BxT[..., None].astype(jnp.float32)
        per_req_sum_R = jax.lax.stop_gradient(jnp.einsum("bt,btr->r", d_BxT, onehot_BxTxR))
        per_req_count_R = onehot_BxTxR.sum(axis=(0, 1))
    metrics = TGMetrics(
        loss=loss,
        divergence_mean=jax.lax.stop_gradient(divergence_mean),
        distilled_fraction=num_distilled.astype(jnp.float32) / num_assistant,
        num_distilled=num_distilled,
        per_requirement_divergence=per_req_sum_R / jnp.maximum(per_req_count_R, 1.0),
        per_requirement_tokens=per_req_count_R,
    )
    return loss, metrics


def lambda_schedule(step: int | jax.Array, schedule: LambdaSchedule) -> jax.Array:
    """lambda_tg at a training step; pure jnp, so `step` may be traced.

    Kinds (`LambdaSchedule` fields):
      constant: `value` at every step.
      linear_warmup: ramps 0 -> value over steps [0, warmup_steps], then stays (step 0 gives 0
        when there is a ramp; warmup_steps 0 = no ramp).
      cosine: the same ramp, then decays from value to final_value over decay_steps and stays
        at final_value afterwards.

    Args:
      step: the training step (int or int scalar array).
      schedule: a `LambdaSchedule` (`LambdaSchedule.from_config(config.tg.schedule)`).

    Returns:
      Scalar float32 lambda_tg.
    """
    value = schedule.value
    step = jnp.asarray(step, jnp.float32)
    if schedule.kind == "constant":
        return jnp.asarray(value, jnp.float32)
    warmup = schedule.warmup_steps
    ramp = jnp.clip(step / warmup, 0.0, 1.0) if warmup > 0 else jnp.asarray(1.0, jnp.float32)
    if schedule.kind == "linear_warmup":
        return value * ramp
    if schedule.kind == "cosine":
        final = schedule.final_value
        progress = jnp.clip((step - warmup) / schedule.decay_steps, 0.0, 1.0)
        cosine = final + (value - final) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(step < warmup, value * ramp, cosine)
    raise ValueError(f"unknown lambda schedule kind {schedule.kind!r}")
