"""A finished episode as a `Trajectory` record, with the hints the teacher sees.

  to_trajectory             the record of one episode (tokens, roles, turn ids, behaviour
                            log-probs, verdicts, breaks, rewards, info)
  requirement_hint_tokens   the environment's own hint messages: each requirement's, and one
                            per set of two or more (`hint_key`), as the hinted evaluation shows
  _picked_hints             per turn, the hints a picker chose (imperfect feedback)
  hint_leaking_turns        turns that reproduce a hint n-gram (privilege drift)
  group_trajectories        a batch of GRPO groups' episodes as records (`rollout_groups`)
  evaluation_records        held-out episodes as `EpisodeRecord`s and records (`evaluate`)

The episodes come from `tg_jax.sampling.rollout.play_episodes` or the agent loops
(`tg_jax.sampling.agent_loop`), which keep them in `tg_jax.sampling.bookkeeping.Episode`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from tg_jax.envs import leakage
from tg_jax.envs.base import Environment, EpisodeSummary, join_hints
from tg_jax.envs.hints import pick_turn_hints
from tg_jax.sampling.bookkeeping import TERMINATIONS, Episode
from tg_jax.sampling.episode import EpisodeRecord, episode_compliance
from tg_jax.sampling.trajectory import Trajectory, aligned_routes, hint_key
from tg_jax.text import ChatRenderer, hint_message


def requirement_hint_tokens(renderer: ChatRenderer, env: Environment) -> dict[str, list[int]]:
    """The hint messages the teacher sees: each requirement's own, and for every set of two
    or more requirements the one message that hints them all (key `hint_key`), as the hinted
    evaluation and the SFT transcripts show it."""
    names = [r.name for r in env.requirements]
    out = {n: renderer.render_message(hint_message(env.hint([n]))) for n in names}
    for subset in _joint_subsets(names):
        out[hint_key(subset)] = renderer.render_message(hint_message(env.hint(subset)))
    return out


def _joint_subsets(names: Sequence[str]) -> list[tuple[str, ...]]:
    """Every set of two or more of `names` (sorted): the turns that break several
    requirements at once, each hinted with one message (`hint_key`)."""
    names = sorted(names)
    return [s for k in range(2, len(names) + 1) for s in itertools.combinations(names, k)]


def hint_leaking_turns(ep: Episode, turn_hints: Sequence[Sequence[str]] | None = None) -> int:
    """Assistant turns of `ep` that reproduce a hint n-gram (tg_jax.envs.leakage): of any
    requirement's own hint, or of the texts in turn_hints[k] (the teacher's, turn k)."""
    own = [ep.env.hint([r.name]) for r in ep.env.requirements]
    return leakage.leaking_turns(ep.texts, own, turn_hints)


def _picked_hints(
    ep: Episode,
    renderer: ChatRenderer,
    picker: Callable[[str, int], str],
    cache: dict[str, list[int]],
) -> tuple[list[dict[str, list[int]]], list[dict[str, str]]]:
    """(per turn {name: hint message tokens}, per turn {name: text}): one pick
    `picker(name, ep.group_id)` per judged requirement of every turn (`pick_turn_hints`)."""
    texts = pick_turn_hints(ep.verdicts, lambda name: picker(name, ep.group_id))
    tokens = []
    for turn in texts:
        messages = dict(turn)  # each pick, and the picks of 2+ requirements as one message
        for subset in _joint_subsets(list(turn)):
            messages[hint_key(subset)] = join_hints({n: turn[n] for n in subset})
        for t in set(messages.values()) - set(cache):
            cache[t] = renderer.render_message(hint_message(t))
        tokens.append({key: cache[t] for key, t in messages.items()})
    return tokens, texts


def conditional_names(env: Environment) -> list[str]:
    """The environment's requirements met where they never applied (`Requirement.conditional`)."""
    return sorted(r.name for r in env.requirements if r.conditional)


def _summary(ep: Episode) -> EpisodeSummary:
    """The environment's summary of `ep`; after an environment error, what is known of it."""
    if not ep.error:
        return ep.env.summary()
    try:
        return ep.env.summary()
    except Exception:  # noqa: BLE001 (the environment already failed)
        return EpisodeSummary(verdicts={}, actions={}, turns=len(ep.turn_starts), end_reason="")


def to_trajectory(
    ep: Episode,
    hint_tokens: dict[str, list[int]],
    policy_version: int,
    extra_info: dict[str, Any] | None = None,
    turn_hint_tokens: list[dict[str, list[int]]] | None = None,
) -> Trajectory:
    """The Trajectory record of a finished episode (`turn_hint_tokens`: see Trajectory)."""
    summary = _summary(ep)
    info = {
        "termination": ep.termination,
        "end_reason": summary.end_reason,
        "actions": dict(summary.actions),
        "unjudged": dict(summary.unjudged),
        "rejected_turns": list(summary.rejected),  # not accepted: met there earns nothing
        "turns": len(ep.turn_starts),
        "truncated_turns": ep.truncated_turns,
        "num_tokens": len(ep.tokens),
        "sampled_tokens": int(sum(t >= 0 for t in ep.turn_ids)),
        "prefill_tokens": ep.prefill_tokens,
        "weight_sync_s": ep.weight_sync_s,
        # Lineage: the process that sampled it and the engine requests of its turns
        # (`rl_loop.dump_rollouts` keeps them; none from the lock-step sampler).
        "sampler_process": jax.process_index(),
        "request_ids": list(ep.request_ids),
        **({"rollout_call": dict(ep.call_times)} if ep.call_times else {}),
        "steps": ep.step_infos,
        # Requirements met where they never applied (`Requirement.conditional`).
        "conditional_requirements": conditional_names(ep.env),
        **({"env_error": ep.error} if ep.error else {}),
        **(extra_info or {}),
    }
    return Trajectory(
        tokens=np.asarray(ep.tokens, np.int32),
        roles=np.asarray(ep.roles, np.int8),
        turn_ids=np.asarray(ep.turn_ids, np.int32),
        turn_starts=np.asarray(ep.turn_starts, np.int32),
        behaviour_logprobs=np.asarray(ep.logprobs, np.float32),
        turn_verdicts=ep.verdicts,
        rewards=dict(ep.rewards or {}),
        hint_tokens=hint_tokens,
        group_id=ep.group_id,
        policy_version=int(policy_version),
        task_id=ep.task_id,
        info=info,
        turn_hint_tokens=turn_hint_tokens,
        turn_breaks=[dict(b) for b in ep.breaks],
        routed_experts=aligned_routes(ep.routes, len(ep.tokens)),
    )


def group_trajectories(
    episodes: Sequence[Episode],
    renderer: ChatRenderer,
    policy_version: int,
    hint_picker: Callable[[str, int], str] | None = None,
) -> list[Trajectory]:
    """The records of GRPO groups' episodes (`rollout.rollout_groups`): the environment's own
    hints, and with `hint_picker` the picked hints of every turn (info["turn_hint_texts"],
    `Trajectory.turn_hint_tokens`); info["hint_leaking_turns"] against the hints shown."""
    out = []
    default_hints = requirement_hint_tokens(renderer, episodes[0].env) if episodes else {}
    cache: dict[str, list[int]] = {}
    for ep in episodes:
        per_turn, extra = None, {"hint_leaking_turns": hint_leaking_turns(ep)}
        if hint_picker is not None:
            per_turn, texts = _picked_hints(ep, renderer, hint_picker, cache)
            shown = [list(t.values()) for t in texts]
            extra = {"hint_leaking_turns": hint_leaking_turns(ep, shown), "turn_hint_texts": texts}
        out.append(to_trajectory(ep, default_hints, policy_version, extra, per_turn))
    if out:
        terms = {t: sum(tr.info["termination"] == t for tr in out) for t in TERMINATIONS}
        logging.debug("rollouts: %d trajectories, terminations %s", len(out), terms)
    return out


def evaluation_records(
    episodes: Sequence[Episode], renderer: ChatRenderer, condition: str, sample: int
) -> tuple[list[EpisodeRecord], list[Trajectory]]:
    """Held-out episodes (`rollout.evaluate`, sample index `sample`) as EpisodeRecords (task
    success, compliance per requirement, actions) and Trajectories (policy_version -1)."""
    records, trajectories = [], []
    hints = requirement_hint_tokens(renderer, episodes[0].env) if episodes else {}
    for ep in episodes:
        names = [r.name for r in ep.env.requirements]
        verdicts = {n: [v.get(n) for v in ep.verdicts] for n in names}
        records.append(
            EpisodeRecord(
                task_id=ep.task_id,
                condition=condition,
                sample=sample,
                task_success=bool((ep.rewards or {}).get("task", 0.0) >= 1.0),
                compliance=episode_compliance(verdicts, conditional_names(ep.env)),
                actions=dict(ep.env.summary().actions),
                turns=len(ep.turn_starts),
                hint_leaking_turns=hint_leaking_turns(ep),
                unjudged=dict(_summary(ep).unjudged),
            )
        )
        trajectories.append(to_trajectory(ep, hints, -1, {"condition": condition}))
    return records, trajectories
