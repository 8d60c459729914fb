"""SDAR-style gated self-distillation: GRPO + an auxiliary distillation term gated per token.

The teacher is TG's (the policy's own weights with the hint in context, stop-gradient). Per
produced token y_t, the teacher-student log-prob gap decides how much that token is distilled:

    gap_t  = sg( log p_t(y_t) - log p_s(y_t) )
    g_t    = sg( sigmoid( beta * (gap_t - tau) ) )          beta = tg.sdar_beta, tau = tg.sdar_tau
    L_SDAR = L_GRPO + lambda(step) * sum_{t in M} g_t D_t / |M|

D_t is TG's per-token divergence (tg.kind, tg.estimator, tg.top_k), lambda the TG schedule,
M the tokens of tg.gate (the pipeline arm uses "all_turns": the token gate, not the failed-turn
gate, selects what is distilled). The gate is a weight, never differentiated: the gradient is
g_t grad D_t. With beta > 0 the tokens the hinted teacher finds more likely than the student
(gap above tau) are distilled most; beta < 0 reverses that. g_t multiplies D_t inside the
chunked pass (`gated_divergence`), so the tg_kl metric of this arm is the mean of g_t D_t.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from tg_jax.rl.step_config import TGConfig
from tg_jax.rl.tg.divergence import divergence_from_log_probs


def log_prob_gap(log_s_xV: jax.Array, log_t_xV: jax.Array, token_x: jax.Array) -> jax.Array:
    """sg(log p_t(y) - log p_s(y)) at the produced tokens y = `token_x` ([...])."""
    ls_x = jnp.take_along_axis(log_s_xV, token_x[..., None], axis=-1)[..., 0]
    lt_x = jnp.take_along_axis(log_t_xV, token_x[..., None], axis=-1)[..., 0]
    return jax.lax.stop_gradient(lt_x - ls_x)


def token_gate(gap_x: jax.Array, beta: float, tau: float) -> jax.Array:
    """g = sg(sigmoid(beta (gap - tau)))."""
    return jax.lax.stop_gradient(jax.nn.sigmoid(beta * (gap_x - tau)))


def gated_divergence(
    log_s_xV: jax.Array,
    log_t_xV: jax.Array,
    token_x: jax.Array,
    *,
    base: dict[str, Any],
    beta: float,
    tau: float,
) -> jax.Array:
    """g_t * D_t ([...]): D_t of the `base` options (kind, beta, estimator, top_k)."""
    d_x = divergence_from_log_probs(log_s_xV, log_t_xV, sampled_token=token_x, **base)
    return token_gate(log_prob_gap(log_s_xV, log_t_xV, token_x), beta, tau) * d_x


def divergence_options(tg_cfg: TGConfig) -> dict[str, Any]:
    """`chunked_token_stats` options whose D_t is the gated g_t * D_t."""
    base = dict(kind=tg_cfg.kind, beta=tg_cfg.beta, estimator=tg_cfg.estimator, top_k=tg_cfg.top_k)
    fn = functools.partial(gated_divergence, base=base, beta=tg_cfg.sdar_beta, tau=tg_cfg.sdar_tau)
    return {**base, "estimator": fn, "top_k": None}
