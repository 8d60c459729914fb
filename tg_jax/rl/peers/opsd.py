"""OPSD: on-policy self-distillation with privileged information (pi-Distill style).

The student samples its own trajectories; the teacher is the same weights with privileged
context (here: the requirement hints) inserted before EVERY assistant turn, under
stop-gradient; a per-token divergence between the two next-token distributions is added to
the RL loss with a coefficient lambda:

    D_t    = KL( p_theta(. | s_k, y_<t) || sg p_theta(. | s_k + h, y_<t) )
    L_OPSD = L_GRPO + lambda(step) * sum_{t in M} D_t / |M|,   M = every turn's answer tokens

That is targeted guidance with the failed-turn gate removed: TG with tg.gate = "all_turns"
(the same loss, lambda schedule, divergence and estimators). So OPSD has no code of its own:
tg.method = "opsd" runs the TG path unchanged (`tg_jax.rl.loss.teacher_term_options` and
`distill_weight` return TG's) and only checks that the gate is "all_turns"
(`TGConfig._check_method`); the pipeline arm `opsd` sets both. It is the arm `tg_all_turns`
under the peer's name, kept so that the peers group lists every method.
"""

METHOD = "opsd"
GATE = "all_turns"
