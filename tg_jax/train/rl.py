"""The RL loop: rollouts -> batches -> train steps -> new weights, checkpointed and logged.

    run_rl(config, workdir, init_params, arm_name="tg", seed=0)

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
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np

from tg_jax import checkpointing, faults, multihost, paths, sharding
from tg_jax import engine as engine_api
from tg_jax.data.pipeline import TaskIterator
from tg_jax.envs import Requirement, decode_task, env_factory, make_env
from tg_jax.envs.hints import noisy_judge
from tg_jax.errors import RunError
from tg_jax.evaluation import heldout
from tg_jax.metrics import RL_SUMMARY_FILE, LaggedMetrics, MetricsWriter
from tg_jax.models import ModelConfig, Transformer
from tg_jax.progress import ProgressBar
from tg_jax.rl import hidden_thinking
from tg_jax.rl.batch import Batch, build_batch
from tg_jax.rl.step_config import RLConfig, StepConfig, TGConfig
from tg_jax.rl.tg import break_span, distill_budget, hint_copies
from tg_jax.rl.train_state import TrainState, create_train_state, make_optimizer
from tg_jax.rl.train_step import make_train_step
from tg_jax.sampling import agent_loop, placement, rollout
from tg_jax.sampling.sampler import Sampler
from tg_jax.text import ByteTokenizer, ChatRenderer
from tg_jax.train import memory, reward_weights, rl_hosts, rl_rollouts, rollout_dump
from tg_jax.train.rl_costs import Session, host_metrics, write_summary

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


@dataclasses.dataclass
class _Parts:
    """What a run's steps are made of (fixed over the run)."""

    config: Any
    workdir: str
    arm_name: str
    seed: int
    model_cfg: ModelConfig
    divisor: int  # the mesh's batch divisor
    student_max: int
    teacher_max: int
    state: TrainState  # the initial state (restored over when resuming)
    ref_params: Any  # the frozen starting policy (KL term, reference teacher), None without
    step_fn: Any
    sampler: Sampler
    renderer: ChatRenderer
    key: jax.Array  # the run's key: fold_in 0 = state init, 1 = rollout sampling
    batch_sharding: Any  # of the train batch's leading axis on the trainer's mesh
    to_sampler: Callable[[Any], Any] | None  # params -> the sampler's (None: the same)
    roles: rl_hosts.Roles  # which processes sample and train
    requirement_names: tuple[str, ...]  # the environment's (plug-ins by their own names)


def _lengths(
    config: Any, renderer: ChatRenderer, requirements: Sequence[Requirement]
) -> tuple[int, int]:
    """(student max length, teacher max length) for the environment's `requirements`. Both
    arms get the same student budget: the teacher's hints must fit on top of it within the
    model's context."""
    teacher_max = int(config.model.max_seq_len)
    reserve = rl_rollouts.hint_reserve(renderer, requirements, int(config.env.max_turns))
    student_max = int(config.rl_loop.seq_len) or teacher_max - reserve
    if student_max + reserve > teacher_max:
        raise ValueError(
            f"rl_loop.seq_len {student_max} + hint reserve {reserve} > model.max_seq_len "
            f"{teacher_max}: the hinted teacher sequences would not fit"
        )
    return student_max, teacher_max


def _build(
    config: Any, workdir: str, init_params: Any, arm_name: str, seed: int, renderer: ChatRenderer
) -> _Parts:
    """Model, mesh, initial train state, jitted step and sampler of a run."""
    model_cfg = ModelConfig.from_config(config.model)
    model = Transformer(model_cfg)
    trainer_devices, sampler_devices = sharding.split_devices(config)  # config.sampler_mesh
    roles = rl_hosts.roles(config)  # before the trainer's first collective
    mesh = sharding.make_mesh(config.mesh, trainer_devices)
    rules = sharding.logical_rules(config.mesh)
    # The environment's requirements, read once (a plug-in's are built by its import path).
    env = make_env(config.env, renderer.tool_format)
    requirements = env.requirements
    # A requirement named in env.requirements without a reward weight gets its own.
    config = reward_weights.with_reward_weights(config, env)
    student_max, teacher_max = _lengths(config, renderer, requirements)
    key = jax.random.key(seed)
    if sampler_devices is not None and init_params is not None:  # e.g. SFT's, on every device
        shardings = sharding.param_partition_specs(model, mesh, rules)
        init_params = jax.device_put(init_params, shardings)
    state = create_train_state(
        model,
        make_optimizer(config.optim),
        mesh,
        rules,
        jax.random.fold_in(key, 0),
        params=init_params,
    )
    # Frozen: the starting policy (init_params), also when a checkpoint is restored over state.
    ref_params = None
    if StepConfig.from_config(config).needs_reference:
        ref_params = jax.tree.map(jnp.copy, state.params)
    divisor = sharding.batch_divisor(mesh, rules)
    sampler, to_sampler = placement.rollout_sampler(
        model,
        renderer.tokenizer.pad_id,
        mesh,
        rules,
        divisor,
        sampler_mesh_cfg=config.get("sampler_mesh"),
        sampler_devices=sampler_devices,
        record_routes=agent_loop.router_replay(config),
    )
    return _Parts(
        config=config,
        workdir=workdir,
        arm_name=arm_name,
        seed=seed,
        model_cfg=model_cfg,
        divisor=divisor,
        student_max=student_max,
        teacher_max=teacher_max,
        state=state,
        ref_params=ref_params,
        step_fn=make_train_step(config, model, mesh, rules),
        sampler=sampler,
        renderer=renderer,
        key=key,
        to_sampler=to_sampler,
        batch_sharding=sharding.data_sharding(mesh, rules, ndim=1),
        requirement_names=tuple(r.name for r in requirements),
        roles=roles,
    )


def _tasks(
    config: Any,
    workdir: str,
    seed: int,
    sources: Mapping[str, Sequence[Any]] | None,
    eval_tasks: Sequence[Any] | None,
    data_state: dict[str, Any] | None,
) -> tuple[TaskIterator, Sequence[Any] | None]:
    """(train task iterator at its restored position, periodic evaluation tasks: the dev
    split's unless given; the held-out split is the final evaluation's alone)."""
    from tg_jax.data import task_data

    lc = config.rl_loop
    if sources is None:
        sources = task_data.prepare_tasks(config, workdir)
    if eval_tasks is None and int(lc.eval_every) > 0:
        dev_seed = int(lc.get("eval_task_seed", 9))  # not `seed`: the run's, used below
        eval_tasks = task_data.dev_tasks(config, int(lc.eval_tasks), seed=dev_seed)
    samplers = len(sharding.sampler_processes(config))  # fails early unless groups split evenly
    multihost.process_slice(int(lc.groups_per_step), 0, samplers)
    # Every process iterates the same batches (one process's settings, so checkpoints of
    # either kind resume the other); each rolls out its own share of a batch's groups.
    tasks = TaskIterator(
        sources["train"],
        group_size=int(lc.groups_per_step),
        seed=int(lc.data_seed) * 100_003 + seed,
        decode_fn=decode_task,
        shard=grain.sharding.ShardOptions(0, 1, drop_remainder=True),
    )
    if data_state is not None:
        tasks.set_state(data_state)
    return tasks, eval_tasks


def _process_episodes(lc: Any, samplers: Sequence[int]) -> int:
    """Episodes this process plays a step: its share of the groups (`multihost.process_slice`
    over the sampler processes, as `rl_rollouts` splits them) x the rollouts per group (its
    engine's default slots)."""
    share = multihost.process_slice(
        int(lc.groups_per_step), samplers.index(jax.process_index()), len(samplers)
    )
    return (share.stop - share.start) * int(lc.rollouts_per_group)


def _rollout_source(parts: _Parts, tasks: TaskIterator, first_index: int) -> Any:
    """The sampling loop (inline or threaded, `rl_loop.async_sampling`) over the train tasks."""
    config, lc = parts.config, parts.config.rl_loop
    if not parts.roles.samples:  # a trainer process of the whole-host split: plays nothing
        return rl_rollouts.ProcessGather(rl_rollouts.NoRollouts(), parts.to_sampler, whole=True)
    rollout_fn = rl_rollouts.BatchRollout(
        parts.sampler,
        parts.renderer,
        noisy_judge(  # the training judge (a wrong one with rl_loop.feedback's error rates)
            env_factory(config.env, parts.renderer.tool_format),
            rl_rollouts.verdict_noise(lc.feedback),
            seed=parts.seed,
        ),
        rollouts_per_group=int(lc.rollouts_per_group),
        config=rollout.RolloutConfig(
            max_new_tokens=int(lc.max_new_tokens),
            max_total_tokens=parts.student_max,
            temperature=float(config.rl.temperature),
            env_workers=int(lc.env_workers),
            max_rows=int(config.sampler_mesh.max_rows),
            **hidden_thinking.rollout_settings(config),
        ),
        sampling_key=jax.random.fold_in(parts.key, 1),
        seed=parts.seed,
        rates=rl_rollouts.feedback_rates(lc.feedback),
        engine=agent_loop.runner_from_config(  # rl_loop.rollout_engine "builtin"
            config,
            engine_api,
            parts.sampler.model,
            episodes=_process_episodes(lc, parts.roles.samplers),
            max_total_tokens=parts.student_max,
            pad_id=parts.renderer.tokenizer.pad_id,
            mesh=getattr(parts.sampler, "mesh", None),
        ),
        processes=parts.roles.samplers,
    )
    return rl_rollouts.rollout_source(
        rollout_fn,
        tasks,
        first_index=first_index,
        async_sampling=bool(lc.async_sampling),
        queue_size=int(lc.queue_size),
        to_sampler=parts.to_sampler,
        whole=parts.roles.whole,
    )


def _evaluate(parts: _Parts, params: Any, eval_tasks: Sequence[Any]) -> dict[str, float]:
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


def _build_batch(parts: _Parts, trajectories: Sequence[Any], step: int) -> Batch:
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


def _add_costs(parts: _Parts, session: Session, group: Any, batch: Batch, dropped: float) -> None:
    costs = session.costs
    costs.sampled_tokens += rl_rollouts.sampled_tokens(group.trajectories)
    if bool(parts.config.tg.enabled):
        real = int(np.sum(np.asarray(batch.teacher_segment_ids_BtxTt) > 0))
        t_len = int(batch.teacher_tokens_BtxTt.shape[1])
        costs.teacher_tokens += real
        costs.teacher_forward_flops += parts.model_cfg.flops_per_token(t_len) * real
        costs.distilled_tokens += distilled_tokens(parts.config.tg, batch)
    costs.dropped_groups = session.dropped0 + int(dropped)


def _summarize(parts: _Parts, session: Session, done: int) -> None:
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
    parts = _build(config, workdir, init_params, arm_name, seed, renderer)
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
            tasks, eval_tasks = _tasks(config, workdir, seed, sources, eval_tasks, data_state)
            result = _train(parts, ckpt, tasks, eval_tasks, state, session, end, exporter)
    finally:
        ckpt.close()
    if parts.roles.whole:  # the state on every device, for what follows the RL stage
        result.state = rl_hosts.full_state(config, directory, result.state)
    return result


def _train(
    parts: _Parts,
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
    source = _rollout_source(parts, tasks, data_state["next_index"])
    try:
        source.publish(state.params, start)
        writer = MetricsWriter(parts.workdir, use_tensorboard=bool(lc.use_tensorboard))
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

        done, session.started = start, time.time()  # the setup above is not counted
        session.memory = memory.PeakMemory()
        guard = _NonFinite(RLConfig.from_config(parts.config.rl), ckpt)
        identity = paths.dir_identity(parts.workdir)
        with writer, bar, session.memory:
            if start == 0 and eval_every > 0:
                _eval(0)
            for step in range(start, end):
                done = step + 1
                _check_workdir(parts.workdir, identity, done)
                state, group, metrics = _train_step(parts, session, source, state, done)
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


def _export(parts: _Parts, exporter: Callable[[Any, str], None], params: Any, done: int) -> None:
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


def _train_step(
    parts: _Parts, session: Session, source: Any, state: TrainState, done: int
) -> tuple[TrainState, Any, dict[str, Any]]:
    """One RL step: a rollout group -> a batch -> the train step -> the new params published
    as policy version `done`; adds the step's costs to the session's.

    Returns:
      (new state, the rollout group, the step's metrics: device ones and host ones).
    """
    t0 = time.perf_counter()
    group = source.get(int(parts.config.rl.max_staleness))
    if group is None:
        raise RuntimeError("the train task iterator ended before the last step")
    t1 = time.perf_counter()
    batch = _build_batch(parts, group.trajectories, done)
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
