"""MoE router replay (R3) in a training batch: the routing the rollouts recorded.

`Trajectory.routed_experts` holds, per token, the experts each layer routed it to when the
rollout (the lock-step sampler or the engine) fed it (-1 where it has none). `batch_routes`
lays them out as the batch's `routes_BxTxLxJ` (student rows; padding -1) and
`teacher_routes_BtxTtxLxJ`: a teacher token that copies student token j
(`tg_jax.rl.tg.compact.hinted`'s sources) replays j's routing, a hint token (never seen by
the rollout) and padding get -1, the teacher router's own choice. The student and teacher
forwards of the loss route by them (`tg_jax.models.moe.replay`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tg_jax.sampling.trajectory import Trajectory


def batch_routes(
    trajectories: Sequence[Trajectory],
    rows: int,
    length: int,
    teacher: dict[str, np.ndarray] | None,
) -> tuple[Any, Any]:
    """(student [rows, length, L, J], teacher [B_t, T_t, L, J]) replayed routing (`Batch`), or
    (None, None) when no trajectory has a routing record."""
    recorded = [t.routed_experts for t in trajectories if t.routed_experts is not None]
    if not recorded:
        return None, None
    student = np.full((rows, length, *recorded[0].shape[1:]), -1, np.int16)
    for b, traj in enumerate(trajectories):
        if traj.routed_experts is not None:
            student[b, : len(traj.tokens)] = traj.routed_experts
    if teacher is None:
        return student, None
    src, src_b = teacher["src"], teacher["src_b"]
    routes = student[src_b[:, None], np.maximum(src, 0)]
    return student, np.where((src >= 0)[:, :, None, None], routes, np.int16(-1))


__all__ = ["batch_routes"]
