"""The RL loop: rollouts -> batches -> train steps -> new weights, checkpointed and logged.

    run_rl(config, workdir, init_params, arm_name="tg", seed=0)

What a run is made of (model, meshes, initial state, jitted step, sampler, train tasks and the
sampling loop) is built once by tg_jax.train.rl_setup; this module resumes the run, steps it,
evaluates, checkpoints, exports and writes its summary.

One step:
  1. a rollout group: `rollouts_per_group` rollouts of each of `groups_per_step` train tasks,
     sampled by the newest published policy (the sampling thread, or inline in the
     deterministic mode; see tg_jax.train.rl_rollouts); groups older than
     `config.rl.max_staleness` policy versions are refused by the sampling loop;
  2. `build_batch`: student rows, and for the TG arm (`config.tg.enabled`) the hinted teacher
     rows, laid out in `rl.num_minibatches` x `rl.micro_batches` chunks; the hint texts come
     from the imperfect-feedback picker (`rl_loop.feedback` rates);
  3. the jitted, state-donating `train_step` (GRPO, or GRPO + TG): one optimizer update, or
     `rl.num_updates` epochs x `rl.num_minibatches` PPO updates (tg_jax.rl.updates);
  4. the new params are published to the sampler as policy version step + 1;
  5. metrics to metrics.jsonl / TensorBoard, fetched one step late; held-out evaluation every
     `eval_every` steps (stage "eval"); a checkpoint every `checkpoint_every` steps, on the
     last step and on SIGTERM (then the loop exits cleanly).

Checkpoint = TrainState (params, optimizer state, step, RNG) + JSON metadata: task-iterator
state (the next task batch the TRAINER has not consumed: batches the sampling thread drew
ahead are re-sampled after a resume), policy version, accumulated costs, arm and seed.
Resuming from the latest checkpoint is automatic. In the deterministic mode
(`rl_loop.async_sampling=False`) a killed and resumed run reproduces the uninterrupted one
exactly (tests/test_rl_loop.py); with the sampling thread it cannot, since which policy
version samples which batch depends on timing.

A sampler on devices of its own (`config.sampler_mesh.num_devices` > 0, one process): the
trainer's mesh covers the other devices, and each published policy is resharded onto the
sampler's mesh, device to device (tg_jax.sampling.placement).

Several processes (`jax.distributed`, docs/design.md section 5): each rolls out its share of a
step's groups on its own devices (tg_jax.train.rl_rollouts), all build the same batch from the
gathered trajectories and place their own rows of it; process 0 writes metrics.jsonl,
rl_summary.json and exports, every process saves its shards of the checkpoints. Under the
whole-host split (`sampler_mesh.processes`) the last processes only sample and the others
only train (tg_jax.train.rl_hosts).

Costs per run (rl_summary.json and the metrics under `cost/`, `sys/`): wall time (summed over
sessions; time after the last checkpoint of a killed session is lost), sampled tokens,
teacher forward FLOPs = ModelConfig.flops_per_token(T_t) x real (non-padding) teacher tokens,
distilled tokens (the student tokens under the TG KL mask: the budget the thinking-token
control pair is compared at), and the run's own peak memory (`tg_jax.train.memory.PeakMemory`:
device memory where the backend reports it, else host RSS, measured from the session's first
step, the max over sessions; not the process's lifetime peak, which grows across arms).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from tg_jax import checkpointing, faults, multihost, paths
from tg_jax.data.pipeline import TaskIterator
from tg_jax.errors import RunError
from tg_jax.evaluation import heldout
from tg_jax.metrics import RL_SUMMARY_FILE, LaggedMetrics, MetricsWriter
from tg_jax.progress import ProgressBar
from tg_jax.rl import hidden_thinking
from tg_jax.rl.batch import Batch, build_batch
from tg_jax.rl.loss import reference_teacher_params
from tg_jax.rl.step_config import RLConfig, TGConfig
from tg_jax.rl.tg import break_span, distill_budget, hint_copies
from tg_jax.rl.train_state import TrainState
from tg_jax.text import ByteTokenizer, ChatRenderer
from tg_jax.train import memory, rl_hosts, rl_rollouts, rl_setup, rollout_dump, self_tests
from tg_jax.train.profile import StepProfile
from tg_jax.train.rl_costs import Session, host_metrics, write_summary
from tg_jax.train.rl_setup import Parts

CHECKPOINT_DIR = "checkpoints"
SUMMARY_FILE = RL_SUMMARY_FILE
PROGRESS_KEYS = ("rollout/compliance", "rollout/task_success", "loss", "time/step_s")


@dataclasses.dataclass
class RLResult:
    """What `run_rl` returns.

    Attributes:
      state: the TrainState after the last step run (params: `state.params`).
      step: completed train steps.
      finished: step == rl_loop.steps.
      costs: accumulated costs (see the module docstring).
      workdir: the run directory.
    """

    state: TrainState
    step: int
    finished: bool
    costs: dict[str, float]
    workdir: str


def _evaluate(parts: Parts, params: Any, eval_tasks: Sequence[Any]) -> dict[str, float]:
    """Held-out evaluation metrics (stage "eval") of `params` (every sampling process plays them
    all; under the whole-host split the first one's figures reach the others)."""
    if parts.to_sampler is not None:
        params = parts.to_sampler(params)
    figures = None
    if parts.roles.samples:  # the rollout sampler (jit is thread-safe): its buckets reused
        recs = heldout.evaluate_heldout(
            parts.config,
            params,
            eval_tasks,
            conditions=("plain",),
            samples_per_task=1,
            max_new_tokens=int(parts.config.rl_loop.max_new_tokens),
            sampler=parts.sampler,
            renderer=parts.renderer,
        )
        figures = heldout.heldout_metrics(recs)
    return rl_hosts.from_samplers(parts.roles, figures)


def _build_batch(parts: Parts, trajectories: Sequence[Any], step: int) -> Batch:
    """Step `step`'s batch; with `tg.span` "to_break" a targeted turn's targets after the token
    that breaks its requirement are left out of the TG KL (tg_jax.rl.tg.break_span), with
    `tg.mask_hint_copies` the hint-copying targets are left out of
    the TG KL (tg_jax.rl.tg.hint_copies), and with `tg.distill_budget` "answer_tokens" the
    thinking arm's TG mask is cut to its answer tokens' count (tg_jax.rl.tg.distill_budget)."""
    config = parts.config
    tg_on = bool(config.tg.enabled)
    heads, min_rows = None, 0
    if hidden_thinking.enabled(config):  # one row per turn, in the context the turn saw
        min_rows = len(trajectories) * hidden_thinking.rows_per_episode(config)
        trajectories, heads = hidden_thinking.segments(trajectories)
    batch = build_batch(
        trajectories,
        max_len=parts.student_max,
        teacher_max_len=parts.teacher_max,
        heads=heads,
        min_rows=min_rows,
        mode=str(config.tg.teacher_mode) if tg_on else "none",
        gate=str(config.tg.gate),
        include_thinking=bool(config.tg.include_thinking),
        max_teacher_rows=int(config.tg.max_teacher_rows),
        requirement_names=parts.requirement_names,
        pad_to_multiple=int(config.rl_loop.length_multiple),
        batch_multiple=parts.divisor,
        micro_batches=RLConfig.from_config(config.rl).num_chunks,  # the train step's chunks
        compact=TGConfig.from_config(config.tg).compact_rows,  # full rows: reference teacher
    )
    if tg_on and str(config.tg.span) == "to_break":
        batch, _ = break_span.cut_after_breaks(batch, trajectories, str(config.tg.gate))
    if tg_on and bool(config.tg.mask_hint_copies):
        batch, _ = hint_copies.mask_hint_copies(batch, trajectories, str(config.tg.gate))
    if tg_on and str(config.tg.distill_budget) == "answer_tokens":
        batch, _ = distill_budget.apply_budget(batch, int(config.seed), step)
    return batch


def distilled_tokens(tg: Any, batch: Batch) -> int:
    """Student tokens under the TG KL: M (`Batch.tg_mask_BxT`, host arrays) where tg.method
    distils (`TGConfig.distils`)."""
    return int(np.sum(batch.tg_mask_BxT)) if TGConfig.from_config(tg).distils else 0


def _add_costs(parts: Parts, session: Session, group: Any, batch: Batch, dropped: float) -> None:
    costs = session.costs
    costs.sampled_tokens += rl_rollouts.sampled_tokens(group.trajectories)
    if bool(parts.config.tg.enabled):
        real = int(np.sum(np.asarray(batch.teacher_segment_ids_BtxTt) > 0))
        t_len = int(batch.teacher_tokens_BtxTt.shape[1])
        costs.teacher_tokens += real
        costs.teacher_forward_flops += parts.model_cfg.flops_per_token(t_len) * real
        costs.distilled_tokens += distilled_tokens(parts.config.tg, batch)
    costs.dropped_groups = session.dropped0 + int(dropped)


def _summarize(parts: Parts, session: Session, done: int) -> None:
    """Appends this session to rl_summary.json (run costs so far and the session's span);
    process 0 writes it."""
    if not multihost.is_primary():
        return
    finished = done >= int(parts.config.rl_loop.steps)
    write_summary(
        parts.workdir,
        {
            "arm": parts.arm_name,
            "seed": parts.seed,
            "step": done,
            "finished": finished,
            "costs": session.costs.as_dict(),
            "tg_enabled": bool(parts.config.tg.enabled),
            "session": {
                "start_step": session.start_step,
                "end_step": done,
                "seconds": time.time() - session.started,
            },
        },
    )


def run_rl(
    config: Any,
    workdir: str,
    init_params: Any,
    *,
    arm_name: str,
    seed: int,
    sources: Mapping[str, Sequence[Any]] | None = None,
    eval_tasks: Sequence[Any] | None = None,
    renderer: ChatRenderer | None = None,
    stop_after: int | None = None,
    exporter: Callable[[Any, str], None] | None = None,
) -> RLResult:
    """Trains one arm with one seed from `init_params` (or resumes it); see the module docstring.

    Args:
      config: full config: model, mesh, env, rl, tg (tg.enabled False = the GRPO arm), optim,
        rl_loop (`tg_jax.config_lib.loop_config`), eval (`eval_config`: sampling of the
        periodic evaluation).
      workdir: this run's own directory (one per arm and seed): checkpoints/, metrics.jsonl,
        tb/, rl_summary.json.
      init_params: the starting policy (e.g. the SFT params); when resuming, only the frozen
        reference (rl.kl_coef > 0, tg.teacher_params "reference") is made from it.
      arm_name: label recorded in checkpoints and summaries ("grpo", "tg", ...).
      seed: training seed (state RNG, sampling keys, feedback picks, task order).
      sources: {"train": ..., "heldout": ...} task sources (`task_data.prepare_tasks`);
        default: prepared in `workdir`.
      eval_tasks: tasks of the periodic evaluation; default: `rl_loop.eval_tasks` dev tasks
        (`task_data.dev_tasks`, seed `rl_loop.eval_task_seed`), never held-out ones.
      renderer: chat renderer (default: the byte tokenizer's).
      stop_after: stop with a checkpoint once this many steps are done (tests; as if preempted).
      exporter: `exporter(params, out_dir)` writes params as a checkpoint directory; called
        every `rl_loop.export_every` steps with out_dir = workdir/export/step_<N> (0 = never).

    Returns:
      RLResult. A run already at `rl_loop.steps` returns its restored state at once.
    """
    lc = config.rl_loop
    num_steps = int(lc.steps)
    end = num_steps if stop_after is None else min(num_steps, int(stop_after))
    renderer = renderer or ChatRenderer(ByteTokenizer())
    parts = rl_setup.build_parts(config, workdir, init_params, arm_name, seed, renderer)
    # Minibatches of static shape: fail before the first rollout, not at the first step.
    rows = int(lc.groups_per_step) * int(lc.rollouts_per_group)
    rows *= hidden_thinking.rows_per_episode(config)  # one row per turn with hidden thinking
    rl_cfg = RLConfig.from_config(config.rl)
    rl_cfg.check_rows(rows, parts.divisor)
    if rl_cfg.requirement_credit == "turn":  # the requirement rewards to credit per turn
        rl_cfg.credit_split(parts.requirement_names)
    paths.as_path(workdir).mkdir(parents=True, exist_ok=True)
    directory = os.path.join(workdir, CHECKPOINT_DIR)
    ckpt = rl_hosts.checkpointer(
        parts.roles, directory, int(lc.keep_checkpoints), int(lc.checkpoint_every)
    )
    try:
        state, session, data_state = rl_hosts.resume(parts.roles, ckpt, parts.state, arm_name, seed)
        start = session.start_step
        if start >= end:
            result = RLResult(state, start, start >= num_steps, session.costs.as_dict(), workdir)
        else:
            if threading.current_thread() is threading.main_thread():
                checkpointing.install_sigterm_handler()
            tasks, eval_tasks = rl_setup.train_tasks(
                config, workdir, seed, sources, eval_tasks, data_state
            )
            result = _train(parts, ckpt, tasks, eval_tasks, state, session, end, exporter)
    finally:
        ckpt.close()
    if parts.roles.whole:  # the state on every device, for what follows the RL stage
        result.state = rl_hosts.full_state(config, directory, result.state)
    return result


def _train(
    parts: Parts,
    ckpt: checkpointing.TrainingCheckpointer | rl_hosts.Follower,
    tasks: TaskIterator,
    eval_tasks: Sequence[Any] | None,
    state: TrainState,
    session: Session,
    end: int,
    exporter: Callable[[Any, str], None] | None = None,
) -> RLResult:
    """This session's steps, session.start_step -> `end` (or a preemption), then its summary."""
    lc = parts.config.rl_loop
    num_steps, eval_every, start = int(lc.steps), int(lc.eval_every), session.start_step
    export_every = int(lc.export_every) if exporter is not None else 0
    data_state = tasks.get_state()
    source = rl_setup.rollout_source(parts, tasks, data_state["next_index"])
    try:
        source.publish(state.params, start)
        done, session.started = start, time.time()  # the setup above is not counted
        first = _first_group(parts, source, state, start)  # self-tested: nothing written yet
        writer = _metrics_writer(parts, first)
        lagged = LaggedMetrics(writer, stage="train")
        bar = ProgressBar(
            num_steps,
            initial=start,
            keys=PROGRESS_KEYS,
            desc=f"rl {parts.arm_name}/{parts.seed}",
            log_every=int(lc.log_every),
            enabled=multihost.is_primary(),
        )

        def _eval(step: int) -> None:
            writer.write(step, _evaluate(parts, state.params, eval_tasks), stage="eval")

        def _process_metrics(done: int, metrics: dict[str, Any]) -> None:
            logged = lagged.push(done, metrics)  # fetched one step late
            bar.update(done, logged[1] if logged else None)

        def _checkpoint(done: int) -> None:
            lagged.flush()  # every step <= a checkpoint is in metrics.jsonl
            meta = {
                "arm": parts.arm_name,
                "seed": parts.seed,
                "data": data_state,
                "policy_version": done,
                "costs": session.stamp(),
            }
            ckpt.save(done, state, metadata=meta, force=True)

        session.memory = memory.PeakMemory()
        guard = _NonFinite(RLConfig.from_config(parts.config.rl), ckpt)
        identity = paths.dir_identity(parts.workdir)
        with writer, bar, session.memory, StepProfile(lc, parts.workdir) as profile:
            if start == 0 and eval_every > 0:
                _eval(0)
            for step in range(start, end):
                done = step + 1
                _check_workdir(parts.workdir, identity, done)
                with profile.step(done):
                    state, group, metrics = _train_step(parts, session, source, state, done, first)
                first = None
                guard.update(done, metrics)
                data_state = {**data_state, "next_index": group.batch_index + 1}
                _process_metrics(done, metrics)
                if eval_every > 0 and (done % eval_every == 0 or done == num_steps):
                    _eval(done)
                preempted = checkpointing.preemption_requested(done) or done == end
                if preempted or ckpt.should_save(done):
                    _checkpoint(done)
                if export_every > 0 and done % export_every == 0:
                    _export(parts, exporter, state.params, done)
                if preempted:
                    break
            lagged.flush()
        session.stamp()
        ckpt.wait_until_finished()
        _summarize(parts, session, done)
        return RLResult(state, done, done >= num_steps, session.costs.as_dict(), parts.workdir)
    finally:
        source.close()


def _check_workdir(workdir: str, identity: tuple[int, int] | None, step: int) -> None:
    """A local workdir removed during the run (or removed and made again by a writer) is one
    clear error: nothing is left to resume from."""
    if paths.dir_removed(workdir, identity):
        raise RunError(
            f"the workdir {workdir} was removed during the run (before step {step}); its "
            f"checkpoints went with it, so a rerun starts this arm from scratch"
        )


class _NonFinite:
    """The host policy of `rl.nonfinite`: the train step already kept the params of a step
    whose loss or gradient was not finite (`update_skipped`); this counts such steps, warns,
    and ends the run at the first one (stop) or after `rl.nonfinite_limit` in a row (skip)."""

    def __init__(self, rl: RLConfig, ckpt: Any):
        self.rl, self.ckpt = rl, ckpt
        self.in_a_row = self.total = 0

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        # The step's metrics are ready (`_train_step` waited for them): no extra sync.
        if float(metrics["update_skipped"]) <= 0:
            self.in_a_row = 0
            return
        self.in_a_row, self.total = self.in_a_row + 1, self.total + 1
        logging.warning(
            "rl step %d: non-finite loss or gradient, update skipped (params kept; %d in a "
            "row, %d this session)",
            step,
            self.in_a_row,
            self.total,
        )
        if self.rl.nonfinite == "stop" or self.in_a_row >= self.rl.nonfinite_limit:
            why = (
                "rl.nonfinite=stop"
                if self.rl.nonfinite == "stop"
                else (f"{self.in_a_row} in a row, rl.nonfinite_limit={self.rl.nonfinite_limit}")
            )
            raise RunError(
                f"rl step {step}: non-finite loss or gradient ({why}); no update was applied, "
                f"the params and checkpoints hold no NaN or inf. Latest checkpoint: step "
                f"{self.ckpt.latest_step()} (a rerun resumes there). Lower optim.lr or check "
                f"the rewards and the batch"
            )


def _export(parts: Parts, exporter: Callable[[Any, str], None], params: Any, done: int) -> None:
    """workdir/export/step_<done>, written by process 0 (after all gathered the params). Under
    the whole-host split the trainer processes call `exporter` with the trainer's params."""
    path = os.path.join(parts.workdir, "export", f"step_{done}")
    if parts.roles.whole:
        if parts.roles.trains:
            exporter(params, path)
        return
    if parts.to_sampler is not None:
        params = parts.to_sampler(params)  # every process: a collective
    if multihost.is_primary():
        exporter(params, path)


@dataclasses.dataclass
class _First:
    """A session's first rollout group and batch, fetched before its first step to run the
    self-tests on (`tg_jax.train.self_tests`), with the seconds its step would have timed."""

    group: Any
    batch: Batch
    wait_s: float
    build_s: float
    figures: dict[str, float]


def _metrics_writer(parts: Parts, first: _First | None) -> MetricsWriter:
    """The run's metrics.jsonl (and TensorBoard) writer; the self-tests' figures go first, at
    step 0 (stage `self_tests.STAGE`)."""
    lc = parts.config.rl_loop
    writer = MetricsWriter(
        parts.workdir,
        use_tensorboard=bool(lc.use_tensorboard),
        wandb_config=wandb_settings(parts.config, parts.workdir, parts.arm_name, parts.seed),
    )
    if first is not None:
        writer.write(0, first.figures, stage=self_tests.STAGE)
    return writer


def wandb_settings(config: Any, workdir: str, arm: str, seed: int) -> dict[str, Any] | None:
    """`wandb.init`'s arguments for `rl_loop.wandb_project` (None when unset): the run named
    <arm>_seed<seed>, its id from the workdir (a resumed run continues it), the config."""
    project = str(config.rl_loop.get("wandb_project", "") or "")
    if not project:
        return None
    digest = hashlib.sha256(os.fspath(workdir).encode()).hexdigest()[:12]
    name = f"{arm}_seed{seed}"
    return {
        "project": project,
        "name": name,
        "id": f"{name}-{digest}",
        "resume": "allow",
        "config": config.to_dict(),
    }


def _get_group(parts: Parts, source: Any) -> Any:
    group = source.get(int(parts.config.rl.max_staleness))
    if group is None:
        raise RuntimeError("the train task iterator ended before the last step")
    return group


def _first_group(parts: Parts, source: Any, state: TrainState, start: int) -> _First | None:
    """With `rl_loop.self_tests` on a fresh run: step 1's rollout group and batch, checked under
    the initial params before any update (`self_tests.run`: a `SelfTestError` stops the run
    before metrics or checkpoints are written); None otherwise (a resumed session, or the
    whole-host split, where only the trainer processes hold the params)."""
    if start != 0 or not self_tests.enabled(parts.config) or parts.roles.whole:
        return None
    t0 = time.perf_counter()
    group = _get_group(parts, source)
    t1 = time.perf_counter()
    batch = _build_batch(parts, group.trajectories, start + 1)
    t2 = time.perf_counter()
    teacher = reference_teacher_params(TGConfig.from_config(parts.config.tg), parts.ref_params)
    figures = self_tests.run(parts, state.params, group.trajectories, batch, teacher)
    return _First(group, batch, t1 - t0, t2 - t1, figures)


def _train_step(
    parts: Parts,
    session: Session,
    source: Any,
    state: TrainState,
    done: int,
    first: _First | None = None,
) -> tuple[TrainState, Any, dict[str, Any]]:
    """One RL step: a rollout group (`first`'s when given) -> a batch -> the train step -> the
    new params published as policy version `done`; adds the step's costs to the session's.

    Returns:
      (new state, the rollout group, the step's metrics: device ones and host ones).
    """
    t0 = time.perf_counter()
    if first is None:
        group = _get_group(parts, source)
        t1 = time.perf_counter()
        batch = _build_batch(parts, group.trajectories, done)
    else:  # timed as if fetched and built now
        group, batch = first.group, first.batch
        t0, t1 = t0 - first.wait_s - first.build_s, t0 - first.build_s
    rollout_dump.dump_step(parts.config, parts.workdir, done, group.trajectories, batch)
    if faults.hit("step.nan"):  # a numerically broken step (tg_jax.faults)
        batch = batch.replace(
            rewards={k: np.full_like(v, np.nan) for k, v in batch.rewards.items()}
        )
    t2 = time.perf_counter()
    # Every process built the same whole batch; each places its own devices' rows.
    placed = multihost.host_to_global(batch, parts.batch_sharding)
    args = (state, placed) if parts.ref_params is None else (state, placed, parts.ref_params)
    state, metrics = parts.step_fn(*args)
    source.publish(state.params, done)
    # Waiting here costs only the overlap of the next build_batch with this step (the next
    # rollouts need these params anyway) and gives a clean train time.
    jax.block_until_ready(metrics)
    metrics = rl_hosts.follow(parts.roles, metrics)  # the whole-host split: process 0's
    t3 = time.perf_counter()
    stats = source.stats()
    _add_costs(parts, session, group, batch, stats["groups_dropped_stale"])
    host = host_metrics(group, session.costs, batch, (t0, t1, t2, t3))
    if "publish_s" in stats:  # several processes: the weight sync to the hosts' samplers
        host["time/publish_s"] = stats["publish_s"]
    return state, group, {**metrics, **host}
