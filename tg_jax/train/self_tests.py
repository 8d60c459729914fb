"""Self-tests before an RL run's first step (`rl_loop.self_tests`, on by default).

    figures = self_tests.run(parts, params, trajectories, batch)   # or SelfTestError

On the first rollout group of a fresh run, before its update is applied, under the params
that sampled it (the run's initial params, policy version 0), three checks of the numbers the
loss reads:

  student    a row's student log-probs do not depend on the batch around it: row b of the
             step's batch (its padded length T, micro-batch, row and device) against the same
             trajectory in a small batch of another composition, padded length and row (both
             made by `build_batch`).
  teacher    (TG runs) the teacher log-probs of a hinted turn's tokens from the teacher rows
             `build_batch` makes (the run's tg.teacher_mode and compact layout, the train
             step's teacher forward) against a hinted sequence made here: the trajectory's
             tokens with the renderer's hint message inserted right before the assistant
             header that opens the turn, where the chat template places a message before an
             assistant turn, run as a plain row. The probe is a copy of row b whose last turn
             is marked failed (one requirement, its hint message), so the check runs whether
             or not the group failed anywhere.
  behaviour  the behaviour log-probs the sampler or engine recorded against the trainer's
             recomputation of the same tokens in the step's batch (the train step's
             `logprob_mismatch_*` at step 1, known before the update).

Each compares the max and the mean |diff| over the produced tokens (those the loss reads; a
prompt token at a log-prob of -15 moves by a bfloat16 logit's rounding step) with the
tolerances of the model's dtype (`TOLERANCES`).

Why the first real group and no episodes of its own: no extra sampling (the decode is most of
a tiny step), the rows are the ones the run trains on, sampled by the run's own sampler or
engine under the params checked. The group then trains step 1 as usual. A resumed session runs
no self-tests (its first session did).

The log-probs come from the train step's own pieces (`student_forward`, `teacher_rows_hidden`,
`gather_teacher`, `chunked_token_stats` with the step's unembedding and temperature), jitted
once here, per micro-batch as the step splits them. A figure beyond its tolerance stops the
run before any step is trained: `SelfTestError`, one `error: self-test failed: ...` line
(exit 2) naming the check, its figures, where, and `rl_loop.self_tests=False`. Passing figures
are logged and written to metrics.jsonl at step 0, stage "selftest". Not run under the
whole-host split (`sampler_mesh.processes`), where the trainer processes alone hold the
params.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tg_jax import multihost, sharding, tracing
from tg_jax.errors import SelfTestError
from tg_jax.models import Transformer
from tg_jax.rl import hidden_thinking
from tg_jax.rl.batch import Batch, build_batch, join_rows, split_batch
from tg_jax.rl.loss import unembed_fn
from tg_jax.rl.step_config import RLConfig, TGConfig
from tg_jax.rl.tg.divergence import chunked_token_stats
from tg_jax.rl.tg.teacher import gather_teacher, student_forward, teacher_rows_hidden
from tg_jax.sampling.trajectory import Role, Trajectory
from tg_jax.text import hint_message

OFF = "rl_loop.self_tests=False"
STAGE = "selftest"  # metrics.jsonl's stage of the figures (step 0)
# The hint the teacher check shows where the probe's requirement has no hint message.
FALLBACK_HINT = "Follow the required format in this answer."
# The small batch's length multiple: a padded length other than the step's.
PROBE_MULTIPLE = 8


class Tolerance(NamedTuple):
    """The largest max and mean |diff| of log-probs (nats) a check accepts."""

    max: float
    mean: float


# Per check, by the model's lowest precision (compute or param dtype; float32 on a GPU or TPU
# counts as bfloat16: their default matmul precision rounds float32 inputs). Measured on a CPU,
# the first group of a TG run, max (mean) |diff| over the produced tokens (docs/experiments.md,
# 2026-12-07):
#                                 student           teacher           behaviour
#   configs/tiny.py, float32      4.8e-7 (1.2e-7)   4.8e-7 (1.8e-7)   9.5e-7 (2.0e-7)
#   configs/tiny.py, bfloat16     0 (0)             7.2e-4 (2.0e-4)   1.1e-3 (3.2e-4)
#   configs/tiny.py, float16      1.2e-4 (1.9e-5)   1.2e-4 (2.0e-5)   1.2e-4 (4.0e-6)
#   default base, float32         9.5e-7 (1.5e-8)   4.5e-7 (1.9e-8)   4.8e-6 (4.1e-7)
#   default base, bfloat16        3.6e-3 (1.3e-4)   0.052 (1.8e-3)    0.061 (3.0e-4)
#   default base, float16         6.2e-6 (5.8e-8)   1.9e-5 (4.8e-7)   4.2e-3 (1.5e-5)
# ("default base": configs/default.py's shipped base, tg_jax/bases/default, multi-turn.) On
# that base a padding bug, a hint one turn early or after the assistant header, or behaviour
# log-probs shifted by one token gave 9.6-16 max (0.14-0.9 mean) in float32 and bfloat16 alike.
# The float32 behaviour bar leaves room for vLLM (within 1e-3 of the trainer, docs/design.md).
TOLERANCES = {
    "float32": {
        "student": Tolerance(1e-3, 1e-4),
        "teacher": Tolerance(1e-3, 1e-4),
        "behaviour": Tolerance(1e-2, 1e-3),
    },
    "float16": {
        "student": Tolerance(0.1, 0.01),
        "teacher": Tolerance(0.1, 0.01),
        "behaviour": Tolerance(0.5, 0.02),
    },
    "bfloat16": {
        "student": Tolerance(0.5, 0.02),
        "teacher": Tolerance(1.0, 0.05),
        "behaviour": Tolerance(2.0, 0.05),
    },
}


def enabled(config: Any) -> bool:
    """`rl_loop.self_tests` (True where the field predates it)."""
    return bool(config.rl_loop.get("self_tests", True))


def tolerance(model_cfg: Any, backend: str | None = None) -> tuple[str, dict[str, Tolerance]]:
    """(what they are for, e.g. "bfloat16", the `TOLERANCES` row) of a model on `backend`
    (default: JAX's)."""
    dtypes = {str(model_cfg.dtype), str(model_cfg.param_dtype)}
    name = next(n for n in ("bfloat16", "float16", "float32") if n in dtypes or n == "float32")
    backend = backend or jax.default_backend()
    if name == "float32" and backend != "cpu":
        return f"float32 on {backend}, as bfloat16", TOLERANCES["bfloat16"]
    return name, TOLERANCES[name]


@dataclasses.dataclass
class _Setup:
    """What the checks read of a run (`rl_setup.Parts`)."""

    parts: Any
    rl: RLConfig
    tg: TGConfig
    fn: Any  # the jitted (params, teacher params, batch, teacher) -> log-probs

    @classmethod
    def of(cls, parts: Any) -> _Setup:
        config = parts.config
        rl_cfg, tg_cfg = RLConfig.from_config(config.rl), TGConfig.from_config(config.tg)
        rules = sharding.logical_rules(config.mesh)
        return cls(parts, rl_cfg, tg_cfg, _logprob_fn(parts.model_cfg, rules, rl_cfg, tg_cfg))


@functools.lru_cache(maxsize=8)  # one per model and step settings: a process's later runs
def _logprob_fn(model_cfg: Any, rules: Any, rl_cfg: RLConfig, tg_cfg: TGConfig) -> Any:
    """(params, teacher_params, batch, teacher) -> (student [B, T], teacher [B, T] log-probs
    of the targets; zeros without `teacher`): the train step's forwards and unembedding."""
    model = Transformer(model_cfg)

    def logprobs(p: Any, hidden_BxTxD: jax.Array, batch: Batch) -> jax.Array:
        unembed = unembed_fn(model, p, rl_cfg.temperature)
        stats = chunked_token_stats(
            hidden_BxTxD, batch.targets_BxT, unembed, chunk_size=tg_cfg.chunk_size
        )
        return stats.logprob_BxT

    def self_test_logprobs(params: Any, teacher_params: Any, batch: Batch, teacher: bool) -> Any:
        with nn.logical_axis_rules(rules):
            keep = teacher and batch.teacher_compact
            hidden, prefix, _ = student_forward(model, params, batch, keep_prefix=keep)
            student = logprobs(params, hidden, batch)
            if not teacher:
                return student, jnp.zeros_like(student)
            rows = teacher_rows_hidden(model, teacher_params, batch, prefix)
            return student, logprobs(teacher_params, gather_teacher(rows, batch), batch)

    return tracing.jit(self_test_logprobs, static_argnames="teacher")


def _host(x: jax.Array) -> np.ndarray:
    """The whole array on the host (every process's rows with several)."""
    if jax.process_count() == 1:
        return np.asarray(x)
    from jax.experimental import multihost_utils  # noqa: PLC0415 (multi-process only)

    with tracing.TRACE_LOCK:  # a collective: one multi-device computation at a time
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _batch_logprobs(
    setup: _Setup, params: Any, teacher_params: Any, batch: Batch, num: int, teacher: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Host (student, teacher) log-probs [B, T] of a batch of `num` micro-batches, computed per
    micro-batch as the train step splits it (teacher rows are local to their micro-batch)."""
    placement = setup.parts.batch_sharding
    outs = []
    with jax.set_mesh(placement.mesh):
        for micro in split_batch(batch, num):
            placed = multihost.host_to_global(micro, placement)
            outs.append([_host(x) for x in setup.fn(params, teacher_params, placed, teacher)])
    return tuple(join_rows([o[k] for o in outs]) for k in (0, 1))


def _rows(parts: Any, trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """The step batch's rows, in order (`rl._build_batch`: segments with hidden thinking)."""
    if hidden_thinking.enabled(parts.config):
        return hidden_thinking.segments(trajectories)[0]
    return list(trajectories)


def _probe_row(rows: Sequence[Trajectory]) -> int:
    """The row the student and teacher checks take: the most assistant turns with produced
    tokens (where a hint's place matters most), the last of those (not row 0)."""

    def turns(traj: Trajectory) -> int:
        ids = np.asarray(traj.turn_ids)
        return sum(bool(np.any(_produced(traj) & (ids == k))) for k in range(traj.num_turns))

    counts = [turns(t) for t in rows]
    return max(range(len(rows)), key=lambda b: (counts[b], b))


def _produced(traj: Trajectory) -> np.ndarray:
    roles = np.asarray(traj.roles)
    return (roles == Role.ANSWER) | (roles == Role.THINK)


def _hinted_turn(traj: Trajectory) -> int | None:
    """The last assistant turn with produced tokens (None: none has any)."""
    ids = np.asarray(traj.turn_ids)
    done = [k for k in range(traj.num_turns) if np.any(_produced(traj) & (ids == k))]
    return done[-1] if done else None


def _header_start(parts: Any, traj: Trajectory, k: int) -> int:
    """Where the renderer's assistant header that opens turn k begins: a message before the
    turn (a hint) goes there, as the chat template places it. Read from the tokens (the header
    right before the turn's first produced token), not from `turn_starts`, which the batch
    builder reads; `turn_starts[k]` where no header is there (e.g. synthetic rows)."""
    header = np.asarray(parts.renderer.assistant_header(), np.int64)
    first = int(np.flatnonzero(_produced(traj) & (np.asarray(traj.turn_ids) == k))[0])
    at = first - len(header)
    if at >= 0 and np.array_equal(np.asarray(traj.tokens[at:first]), header):
        return at
    return int(traj.turn_starts[k])


class _Probe(NamedTuple):
    """The teacher check's rows: the probe (row b with turn k marked failed on `name`) and the
    hinted sequence made here."""

    probe: Trajectory
    reference: Trajectory
    turn: int
    splice: int  # where the hint goes in the reference
    hint_len: int


def _teacher_probe(parts: Any, traj: Trajectory) -> _Probe | None:
    k = _hinted_turn(traj)
    if k is None or not parts.requirement_names:
        return None
    name = parts.requirement_names[0]
    hint = [int(x) for x in traj.hint_tokens.get(name, ())]
    if not hint:
        hint = parts.renderer.render_message(hint_message(FALLBACK_HINT))
    verdicts = [{} for _ in range(traj.num_turns)]
    verdicts[k] = {name: False}
    probe = dataclasses.replace(
        traj,
        turn_verdicts=verdicts,
        hint_tokens={name: hint},
        turn_hint_tokens=None,
        turn_breaks=None,
        info={**traj.info, "rejected_turns": []},
    )
    at = _header_start(parts, traj, k)
    tokens = np.asarray(traj.tokens, np.int32)
    ref_tokens = np.concatenate([tokens[:at], np.asarray(hint, np.int32), tokens[at:]])
    n = len(ref_tokens)
    if n > parts.teacher_max:  # a hint longer than the run's reserve for hints
        return None
    routes = traj.routed_experts
    if routes is not None:  # the hint's tokens never met the rollout's router
        pad = np.full((len(hint), *routes.shape[1:]), -1, routes.dtype)
        routes = np.concatenate([routes[:at], pad, routes[at:]])
    reference = Trajectory(
        tokens=ref_tokens,
        roles=np.full((n,), int(Role.PROMPT), np.int8),
        turn_ids=np.full((n,), -1, np.int32),
        turn_starts=np.zeros((0,), np.int32),
        behaviour_logprobs=np.zeros((n,), np.float32),
        turn_verdicts=[],
        rewards=dict(traj.rewards),
        hint_tokens={},
        group_id=traj.group_id,
        policy_version=traj.policy_version,
        task_id=f"{traj.task_id} (self-test reference)",
        routed_experts=routes,
    )
    return _Probe(probe, reference, k, at, len(hint))


def _small_batch(parts: Any, setup: _Setup, rows: Sequence[Trajectory], teacher: bool) -> Batch:
    """`rows` in a batch of their own: another length bucket (`PROBE_MULTIPLE`), one
    micro-batch; with `teacher`, the run's teacher mode and layout, every produced token of a
    targeted turn in M."""
    tg_cfg = setup.tg
    return build_batch(
        rows,
        max_len=parts.teacher_max,  # the reference row holds a hint
        teacher_max_len=parts.teacher_max,
        mode=tg_cfg.teacher_mode if teacher else "none",
        gate="failed_turns",
        include_thinking=True,
        max_teacher_rows=parts.divisor,
        requirement_names=parts.requirement_names,
        pad_to_multiple=PROBE_MULTIPLE,
        batch_multiple=parts.divisor,
        micro_batches=1,
        compact=tg_cfg.compact_rows,
    )


def _judge(
    check: str,
    diff: np.ndarray,
    tol: tuple[str, dict[str, Tolerance]],
    where: Any,
    why: str,
    need_tokens: bool = False,
) -> dict[str, float]:
    """The figures of `check` (|diff| over its tokens), or `SelfTestError` beyond its
    tolerance (NaN too; no token at all with `need_tokens`); where(i) says where token i is."""
    limit = tol[1][check]
    worst = float(diff.max()) if diff.size else 0.0
    mean = float(diff.mean()) if diff.size else 0.0
    if not ((diff.size or not need_tokens) and worst <= limit.max and mean <= limit.mean):
        at = where(int(np.argmax(diff))) if diff.size else "no token to compare"
        raise SelfTestError(
            f"{check} log-probs: max |diff| {worst:.3g} (tolerance {limit.max:g}), mean "
            f"{mean:.3g} (tolerance {limit.mean:g}) over {diff.size} tokens, {tol[0]}, "
            f"{at}; {why}. Turn the self-tests off with {OFF}"
        )
    key = f"selftest/{check}_lp"
    return {
        f"{key}_max_diff": worst,
        f"{key}_mean_diff": mean,
        f"{key}_max_tol": limit.max,
        f"{key}_mean_tol": limit.mean,
        f"{key}_tokens": float(diff.size),
    }


def _check_student(
    real: np.ndarray, small: np.ndarray, batch: Batch, b: int, traj: Trajectory, t_small: int, tol
) -> dict[str, float]:
    """Row b of the step's batch against row 0 of the small batch, on the produced tokens."""
    (ts,) = np.nonzero(np.asarray(batch.loss_mask_BxT[b], bool))
    return _judge(
        "student",
        np.abs(real[b, ts] - small[0, ts]),
        tol,
        lambda i: (
            f"between row {b} of the step's batch (T={batch.tokens_BxT.shape[1]}) and the same "
            f"trajectory in a batch of its own (row 0, T={t_small}), at target {ts[i]} of task "
            f"{traj.task_id}"
        ),
        "the trainer's log-probs of a row depend on the batch around it (padding, length "
        "bucket, row or replica)",
    )


def _check_teacher(
    teacher: np.ndarray, small: np.ndarray, mask: np.ndarray, probe: _Probe, tol
) -> dict[str, float]:
    """The probe's teacher log-probs on M against the reference row's at the same tokens."""
    (ts,) = np.nonzero(mask[0])  # student target t + 1 sits at t + 1 + hint_len in the reference
    return _judge(
        "teacher",
        np.abs(teacher[0, ts] - small[1, ts + probe.hint_len]),
        tol,
        lambda i: (
            f"between the batch's teacher rows and the hinted sequence rendered here (the hint "
            f"message before turn {probe.turn}'s assistant header at token {probe.splice}), at "
            f"target {ts[i]} of task {probe.probe.task_id}"
        ),
        "the teacher does not see the hint where the chat template places it",
        need_tokens=True,  # the probe's turn has produced tokens: M must hold them
    )


def _check_behaviour(
    real: np.ndarray, batch: Batch, rows: Sequence[Trajectory], tol
) -> dict[str, float]:
    """The recorded behaviour log-probs against the trainer's, on the produced tokens."""
    bs, ts = np.nonzero(np.asarray(batch.loss_mask_BxT, bool))
    return _judge(
        "behaviour",
        np.abs(np.asarray(batch.behaviour_logprobs_BxT)[bs, ts] - real[bs, ts]),
        tol,
        lambda i: (
            f"between the sampler's record and the trainer's recomputation, worst at target "
            f"{ts[i]} of row {bs[i]} (task {rows[bs[i]].task_id})"
        ),
        "the trainer does not score the tokens the sampler drew as the sampler did",
    )


def run(
    parts: Any,
    params: Any,
    trajectories: Sequence[Trajectory],
    batch: Batch,
    teacher_params: Any = None,
) -> dict[str, float]:
    """The three checks on the step's `batch` (`rl._build_batch` of `trajectories`) under
    `params` (teacher: `teacher_params`, default the same); returns their figures (metric
    names "selftest/..."), or raises `SelfTestError` at the first beyond its tolerance."""
    start = time.perf_counter()
    setup = _Setup.of(parts)
    tol = tolerance(parts.model_cfg)
    # The hinted reference row runs as a student row under `params`: at a fresh start the
    # frozen reference teacher's params (tg.teacher_params "reference") are the same values.
    teacher_params = params if teacher_params is None else teacher_params
    rows = _rows(parts, trajectories)
    real, _ = _batch_logprobs(setup, params, params, batch, setup.rl.num_chunks, False)
    b = _probe_row(rows)
    tg_on = setup.tg.enabled
    probe = _teacher_probe(parts, rows[b]) if tg_on else None
    small_rows = [probe.probe, probe.reference] if probe else [rows[b]]
    small = _small_batch(parts, setup, small_rows, probe is not None)
    student, teacher = _batch_logprobs(setup, params, teacher_params, small, 1, bool(probe))
    t_small = small.tokens_BxT.shape[1]
    figures = _check_student(real, student, batch, b, rows[b], t_small, tol)
    if probe is not None:
        figures.update(_check_teacher(teacher, student, small.tg_mask_BxT, probe, tol))
    elif tg_on:
        logging.warning("self-tests: row %d has no hintable turn: the teacher check skipped", b)
    figures.update(_check_behaviour(real, batch, rows, tol))
    figures["time/selftest_s"] = time.perf_counter() - start
    logging.info(
        "self-tests passed (%s): %s",
        tol[0],
        ", ".join(f"{k.split('/', 1)[1]}={v:.3g}" for k, v in figures.items()),
    )
    return figures


__all__ = ["OFF", "STAGE", "TOLERANCES", "Tolerance", "enabled", "run", "tolerance"]
