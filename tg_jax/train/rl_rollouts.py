"""The RL loop's rollout side: task batches -> rollout groups, inline or in the sampling thread.

Every rollout batch has an absolute index i in the train split's task order (the task
iterator's group index, which survives resumes); the sampling loop hands it to `BatchRollout`
with the tasks. Everything random about batch i derives from i and the group alone: its
sampling key is fold_in(sampling_key, i), each rollout draws from its own stream of that key
(`rollout.rollout_groups`), and the imperfect-feedback picks of group k (one per assistant turn
and judged requirement, `tg_jax.envs.hints.pick_turn_hints`) come from a generator seeded with
(run seed, i, k). So a resumed run samples exactly what an uninterrupted one would,
given the same params (the deterministic mode relies on it), both loops sample the same batch
alike, and so do several processes that each sample a share of the batch's groups.

Several processes (`jax.distributed`): every process iterates the same task batches;
`BatchRollout` rolls out this process's contiguous share of each batch's groups
(`multihost.process_slice`) on its own devices, and `ProcessGather` (what `rollout_source`
returns then) publishes the params to those devices and hands the trainer the whole batch's
trajectories, gathered in process order: the same list, in the same order, as one process
sampling every group.

`rollout_source` picks the loop (one interface: `publish`, `get`, `close`, `stats`):
  * `tg_jax.sampling.loop.InlineLoop` (deterministic mode): `get` samples the next batch in the
    caller's thread with the newest published params; staleness is always 0.
  * `tg_jax.sampling.loop.SamplingLoop`: samples ahead in a thread and refuses groups older
    than the allowed staleness.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from tg_jax import multihost
from tg_jax.envs.base import Environment, Requirement
from tg_jax.envs.hints import (
    HINT_KINDS,
    IRRELEVANT_HINTS,
    WRONG_HINTS,
    FeedbackRates,
    VerdictNoise,
    pick_hint,
)
from tg_jax.sampling import agent_loop, rollout
from tg_jax.sampling.episode import episode_compliance
from tg_jax.sampling.loop import InlineLoop, RolloutGroup, SamplingLoop
from tg_jax.sampling.sampler import Sampler
from tg_jax.sampling.trajectory import Trajectory
from tg_jax.text import ChatRenderer, hint_message, tool_formats


def feedback_rates(cfg: Any) -> FeedbackRates:
    """FeedbackRates from `rl_loop.feedback`."""
    return FeedbackRates(float(cfg.correct), float(cfg.irrelevant), float(cfg.wrong))


def verdict_noise(cfg: Any) -> VerdictNoise:
    """VerdictNoise from `rl_loop.feedback` (none when the config predates the fields)."""
    return VerdictNoise(
        float(cfg.get("false_positive", 0.0)), float(cfg.get("false_negative", 0.0))
    )


def hint_reserve(
    renderer: ChatRenderer, requirements: Sequence[Requirement], max_turns: int
) -> int:
    """Most tokens the teacher's hints can add to one trajectory (any hint kind).

    A per-trajectory teacher row inserts, before every targeted turn, one hint message per
    failed requirement; the longest correct (the requirement's own hint, in the model's tool
    format: the environment is built with it), irrelevant or wrong text bounds each.
    """
    per_turn = 0
    for req in requirements:
        options = [req.hint, *IRRELEVANT_HINTS, *WRONG_HINTS.get(req.name, ())]
        per_turn += max(len(renderer.render_message(hint_message(t))) for t in options)
    return max_turns * per_turn


class BatchRollout:
    """The sampling loops' rollout function: (params, batch index, tasks, version) ->
    trajectories, reproducible per batch index."""

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
        engine: agent_loop.EngineRunner | None = None,
        processes: Sequence[int] | None = None,
    ):
        """engine: play the episodes on it (`agent_loop.play_episodes`, each batch's params
        and version loaded first) instead of the sampler's lock-step turns. processes: the
        processes that share the groups (`sharding.sampler_processes`; None = all)."""
        self.processes = tuple(processes) if processes is not None else None
        self.sampler, self.renderer, self.env_factory = sampler, renderer, env_factory
        self.engine = engine
        self.rollouts_per_group = rollouts_per_group
        self.config = config
        self.sampling_key = sampling_key
        self.seed = seed
        self.rates = rates
        self.tool_format = getattr(renderer, "tool_format", None) or tool_formats.HERMES

    def __call__(
        self, params: Any, index: int, tasks: Sequence[Any], version: int
    ) -> list[Trajectory]:
        """Rolls out this process's share of batch `index` (all of it with one process)."""
        picker, kinds, gens = None, [], {}
        if self.rates != FeedbackRates():

            def picker(name: str, group_id: int | None = None) -> str:
                if group_id not in gens:
                    suffix = "" if group_id is None else f"-{group_id}"
                    gens[group_id] = random.Random(f"feedback-{self.seed}-{index}{suffix}")
                kind, text = pick_hint(name, gens[group_id], self.rates, self.tool_format)
                kinds.append(kind)
                return text

        procs = self.processes or tuple(range(jax.process_count()))
        share = multihost.process_slice(len(tasks), procs.index(jax.process_index()), len(procs))
        sampler, play = self.sampler, None
        if self.engine is not None:
            self.engine.load(params, version)
            sampler, play = self.engine, agent_loop.play_episodes
        trajectories = rollout.rollout_groups(
            sampler,
            params,
            self.renderer,
            self.env_factory,
            tasks[share],
            rollouts_per_task=self.rollouts_per_group,
            config=self.config,
            rng=jax.random.fold_in(self.sampling_key, index),
            policy_version=version,
            first_group_id=index * len(tasks) + share.start,
            hint_picker=picker,
            play=play,
        )
        if any(t.routed_experts is not None for t in trajectories):  # router replay
            check_routes(trajectories, self.sampler.model.config)
        trajectories = drop_engine_errors(trajectories)
        for t in trajectories:
            t.info["batch_index"] = index
        if kinds and trajectories:
            trajectories[0].info["feedback_kinds"] = kinds
        return trajectories


NOT_SAMPLING = "not sampling: a trainer process of the whole-host split"


class NoRollouts:
    """A trainer process's sampling loop under the whole-host split (`sampler_mesh.processes`):
    it plays no group (its `get` is NOT_SAMPLING); `ProcessGather` merges the sampler
    processes' groups and reports their first one's counters."""

    def publish(self, params: Any, version: int) -> None:
        del params, version  # None: the copy went to the sampler processes

    def get(self, max_staleness: int, timeout: float | None = None) -> str:
        del max_staleness, timeout
        return NOT_SAMPLING

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class ProcessGather:
    """A sampling loop of a multi-process run, as the trainer sees it (the same interface).

    `publish` hands the loop `to_sampler(params)` (global params -> this host's sampler
    devices; a collective, so it runs in the trainer's thread on every process); `get` gathers
    every process's group into one (a collective too): trajectories in process order, the
    oldest policy version and batch index, the longest rollout time.
    """

    def __init__(
        self,
        loop: InlineLoop | SamplingLoop | NoRollouts,
        to_sampler: Callable[[Any], Any],
        whole: bool = False,
    ):
        """whole: the whole-host split (a sampler process cannot wait for the params itself)."""
        self._loop, self._to_sampler, self._whole = loop, to_sampler, whole
        self._publish_s = 0.0
        self._sampler_stats: dict[str, float] = {}  # a NoRollouts process: the samplers'

    def publish(self, params: Any, version: int) -> None:
        """Hands the loop this host's copy of `params`, once it is on the sampler's devices
        (the sync's wall time from computed params to placed copy: `stats()["publish_s"]`)."""
        jax.block_until_ready(params)  # the train step that made them, not the sync's time
        if self._whole:  # the trainer processes' wait, which a sampler process cannot make
            multihost.barrier("params computed")
        start = time.perf_counter()
        local = jax.block_until_ready(self._to_sampler(params))
        self._publish_s = time.perf_counter() - start
        self._loop.publish(local, version)

    def get(self, max_staleness: int, timeout: float | None = None) -> RolloutGroup | None:
        """Every process's next group, merged; None once any process's tasks ran out."""
        own = self._loop.get(max_staleness, timeout)
        stats = {**self._loop.stats(), "publish_s": self._publish_s}
        pairs = multihost.allgather_objects((own, stats))
        pairs = [(g, st) for g, st in pairs if not (isinstance(g, str) and g == NOT_SAMPLING)]
        self._sampler_stats = pairs[0][1]
        groups = [g for g, _ in pairs]
        if any(g is None for g in groups):
            return None
        return RolloutGroup(
            trajectories=[t for g in groups for t in g.trajectories],
            policy_version=min(g.policy_version for g in groups),
            batch_index=min(g.batch_index for g in groups),
            seconds=max(g.seconds for g in groups),
            staleness=max(g.staleness for g in groups),
        )

    def stats(self) -> dict[str, float]:
        """The loop's counters and `publish_s`, the last weight sync's seconds. A trainer
        process of the whole-host split reports the first sampler process's, as of the last
        `get` (its sync ends on the sampler's chips: the previous step's)."""
        if isinstance(self._loop, NoRollouts):
            return dict(self._sampler_stats)
        return {**self._loop.stats(), "publish_s": self._publish_s}

    def close(self) -> None:
        self._loop.close()


def rollout_source(
    rollout_fn: BatchRollout,
    task_batches: Iterable[Sequence[Any]],
    *,
    first_index: int,
    async_sampling: bool,
    queue_size: int = 2,
    devices: Sequence[jax.Device] | None = None,
    to_sampler: Callable[[Any], Any] | None = None,
    whole: bool = False,
) -> InlineLoop | SamplingLoop | ProcessGather:
    """The sampling loop over `task_batches`, whose first batch has index `first_index`.

    Args:
      rollout_fn: the batch rollout.
      task_batches: task batches in the train order, from the iterator's restored position
        (the same batches on every process).
      first_index: that position (the absolute index of the first batch).
      async_sampling: True = `SamplingLoop` (a thread samples ahead), False = `InlineLoop`.
      queue_size, devices: the `SamplingLoop`'s (ignored inline).
      to_sampler: trainer params -> the sampler's. One process: the loop's `place` (a sampler
        on its own mesh); several (process-local params): the loop comes wrapped in a
        `ProcessGather`.
      whole: the whole-host split (`ProcessGather`'s; a trainer process of it makes its
        `ProcessGather` of `NoRollouts` itself).
    """
    gather = to_sampler is not None and jax.process_count() > 1
    place = None if gather else to_sampler
    if async_sampling:
        loop = SamplingLoop(
            rollout_fn,
            task_batches,
            first_index=first_index,
            queue_size=queue_size,
            devices=devices,
            place=place,
        )
    else:
        loop = InlineLoop(rollout_fn, task_batches, first_index=first_index, place=place)
    return ProcessGather(loop, to_sampler, whole) if gather else loop


def drop_engine_errors(trajectories: list[Trajectory]) -> list[Trajectory]:
    """The trajectories without the groups that hold an episode the rollout engine ended
    ("engine_error": unusable output, never trained on); the first kept trajectory carries
    the count in info["engine_error_groups"] (`rollout/engine_error_groups`). RuntimeError
    when no group is left."""
    bad = {t.group_id for t in trajectories if t.info.get("termination") == "engine_error"}
    if not bad:
        return trajectories
    kept = [t for t in trajectories if t.group_id not in bad]
    logging.warning("dropped %d rollout group(s) with unusable engine output", len(bad))
    if not kept:
        raise RuntimeError(
            f"every rollout group of the batch had unusable engine output ({len(bad)} groups): "
            f"{next(t.info.get('env_error') for t in trajectories if t.group_id in bad)}"
        )
    kept[0].info["engine_error_groups"] = len(bad)
    kept[0].info["dropped_groups"] = [  # lineage: what was dropped, and why
        {
            "group_id": int(g),
            "task_ids": sorted({str(t.task_id) for t in trajectories if t.group_id == g}),
            "why": "engine_error: "
            + next(str(t.info.get("env_error", "")) for t in trajectories if t.group_id == g),
        }
        for g in sorted(bad)
    ]
    return kept


def check_routes(trajectories: Sequence[Trajectory], cfg: Any) -> None:
    """Checks each routing record (`Trajectory.routed_experts`) against the model `cfg`: a
    record whose shape is not [tokens, layers, experts per token] raises ValueError (an
    engine or config that does not match the model); one with an expert id outside [0,
    num_experts) or an expert twice for a token (unusable: replay would drop or double it)
    ends its episode "engine_error", so `drop_engine_errors` drops its group."""
    want = (int(cfg.num_layers), int(cfg.experts_per_token))
    for t in trajectories:
        r = t.routed_experts
        if r is None:
            continue
        if tuple(r.shape[1:]) != want:
            raise ValueError(
                f"routing record of task {t.task_id!r} has {tuple(r.shape[1:])} (layers, "
                f"experts per token) per token; the model routes {want}"
            )
        ids = np.sort(r[np.all(r >= 0, axis=-1)], axis=-1)  # [m, J]: tokens with a record
        bad = (r < -1).any() or (ids >= cfg.num_experts).any() or (ids[:, 1:] == ids[:, :-1]).any()
        if bad and t.info.get("termination") != "engine_error":
            t.info["termination"] = "engine_error"
            t.info["env_error"] = (
                f"unusable routing record: an expert id outside [0, {cfg.num_experts}) or "
                "twice for one token"
            )


def _routed_share(trajectories: Sequence[Any]) -> float:
    """Share of the tokens with the rollout's routing recorded (`model.router_replay`: every
    token the sampler or engine fed; 0 without replay)."""
    total = sum(len(t.tokens) for t in trajectories)
    routed = sum(
        int((t.routed_experts[:, 0, 0] >= 0).sum())
        for t in trajectories
        if t.routed_experts is not None
    )
    return routed / max(total, 1)


def _call_times(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """time/rollout_engine_s and time/rollout_tool_wait_s summed over the step's engine calls
    ({} from the lock-step sampler)."""
    calls = {}
    for t in trajectories:
        c = t.info.get("rollout_call")
        if c is not None:
            calls[(t.info.get("sampler_process", 0), c["call"])] = c
    if not calls:
        return {}
    return {
        "time/rollout_engine_s": float(sum(c["engine_s"] for c in calls.values())),
        "time/rollout_tool_wait_s": float(sum(c["tool_wait_s"] for c in calls.values())),
    }


def rollout_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Training-time rollout statistics (host numbers, no device sync): rates per episode,
    per-requirement compliance, actions, terminations (`rollout/end/env_error`: episodes an
    environment error ended), crashed tool calls per episode (`rollout/tool_crashed`), feedback
    kinds (shares of the per-turn picks), prompt tokens prefilled per episode, and hint leakage
    (`rollout/hint_leakage`: share of the assistant turns that reproduce a hint n-gram,
    tg_jax.envs.leakage).
    `rollout/turn_pass/first` and `rollout/turn_pass/later`: the share of judged turns that
    met every requirement judged on them, for the first assistant turn and for the turns after
    it (where later turns fail more often, an episode's requirement reward falls with every
    turn it takes)."""
    n = max(len(trajectories), 1)
    comp, success = [], []
    turn_pass: dict[str, list[float]] = {"first": [], "later": []}
    per_req: dict[str, list[float]] = {}
    out: dict[str, float] = {f"rollout/end/{k}": 0.0 for k in rollout.TERMINATIONS}
    for t in trajectories:
        names = sorted({k for v in t.turn_verdicts for k in v})
        verdicts = {k: [v.get(k) for v in t.turn_verdicts] for k in names}
        c = episode_compliance(verdicts, t.info.get("conditional_requirements", ()))
        for k, ok in c.items():
            per_req.setdefault(k, []).append(float(ok))
        for i in range(t.num_turns):
            if (met := t.turn_met(i)) is not None:
                turn_pass["first" if i == 0 else "later"].append(float(met))
        comp.append(float(bool(c) and all(c.values())))
        success.append(float(t.rewards.get("task", 0.0) >= 1.0))
        for k, v in t.info.get("actions", {}).items():
            out[f"rollout/actions/{k}"] = out.get(f"rollout/actions/{k}", 0.0) + v / n
        for k, v in t.info.get("unjudged", {}).items():  # plug-in checks that raised / hung
            out[f"rollout/unjudged/{k}"] = out.get(f"rollout/unjudged/{k}", 0.0) + v / n
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
            "rollout/engine_error_groups": float(
                sum(t.info.get("engine_error_groups", 0) for t in trajectories)
            ),
            **_call_times(trajectories),  # the engine calls' engine and tool-wait seconds
            # The rollout engine's weight sync before the step's calls ("builtin", "vllm").
            "time/weight_sync_s": max(
                [t.info.get("weight_sync_s", 0.0) for t in trajectories] or [0.0]
            ),
            "rollout/prefill_tokens": float(
                np.mean([t.info.get("prefill_tokens", 0.0) for t in trajectories] or [0])
            ),
            "rollout/routed_share": _routed_share(trajectories),
            # <think> blocks closed at rl_loop.think_budget, per episode
            "rollout/think_closed": float(
                np.mean([t.closed_by_rollout() for t in trajectories] or [0])
            ),
        }
    )
    out.update({f"rollout/compliance/{k}": float(np.mean(v)) for k, v in per_req.items()})
    out.update({f"rollout/turn_pass/{k}": float(np.mean(v)) for k, v in turn_pass.items() if v})
    measured = [t for t in trajectories if "hint_leaking_turns" in t.info]
    if measured:
        turns = sum(t.num_turns for t in measured)
        leaks = sum(int(t.info["hint_leaking_turns"]) for t in measured)
        out["rollout/hint_leakage"] = leaks / max(turns, 1)
    # Tool calls whose sandboxed run crashed (killed by a signal, the sandbox killed mid-call),
    # per episode.
    crashed = [
        sum(s.get("tool_error") == "crashed" for s in t.info.get("steps", ())) for t in trajectories
    ]
    out["rollout/tool_crashed"] = float(np.mean(crashed)) if crashed else 0.0
    kinds = [k for t in trajectories for k in t.info.get("feedback_kinds", ())]
    if kinds:
        out.update({f"feedback/{k}": kinds.count(k) / len(kinds) for k in HINT_KINDS})
    return out


def sampled_tokens(trajectories: Sequence[Trajectory]) -> int:
    """Tokens the policy sampled (assistant-turn tokens) in these trajectories."""
    return int(sum(np.sum(t.turn_ids >= 0) for t in trajectories))
