"""The run's reward weights reconciled with its environment's requirement set: a
requirement named in `env.requirements` gets its reward weight by default, a non-zero weight
for a component nothing provides is a config error naming both (`advantages.resolve_weights`).
Read by the start-up check (`tg_jax.preflight`) and by every RL run (`train.rl`)."""

from __future__ import annotations

import copy
from typing import Any


def reward_weights(config: Any, env: Any = None) -> dict[str, float]:
    """The run's reward weights: `config.rl.reward_weights` reconciled with the environment
    `env` (default: made from config.env) by `advantages.resolve_weights`.

    Raises:
      ValueError: a non-zero weight nothing provides (naming it and env.requirements).
    """
    from tg_jax.rl.advantages import resolve_weights

    if env is None:
        from tg_jax.envs import make_env

        env = make_env(config.env)
    requirements = {r.name: float(r.weight) for r in env.requirements}
    weights = {str(k): float(v) for k, v in config.rl.reward_weights.items()}
    return resolve_weights(weights, tuple(env.reward_keys), requirements)


def with_reward_weights(config: Any, env: Any) -> Any:
    """A copy of `config` whose rl.reward_weights are `reward_weights(config, env)` (the
    config itself is not changed); `config` itself where they are the same."""
    import ml_collections

    weights = reward_weights(config, env)
    if weights == {str(k): float(v) for k, v in config.rl.reward_weights.items()}:
        return config
    out = copy.deepcopy(config)
    with out.unlocked():
        out.rl.reward_weights = ml_collections.ConfigDict(weights)
    return out
