"""Peers' methods as arms on the TG teacher path (`tg.method`, issue #43).

Every method shares TG's machinery: the same hinted teacher rows (the policy's own weights with
the hint in context, under stop-gradient; `tg_jax.rl.tg.teacher`), the same chunked
full-vocabulary pass (`tg_loss.chunked_token_stats`), the same GRPO surrogate and rewards. They
differ only in the per-token teacher term D_t computed in that pass and in how it enters the
loss (`tg_jax.rl.loss.loss_fn`):

  tg    L_GRPO + lambda_tg * mean_{M} D_t          M = failed turns (the method)
  opsd  the same with M = every turn                (`opsd`: tg.gate "all_turns")
  sdpo  (1 - w) L_GRPO + w * mean_{M} D_t           (`sdpo`: M = every turn, 3 estimators)
  sdar  L_GRPO + lambda_tg * mean_{M} g_t D_t       (`sdar`: g_t a stop-gradient token gate)
  sgcd  L_GRPO(A * clip(1 + alpha s_t, 1 +- c))     (`sgcd`: no distillation term)

`divergence_options` and `distill_weight` dispatch on tg.method; with "tg" (the default) and
"opsd" they return exactly what TG used before the peers existed.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from tg_jax.rl.peers import sdar, sdpo, sgcd
from tg_jax.rl.step_config import TGConfig
from tg_jax.rl.tg.loss import lambda_schedule

__all__ = ["divergence_options", "distill_weight", "sdar", "sdpo", "sgcd"]


def divergence_options(tg_cfg: TGConfig) -> dict[str, Any]:
    """kind, beta, estimator (a name or a per-token callable) and top_k of the teacher term
    D_t that `chunked_token_stats` computes for tg.method."""
    if tg_cfg.method == "sdpo":
        return sdpo.divergence_options(tg_cfg)
    if tg_cfg.method == "sdar":
        return sdar.divergence_options(tg_cfg)
    if tg_cfg.method == "sgcd":
        return dict(sgcd.DIVERGENCE_OPTIONS)
    return dict(kind=tg_cfg.kind, beta=tg_cfg.beta, estimator=tg_cfg.estimator, top_k=tg_cfg.top_k)


def distill_weight(step: int | jax.Array, tg_cfg: TGConfig) -> jax.Array:
    """The weight of the distillation term at `step`: lambda_tg (tg.schedule) for tg, opsd and
    sdar; sdpo's w (tg.peer_weight); 0 for sgcd (no distillation term)."""
    if tg_cfg.method == "sdpo":
        return jnp.asarray(tg_cfg.peer_weight, jnp.float32)
    if tg_cfg.method == "sgcd":
        return jnp.zeros((), jnp.float32)
    return lambda_schedule(step, tg_cfg.schedule)
