"""Fixtures shared by the tests and the benchmarks (synthetic data of known shape)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tg_jax.sampling.trajectory import Role, Trajectory


def synthetic_trajectories(
    rng: np.random.Generator,
    num: int,
    length: int,
    *,
    vocab_size: int = 272,
    num_turns: int = 2,
    group_size: int = 4,
    hint_len: int = 12,
    fail_prob: float = 0.5,
    requirements: Sequence[str] = ("fence",),
) -> list[Trajectory]:
    """Random multi-turn trajectories of exactly `length` tokens (prompt, turns, observations).

    Each assistant turn: a 2-token header (PROMPT), thinking (THINK), answer (ANSWER); an
    environment observation (ENV) follows every turn but the last. Each requirement fails on
    a turn with probability `fail_prob`; rewards are a random task reward in {0, 1} and, per
    requirement, the fraction of turns that met it.
    """
    prompt = length // 4
    per_turn = (length - prompt) // num_turns
    env = per_turn // 4
    header = 2
    think = (per_turn - header - env) // 3
    trajectories = []
    for i in range(num):
        segments = [(Role.PROMPT, prompt, -1)]  # (role, length, turn)
        starts = []
        for k in range(num_turns):
            starts.append(sum(n for _, n, _ in segments))
            last = k == num_turns - 1
            # The last turn's answer takes whatever is left, so every row has `length` tokens.
            end = length if last else starts[-1] + per_turn - env
            answer = end - starts[-1] - header - think
            segments += [(Role.PROMPT, header, -1), (Role.THINK, think, k)]
            segments.append((Role.ANSWER, answer, k))
            if not last:
                segments.append((Role.ENV, env, -1))
        tokens = rng.integers(0, vocab_size, length)
        roles = np.concatenate([np.full(n, r, np.int8) for r, n, _ in segments])
        turns = np.concatenate([np.full(n, t, np.int32) for _, n, t in segments])
        produced = (roles == Role.THINK) | (roles == Role.ANSWER)
        logprobs = np.where(produced, -rng.exponential(2.0, length), 0.0)
        verdicts = [
            {r: bool(rng.random() >= fail_prob) for r in requirements} for _ in range(num_turns)
        ]
        rewards = {"task": float(rng.integers(0, 2))}
        for r in requirements:
            rewards[r] = float(np.mean([v[r] for v in verdicts]))
        trajectories.append(
            Trajectory(
                tokens=tokens.astype(np.int32),
                roles=roles,
                turn_ids=turns,
                turn_starts=np.asarray(starts, np.int32),
                behaviour_logprobs=logprobs.astype(np.float32),
                turn_verdicts=verdicts,
                rewards=rewards,
                hint_tokens={
                    r: rng.integers(0, vocab_size, hint_len).tolist() for r in requirements
                },
                group_id=i // group_size,
                policy_version=0,
                task_id=f"synthetic-{i // group_size}",
            )
        )
    return trajectories
