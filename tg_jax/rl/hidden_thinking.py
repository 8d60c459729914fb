"""Hidden planning text (`rl_loop.hide_thinking`): the trainer's rows of episodes whose
assistant turns never saw the <think> blocks of earlier turns.

With hidden thinking the rollout plays turn k of an episode in its *visible context*: the
episode's tokens so far without the <think> blocks of turns 0..k-1
(`tg_jax.sampling.trajectory.visible_context`; the engine prefills that context afresh for
every turn after the first). A turn's answer tokens are then computed differently at turn k
(their own thinking gone from their context) than when they were sampled, so no single
sequence reproduces every turn: the trainer gets one row per assistant turn,

    segment k = visible context of turn k + turn k's tokens (+ what follows the last turn)

in which only turn k's tokens are the policy's (earlier turns' answers become context: role
PROMPT, no turn, no behaviour log-prob). Each segment is a `Trajectory` with one turn, its
verdicts, hints and breaks, so the batch, the teacher (its hint before the one turn: the
per-turn teacher with thinking hidden), the TG masks and the policy loss work on it unchanged.
An episode of one turn (or none) is its own single segment, unchanged.

Statistics that count episodes count each once: the first segment of an episode is its
*head* (`Batch.head_B`): the GRPO group statistics, the reward metrics and the number of
trajectories that `tg.normalize` "token_sum" divides by come from heads only, and every
segment gets its episode's advantage. Each produced token is in exactly one segment, so the
token sums (the policy loss's token_mean, the TG sum) are the episode's; the seq_mean
aggregations treat each turn as a sequence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from tg_jax.sampling.trajectory import Role, Trajectory, visible_context

__all__ = [
    "check_config",
    "enabled",
    "rollout_settings",
    "rows_per_episode",
    "segment",
    "segments",
]


def enabled(config) -> bool:
    """`rl_loop.hide_thinking` of a run config (False where the field predates it)."""
    return "rl_loop" in config and bool(config.rl_loop.get("hide_thinking", False))


def rollout_settings(config) -> dict[str, object]:
    """The thinking controls' `RolloutConfig` fields of a run config, for its RL rollouts and
    every evaluation alike: `hide_thinking` and the reasoning-length budget `think_budget`."""
    budget = int(config.rl_loop.get("think_budget", 0)) if "rl_loop" in config else 0
    return {"hide_thinking": enabled(config), "think_budget": budget}


def check_config(config) -> None:
    """ValueError where a config with `rl_loop.hide_thinking` cannot run: an unbounded
    episode (the batch's static rows) or MoE router replay (routes of a re-prefilled context)."""
    if not enabled(config):
        return
    rows_per_episode(config)
    if "model" in config and bool(config.model.get("router_replay", False)):
        raise ValueError(
            "rl_loop.hide_thinking with model.router_replay: each turn's context is prefilled "
            "afresh, so the routing recorded for earlier tokens is not the one the turn saw"
        )


def segment(traj: Trajectory, turn: int) -> Trajectory:
    """The one-turn record of assistant turn `turn` of `traj` in its visible context."""
    if traj.routed_experts is not None:
        raise ValueError(
            "hidden thinking with a routing record: a turn's context is prefilled afresh, so "
            "the recorded routes of earlier tokens are not the ones the turn saw"
        )
    last = turn == traj.num_turns - 1
    end = len(traj.tokens) if last else int(traj.turn_starts[turn + 1])
    ids = np.asarray(traj.turn_ids)[:end]
    keep = visible_context(np.asarray(traj.roles)[:end], ids, turn)
    new_index = np.cumsum(keep) - 1  # old index -> index in the segment (where kept)
    mine = ids == turn
    roles = np.where((ids >= 0) & ~mine, Role.PROMPT, np.asarray(traj.roles)[:end])  # context
    if not last:  # what follows the turn (its separator, observation) is the next one's
        (own,) = np.nonzero(mine)
        cut = int(own[-1]) + 1 if own.size else int(traj.turn_starts[turn]) + 1
        keep[cut:] = False
    breaks, rejected = None, set(traj.info.get("rejected_turns", ()))
    if traj.turn_breaks is not None:
        breaks = [{name: int(new_index[i]) for name, i in traj.turn_breaks[turn].items()}]
    return dataclasses.replace(
        traj,
        tokens=np.asarray(traj.tokens)[:end][keep],
        roles=roles[keep].astype(np.asarray(traj.roles).dtype),
        turn_ids=np.where(mine, 0, -1)[keep].astype(np.int32),
        turn_starts=np.asarray([new_index[int(traj.turn_starts[turn])]], np.int32),
        behaviour_logprobs=np.where(mine, np.asarray(traj.behaviour_logprobs)[:end], 0.0)[
            keep
        ].astype(np.float32),
        turn_verdicts=[traj.turn_verdicts[turn]],
        turn_hint_tokens=None if traj.turn_hint_tokens is None else [traj.turn_hint_tokens[turn]],
        turn_breaks=breaks,
        info={**traj.info, "rejected_turns": [0] if turn in rejected else []},
    )


def segments(trajectories: Sequence[Trajectory]) -> tuple[list[Trajectory], list[bool]]:
    """(the segments of every trajectory, in order: turn 0, 1, ... of the first, then the
    next's; per segment, whether it is its episode's head, the first)."""
    out, heads = [], []
    for traj in trajectories:
        parts = [segment(traj, k) for k in range(traj.num_turns)] if traj.num_turns > 1 else [traj]
        out += parts
        heads += [True] + [False] * (len(parts) - 1)
    return out, heads


def rows_per_episode(config) -> int:
    """Train-batch rows per episode (static): 1, or with hidden thinking the most segments an
    episode makes, env.max_turns."""
    if not enabled(config):
        return 1
    max_turns = int(config.env.get("max_turns", 0)) if "env" in config else 0
    if max_turns < 1:
        raise ValueError(
            "rl_loop.hide_thinking needs a bounded episode (env.max_turns >= 1): the trainer "
            "takes one row per assistant turn, and its batch has static rows"
        )
    return max_turns
