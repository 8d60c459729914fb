"""Rollouts of fixed assistant turns through the real multi-turn loop.

`scripted_rollout` plays one episode whose assistant turns are given as text: the same
`play_episodes` loop as a policy's rollout renders the prompt, appends every turn and the
environment's observations token by token, and the environment judges every turn. The result is
a `Trajectory` exactly like a sampled one (except that its behaviour log-probs are 0), so
notebooks and tests can build TG batches from readable, hand-written turns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from tg_jax.envs.base import Environment
from tg_jax.sampling import rollout
from tg_jax.sampling.sampler import SampleResult
from tg_jax.sampling.trajectory import Trajectory
from tg_jax.text import ChatRenderer


class ScriptedSampler:
    """Stands in for `Sampler`: turn k of every episode is `turns[k]` followed by a stop id.

    A turn longer than its token budget is cut (and reported as not stopped), like a sampled
    one. The log-prob of every emitted token is 0.
    """

    def __init__(self, renderer: ChatRenderer, turns: Sequence[str]):
        self.renderer = renderer
        self.turns = list(turns)
        self._calls = 0

    def sample(self, params, prompts, *, max_new_tokens, stop_ids, rng, **kw) -> SampleResult:
        """Returns the next scripted turn for every prompt (one call per turn of the loop)."""
        del params, rng, kw
        if self._calls >= len(self.turns):
            raise ValueError(f"the episode wants turn {self._calls + 1}; the script has no more")
        ids = self.renderer.tokenizer.encode(self.turns[self._calls]) + [int(stop_ids[0])]
        self._calls += 1
        budgets = np.broadcast_to(np.asarray(max_new_tokens), (len(prompts),))
        tokens = [np.asarray(ids[: int(b)], np.int32) for b in budgets]
        logprobs = [np.zeros(len(t), np.float32) for t in tokens]
        stopped = np.array([len(ids) <= int(b) for b in budgets])
        return SampleResult(tokens, logprobs, logprobs, stopped)


def scripted_rollout(
    renderer: ChatRenderer,
    env_factory: Callable[[], Environment],
    task: Any,
    turns: Sequence[str],
    *,
    config: rollout.RolloutConfig | None = None,
    group_id: int = 0,
    policy_version: int = 0,
) -> Trajectory:
    """One episode of `task` whose assistant turns are `turns`, as a `Trajectory`.

    Args:
      renderer: chat renderer of the model's tokenizer.
      env_factory: makes a fresh environment.
      task: the task (e.g. from `tg_jax.envs.tasks.generate_tasks`).
      turns: assistant turn texts, in order; the episode may end before using all of them
        (a submit, or the environment's turn limit), never after.
      config: episode limits (default: `RolloutConfig` with room for 1024 tokens).
      group_id, policy_version: recorded in the trajectory.

    Returns:
      The Trajectory, with each requirement's hint tokens (what the teacher sees).
    """
    config = config or rollout.RolloutConfig(max_new_tokens=256, max_total_tokens=1024)
    sampler = ScriptedSampler(renderer, turns)
    (episode,) = rollout.play_episodes(
        sampler,
        None,
        renderer,
        env_factory,
        [task],
        config=config,
        rng=jax.random.key(0),
        group_ids=[group_id],
    )
    hints = rollout.requirement_hint_tokens(renderer, episode.env)
    return rollout.to_trajectory(episode, hints, policy_version)
