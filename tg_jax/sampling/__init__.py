"""Sampling: the KV-cache sampler, multi-turn rollouts and the background sampling loop.

sampler.py (jitted prefill + `while_loop` decode, sampling distributions, behaviour log-probs),
decode_step.py (the sampler's cache layout and one-token step), rollout.py (episodes against
the environments -> `Trajectory` records; held-out evaluation), loop.py (rollouts in a thread,
versioned params, staleness), trajectory.py (the record), benchmark.py (throughput vs HF).
"""
