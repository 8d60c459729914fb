"""An RL run's costs and sessions: what it spent (tokens, teacher FLOPs, wall time, peak
memory, dropped groups), carried over preemptions session by session, the step's host-side
metrics, and `rl_summary.json` (tg_jax.train.rl writes them).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from tg_jax import paths
from tg_jax.metrics import RL_SUMMARY_FILE as SUMMARY_FILE
from tg_jax.rl.batch import Batch
from tg_jax.train import memory, rl_rollouts
from tg_jax.train.memory import PeakMemory


@dataclasses.dataclass
class Costs:
    wall_time_s: float = 0.0
    sampled_tokens: int = 0
    teacher_tokens: int = 0
    teacher_forward_flops: float = 0.0
    distilled_tokens: int = 0
    peak_memory_bytes: int = 0
    peak_memory_above_start_bytes: int = 0  # peak - bytes in use when the session started
    peak_memory_source: str = ""
    dropped_groups: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Session:
    """This session of a run: where it started, and the costs it carries on from."""

    start_step: int
    costs: Costs
    wall0: float  # wall time of the earlier sessions
    dropped0: int  # groups the earlier sessions dropped
    started: float = 0.0  # time.time() when its first step began
    peak0: tuple[int, int] = (0, 0)  # (peak, peak above start) of the earlier sessions
    memory: PeakMemory | None = None  # this session's, from its first step

    def stamp(self) -> dict[str, Any]:
        """Costs so far, with the wall time and peak memory of now."""
        self.costs.wall_time_s = self.wall0 + time.time() - self.started
        peak, source = self.memory.peak() if self.memory is not None else memory.peak_memory_bytes()
        above = peak - self.memory.baseline if self.memory is not None else 0
        self.costs.peak_memory_bytes, self.costs.peak_memory_source = (
            max(peak, self.peak0[0]),
            source,
        )
        self.costs.peak_memory_above_start_bytes = max(above, self.peak0[1])
        return self.costs.as_dict()


def host_metrics(
    group: Any, costs: Costs, batch: Batch, times: Sequence[float]
) -> dict[str, float]:
    """The step's host-side metrics; `times` = perf_counter at ask, got group, built batch,
    trained."""
    t0, t1, t2, t3 = times
    host = rl_rollouts.rollout_metrics(group.trajectories)
    host.update(
        {
            "staleness": float(group.staleness),
            "policy_version": float(group.policy_version),
            "batch_index": float(group.batch_index),
            "cost/sampled_tokens": float(costs.sampled_tokens),
            "cost/teacher_forward_flops": float(costs.teacher_forward_flops),
            "cost/distilled_tokens": float(costs.distilled_tokens),
            "cost/dropped_groups": float(costs.dropped_groups),
            "time/sample_wait_s": t1 - t0,
            "time/rollout_s": group.seconds,
            "time/build_batch_s": t2 - t1,
            "time/train_s": t3 - t2,
            "time/step_s": time.perf_counter() - t0,
            "sys/batch_T": float(batch.tokens_BxT.shape[1]),
        }
    )
    return host


def write_summary(workdir: str, record: dict[str, Any]) -> None:
    path = paths.as_path(workdir) / SUMMARY_FILE
    sessions = []
    if path.exists():
        sessions = paths.read_json(path).get("sessions", [])
    sessions.append(record["session"])
    out = {**{k: v for k, v in record.items() if k != "session"}, "sessions": sessions}
    paths.write_json_atomic(path, out, indent=1)
