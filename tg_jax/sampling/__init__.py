"""Sampling: the KV-cache sampler, multi-turn rollouts and the background sampling loop.

decoding.py (jitted prefill + `while_loop` decode over the model's decode path
`tg_jax.models.decode`, behaviour log-probs), sampler.py (the host driver: buckets, padding,
meshes), turn_cache.py (keys and values kept across the turns of multi-turn episodes),
methods.py (temperature / top-k / top-p and the draw), rollout.py (the lock-step turn loop:
episodes against the environments -> `Trajectory` records; held-out evaluation) over
bookkeeping.py (an episode's state and a turn's tokens), env_step.py (the environment's step
and the episode's end) and records.py (the records and their hints), agent_loop.py (the same
episodes on the rollout engine), loop.py (rollouts in a thread, versioned params,
staleness), trajectory.py (the record).
"""
