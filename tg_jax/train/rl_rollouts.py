"""The RL loop's rollout side: task batches -> rollout groups, inline or in the sampling thread.

Every rollout batch has an absolute index i in the train split's task order (the task
iterator's group index, which survives resumes). Everything random about batch i derives from
i alone: its sampling key is fold_in(sampling_key, i) and its imperfect-feedback picks come
from a generator seeded with (run seed, i). So a resumed run samples exactly what an
uninterrupted one would, given the same params (the deterministic mode relies on it).

Two sources, one interface (`publish`, `get`, `close`, `stats`):
  * `InlineRollouts` (deterministic mode): `get` samples the next batch in the caller's thread
    with the newest published params; staleness is always 0.
  * `ThreadedRollouts`: `tg_jax.sampling.loop.SamplingLoop`, which samples ahead in a thread
    and refuses groups older than the allowed staleness.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from tg_jax.envs.base import Environment
from tg_jax.envs.hints import (
    CORRECT_HINTS,
    HINT_KINDS,
    IRRELEVANT_HINTS,
    WRONG_HINTS,
    FeedbackRates,
    pick_hint,
)
from tg_jax.sampling import rollout
from tg_jax.sampling.episode import episode_compliance
from tg_jax.sampling.loop import RolloutGroup, SamplingLoop
from tg_jax.sampling.sampler import Sampler
from tg_jax.sampling.trajectory import Trajectory
from tg_jax.text import ChatRenderer, hint_message


def feedback_rates(cfg: Any) -> FeedbackRates:
    """FeedbackRates from `rl_loop.feedback`."""
    return FeedbackRates(float(cfg.correct), float(cfg.irrelevant), float(cfg.wrong))


def hint_reserve(renderer: ChatRenderer, requirements: Sequence[str], max_turns: int) -> int:
    """Most tokens the teacher's hints can add to one trajectory (any hint kind).

    A per-trajectory teacher row inserts, before every targeted turn, one hint message per
    failed requirement; the longest correct, irrelevant or wrong text bounds each.
    """
    per_turn = 0
    for name in requirements:
        options = [CORRECT_HINTS.get(name, ""), *IRRELEVANT_HINTS, *WRONG_HINTS.get(name, ())]
        per_turn += max(len(renderer.render_message(hint_message(t))) for t in options)
    return max_turns * per_turn


class BatchRollout:
    """(params, (batch index, tasks), version) -> trajectories, reproducible per batch index."""

    def __init__(
        self,
        sampler: Sampler,
        renderer: ChatRenderer,
        env_factory: Callable[[], Environment],
        *,
        rollouts_per_group: int,
        config: rollout.RolloutConfig,
        sampling_key: jax.Array,
        seed: int,
        rates: FeedbackRates,
    ):
        self.sampler, self.renderer, self.env_factory = sampler, renderer, env_factory
        self.rollouts_per_group = rollouts_per_group
        self.config = config
        self.sampling_key = sampling_key
        self.seed = seed
        self.rates = rates

    def __call__(
        self, params: Any, item: tuple[int, Sequence[Any]], rng: Any, version: int
    ) -> list[Trajectory]:
        del rng  # the loop's own per-batch key restarts at 0 after a resume; ours does not
        index, tasks = item
        picker, kinds = None, []
        if self.rates != FeedbackRates():
            gen = random.Random(f"feedback-{self.seed}-{index}")

            def picker(name: str) -> str:
                kind, text = pick_hint(name, gen, self.rates)
                kinds.append(kind)
                return text

        trajectories = rollout.rollout_groups(
            self.sampler, params, self.renderer, self.env_factory, tasks,
            rollouts_per_task=self.rollouts_per_group, config=self.config,
            rng=jax.random.fold_in(self.sampling_key, index), policy_version=version,
            first_group_id=index * len(tasks), hint_picker=picker,
        )  # fmt: skip
        for t in trajectories:
            t.info["batch_index"] = index
        if kinds:
            trajectories[0].info["feedback_kinds"] = kinds
        return trajectories


def numbered(batches: Iterator[Sequence[Any]], first: int) -> Iterator[tuple[int, Sequence[Any]]]:
    """(absolute batch index, tasks) pairs, counting from the iterator's restored position."""
    for i, tasks in enumerate(batches):
        yield first + i, tasks


class InlineRollouts:
    """Deterministic mode: each `get` samples the next batch now, in this thread."""

    def __init__(self, rollout_fn: BatchRollout, batches: Iterator[tuple[int, Sequence[Any]]]):
        self._fn, self._batches = rollout_fn, batches
        self._params, self._version = None, -1

    def publish(self, params: Any, version: int) -> None:
        # No copy: sampling finishes before the next (donating) train step is dispatched.
        self._params, self._version = params, int(version)

    def get(self, max_staleness: int) -> RolloutGroup | None:
        del max_staleness  # always on-policy
        try:
            item = next(self._batches)
        except StopIteration:
            return None
        start = time.perf_counter()
        trajectories = self._fn(self._params, item, None, self._version)
        return RolloutGroup(trajectories, self._version, item[0], time.perf_counter() - start)

    def stats(self) -> dict[str, float]:
        return {"groups_dropped_stale": 0.0, "staleness_mean": 0.0, "staleness_max": 0.0}

    def close(self) -> None:
        pass


class ThreadedRollouts:
    """Asynchronous mode: the sampling loop thread (tg_jax.sampling.loop)."""

    def __init__(
        self,
        rollout_fn: BatchRollout,
        batches: Iterator[tuple[int, Sequence[Any]]],
        *,
        queue_size: int,
        devices: Sequence[jax.Device] | None = None,
    ):
        self._loop = SamplingLoop(
            rollout_fn, batches, rng=jax.random.key(0), queue_size=queue_size, devices=devices
        )

    def publish(self, params: Any, version: int) -> None:
        self._loop.publish(params, version)

    def get(self, max_staleness: int) -> RolloutGroup | None:
        group = self._loop.get(max_staleness)
        if group is not None:
            # The loop numbers batches from 0 per session; the trainer needs absolute indices.
            group.batch_index = int(group.trajectories[0].info["batch_index"])
        return group

    def stats(self) -> dict[str, float]:
        s = self._loop.stats()
        return {k: s[k] for k in ("groups_dropped_stale", "staleness_mean", "staleness_max")}

    def close(self) -> None:
        self._loop.close()


def rollout_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Training-time rollout statistics (host numbers, no device sync): rates per episode,
    per-requirement compliance, actions, terminations, feedback kinds."""
    n = max(len(trajectories), 1)
    comp, success = [], []
    per_req: dict[str, list[float]] = {}
    out: dict[str, float] = {f"rollout/end/{k}": 0.0 for k in rollout.TERMINATIONS}
    for t in trajectories:
        names = sorted({k for v in t.turn_verdicts for k in v})
        verdicts = {k: [v.get(k) for v in t.turn_verdicts] for k in names}
        c = episode_compliance(verdicts)
        for k, ok in c.items():
            per_req.setdefault(k, []).append(float(ok))
        comp.append(float(bool(c) and all(c.values())))
        success.append(float(t.rewards.get("task", 0.0) >= 1.0))
        for k, v in t.info.get("actions", {}).items():
            out[f"rollout/actions/{k}"] = out.get(f"rollout/actions/{k}", 0.0) + v / n
        term = t.info.get("termination", "")
        out[f"rollout/end/{term}"] = out.get(f"rollout/end/{term}", 0.0) + 1.0 / n
    comp_a, succ_a = np.array(comp), np.array(success)
    out.update(
        {
            "rollout/compliance": float(comp_a.mean()) if comp else 0.0,
            "rollout/task_success": float(succ_a.mean()) if success else 0.0,
            "rollout/joint": float((comp_a * succ_a).mean()) if comp else 0.0,
            "rollout/turns": float(np.mean([t.num_turns for t in trajectories] or [0])),
            "rollout/truncated_turns": float(
                np.mean([t.info.get("truncated_turns", 0) for t in trajectories] or [0])
            ),
            "rollout/length": float(np.mean([len(t.tokens) for t in trajectories] or [0])),
        }
    )
    out.update({f"rollout/compliance/{k}": float(np.mean(v)) for k, v in per_req.items()})
    kinds = [k for t in trajectories for k in t.info.get("feedback_kinds", ())]
    if kinds:
        out.update({f"feedback/{k}": kinds.count(k) / len(kinds) for k in HINT_KINDS})
    return out


def sampled_tokens(trajectories: Sequence[Trajectory]) -> int:
    """Tokens the policy sampled (assistant-turn tokens) in these trajectories."""
    return int(sum(np.sum(t.turn_ids >= 0) for t in trajectories))
