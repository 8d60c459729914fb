"""Peers' methods as arms on the TG teacher path (`tg.method`, issue #43).

Every method shares TG's machinery: the same hinted teacher rows (the policy's own weights with
the hint in context, under stop-gradient; `tg_jax.rl.tg.teacher`), the same chunked
full-vocabulary pass (`tg_jax.rl.tg.divergence.chunked_token_stats`), the same GRPO surrogate
and rewards. They differ only in the per-token teacher term D_t computed in that pass and in how
it enters the loss (`tg_jax.rl.loss.loss_fn`, the door that picks the method):

  tg    L_GRPO + lambda_tg * mean_{M} D_t          M = failed turns (the method)
  opsd  the same with M = every turn                (`opsd`: tg.gate "all_turns")
  sdpo  (1 - w) L_GRPO + w * mean_{M} D_t           (`sdpo`: M = every turn, 3 estimators)
  sdar  L_GRPO + lambda_tg * mean_{M} g_t D_t       (`sdar`: g_t a stop-gradient token gate)
  sgcd  L_GRPO(A * clip(1 + alpha s_t, 1 +- c))     (`sgcd`: no distillation term)

`divergence_options` gives D_t of the methods with one of their own (`METHODS`); tg and opsd
use TG's (`tg_jax.rl.tg.divergence.divergence_options`).
"""

from __future__ import annotations

from typing import Any

from tg_jax.rl.peers import sdar, sdpo, sgcd
from tg_jax.rl.step_config import TGConfig

__all__ = ["METHODS", "divergence_options", "sdar", "sdpo", "sgcd"]

# The methods whose teacher term D_t is their own.
METHODS = ("sdpo", "sdar", "sgcd")


def divergence_options(tg_cfg: TGConfig) -> dict[str, Any]:
    """kind, beta, estimator (a name or a per-token callable) and top_k of the teacher term
    D_t that `chunked_token_stats` computes for tg.method, one of `METHODS`."""
    if tg_cfg.method == "sdpo":
        return sdpo.divergence_options(tg_cfg)
    if tg_cfg.method == "sdar":
        return sdar.divergence_options(tg_cfg)
    if tg_cfg.method == "sgcd":
        return dict(sgcd.DIVERGENCE_OPTIONS)
    raise ValueError(f"tg.method {tg_cfg.method!r} has no divergence of its own: {METHODS}")
