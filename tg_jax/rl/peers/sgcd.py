"""SGCD-style credit assignment: the teacher signal reweights the GRPO advantages, no KL term.

The teacher is TG's (same weights, hint in context, stop-gradient); its forward runs on the
tokens of tg.gate (the pipeline arm: every turn), but nothing is distilled into the loss. Per
produced token y_t with a teacher counterpart (the set M of tg.gate; s_t = 0 elsewhere):

    gap_t  = sg( log p_t(y_t) - log p_s(y_t) )
    s_t    = tanh(gap_t)                                        in (-1, 1)
    A'_t   = A * clip(1 + alpha * sign(A) * s_t, 1 - c, 1 + c)  alpha = tg.sgcd_alpha,
                                                                c = tg.sgcd_clip
    L_SGCD = L_GRPO(A')                                   (the clipped surrogate, A' per token)

sign(A) makes the teacher's view move credit the same way for both signs: a token the hinted
teacher prefers (s > 0) gets more credit in a rewarded episode (A > 0) and less blame in a
punished one (A < 0); a token it dislikes the reverse. (Without it, a punished episode's
tokens the teacher prefers would be blamed more.) The multiplier is stop-gradient (the score
comes from sg'd log-probs) and lies in [1 - c, 1 + c], so the sign of every advantage is kept
and its size changes by at most a factor 1 +- c.
The gap is the value of TG's sampled reverse-KL estimate with the sign flipped
(`DIVERGENCE_OPTIONS`: D_t = log p_s(y_t) - log p_t(y_t)), so the chunked pass computes it
without a second vocabulary pass. The method distils nothing (`TGConfig.distils`):
the run's distilled-token cost is 0, while its teacher FLOPs are counted as for TG.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The teacher term D_t of the chunked pass: the sampled reverse KL, value log p_s(y) - log p_t(y).
DIVERGENCE_OPTIONS = dict(kind="reverse", beta=0.5, estimator="sampled", top_k=None)


def score(divergence_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """s_t = tanh(gap_t) on `mask_BxT`, 0 elsewhere; gap_t = -sg(D_t) (`DIVERGENCE_OPTIONS`)."""
    gap_BxT = -jax.lax.stop_gradient(divergence_BxT.astype(jnp.float32))
    return jnp.where(mask_BxT.astype(bool), jnp.tanh(gap_BxT), 0.0)


def advantage_weight(
    score_BxT: jax.Array, advantages: jax.Array, alpha: float, clip: float
) -> jax.Array:
    """clip(1 + alpha * sign(A) * s, 1 - c, 1 + c), stop-gradient ([B, T]); advantages [B]
    (broadcast over tokens) or [B, T]."""
    adv = jnp.asarray(advantages, jnp.float32)
    sign_BxT = jnp.sign(adv[:, None] if adv.ndim == 1 else adv)
    weight_BxT = jnp.clip(1.0 + alpha * sign_BxT * score_BxT, 1.0 - clip, 1.0 + clip)
    return jax.lax.stop_gradient(weight_BxT)


def reweight(advantages: jax.Array, weight_BxT: jax.Array) -> jax.Array:
    """A' [B, T]: advantages [B] (broadcast over tokens) or [B, T] times the weights."""
    adv = jnp.asarray(advantages, jnp.float32)
    adv_BxT = adv[:, None] if adv.ndim == 1 else adv
    return adv_BxT * weight_BxT
