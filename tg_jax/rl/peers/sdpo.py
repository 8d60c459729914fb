"""SDPO-style self-distillation (the form of TRL's SDPO trainer) on the TG teacher path.

Each sample's teacher is the policy's own weights with feedback in context (here: the
requirement hints before every assistant turn, tg.gate "all_turns"), under stop-gradient.
There is no failed-turn gate: every answer token with a teacher counterpart is distilled, and
the GRPO surrogate and the distillation are blended per token with a fixed weight w:

    L_SDPO = (1 - w) * L_GRPO + w * sum_{t in M} D_t / |M|,    w = tg.peer_weight,

M = the answer tokens of every turn (thinking tokens too with tg.include_thinking). With
token_mean aggregation and M the assistant tokens, this is the token mean of
(1 - w) l_t + w D_t, l_t the clipped surrogate of token t. D_t by tg.peer_estimator, with
p_s = p_theta(. | context, y_<t), p_t = sg p_theta(. | context + feedback, y_<t), y_t the
produced token, and KL_kind the divergence of tg.kind (reverse KL(p_s || p_t) by default):

  full     D_t = KL_kind(p_s || p_t) over the whole vocabulary (TG's full estimator).
  topk     K_t = the k tokens the teacher ranks highest (k = tg.peer_top_k; the choice gets
           no gradient). Both distributions are restricted to K_t and renormalised,
           q(v) = p(v) / sum_{u in K_t} p(u), and D_t = KL_kind(q_s || q_t) over K_t.
  sampled  D_t = log p_s(y_t) - log p_t(y_t), the one-sample estimate of the reverse KL at the
           produced token, teacher stop-gradiented. Its gradient is taken in score-function
           form, sg(D_t) * grad log p_s(y_t) (TG's sampled estimator, `tg.divergence`): plain
           autograd of the difference gives grad log p_s(y_t), whose expectation under the
           sampler is zero, so it would not follow the KL at all.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from tg_jax.rl.step_config import TGConfig
from tg_jax.rl.tg.divergence import LOG_FLOOR, DivergenceKind, full_divergence


def teacher_top_k_divergence(
    log_s_xV: jax.Array,
    log_t_xV: jax.Array,
    token_x: jax.Array | None = None,
    *,
    k: int,
    kind: DivergenceKind,
    beta: float = 0.5,
) -> jax.Array:
    """D over the teacher's top-k tokens, both distributions renormalised there ([...]).

    Args:
      log_s_xV: [..., V] student log-probs (fp32, floored).
      log_t_xV: [..., V] teacher log-probs (stop-gradiented here too).
      token_x: unused (the produced tokens; the callable-estimator signature).
      k: tokens kept (at most V).
      kind, beta: the divergence (`tg_jax.rl.tg.divergence.token_divergence`).
    """
    del token_x
    log_t_xV = jax.lax.stop_gradient(log_t_xV)
    _, idx_xK = jax.lax.top_k(log_t_xV, min(k, log_t_xV.shape[-1]))
    top_s_xK = jnp.take_along_axis(log_s_xV, idx_xK, axis=-1)
    top_t_xK = jnp.take_along_axis(log_t_xV, idx_xK, axis=-1)
    top_s_xK = top_s_xK - jax.nn.logsumexp(top_s_xK, axis=-1, keepdims=True)
    top_t_xK = top_t_xK - jax.nn.logsumexp(top_t_xK, axis=-1, keepdims=True)
    return full_divergence(
        jnp.maximum(top_s_xK, LOG_FLOOR), jnp.maximum(top_t_xK, LOG_FLOOR), kind, beta
    )


def divergence_options(tg_cfg: TGConfig) -> dict[str, Any]:
    """`chunked_token_stats` options of D_t for tg.peer_estimator (tg.kind's direction)."""
    opts = dict(kind=tg_cfg.kind, beta=tg_cfg.beta, estimator="full", top_k=None)
    if tg_cfg.peer_estimator == "sampled":
        opts["estimator"] = "sampled"
    elif tg_cfg.peer_estimator == "topk":
        opts["estimator"] = functools.partial(
            teacher_top_k_divergence, k=tg_cfg.peer_top_k, kind=tg_cfg.kind, beta=tg_cfg.beta
        )
    return opts


def blend(policy: jax.Array, distill: jax.Array, weight: float) -> jax.Array:
    """(1 - w) * L_GRPO + w-weighted distillation: `distill` already carries w (the TG term
    with distill_weight = w), so only the policy loss is scaled here."""
    return (1.0 - weight) * policy + distill
