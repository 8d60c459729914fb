"""Sampling: the KV-cache sampler, multi-turn rollouts and the background sampling loop.

sampler.py (jitted prefill + `while_loop` decode over the model's decode path
`tg_jax.models.decode`, behaviour log-probs), turn_cache.py (keys and values kept across the
turns of multi-turn episodes), methods.py (temperature / top-k / top-p and the draw),
rollout.py (episodes against the environments -> `Trajectory` records; held-out evaluation),
loop.py (rollouts in a thread, versioned params, staleness), trajectory.py (the record).
"""
