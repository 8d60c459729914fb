"""Targeted guidance: the per-token divergence to the hinted teacher on failed turns.

  loss            the TG mask (which tokens are distilled), the full-vocabulary divergences
                  (reverse / forward KL, JSD), their reductions and the fused chunked loss
  teacher         the hinted teacher's rows and its forward pass (the same weights, the hint
                  in context, stop-gradient)
  compact         compact teacher rows: the teacher continues the student's prefix keys and
                  values instead of re-reading the context
  hint_copies     hint text the policy copies into its answers (masked out of the KL)
  break_span      the failed turn's span that is distilled (from the first break on)
  distill_budget  a cap on the distilled tokens per step (equal-budget arms)

The peers' methods on the same teacher path are `tg_jax.rl.peers`.
"""
