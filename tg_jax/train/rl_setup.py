"""What an RL run is made of, built once before its first step (tg_jax.train.rl runs it).

    parts = build_parts(config, workdir, init_params, arm_name, seed, renderer)
    tasks, eval_tasks = train_tasks(config, workdir, seed, sources, eval_tasks, data_state)
    source = rollout_source(parts, tasks, first_index)

`build_parts`: the model, the trainer's mesh (and the sampler's, `sampler_mesh`), the initial
TrainState, the frozen reference params, the jitted train step and the rollout sampler, with the
student and teacher length budgets (`max_lengths`) and which processes sample and train
(tg_jax.train.rl_hosts). `train_tasks`: the train task iterator at the position a checkpoint
restored, and the periodic evaluation's dev tasks. `rollout_source`: the sampling loop over the
train tasks (inline or threaded, tg_jax.train.rl_rollouts) with the training judge (a wrong one
with `rl_loop.feedback`'s error rates).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import jax
import jax.numpy as jnp

from tg_jax import engine as engine_api
from tg_jax import multihost, sharding
from tg_jax.data.pipeline import TaskIterator
from tg_jax.envs import Requirement, decode_task, env_factory, make_env
from tg_jax.envs.hints import noisy_judge
from tg_jax.models import ModelConfig, Transformer
from tg_jax.rl import hidden_thinking
from tg_jax.rl.step_config import StepConfig
from tg_jax.rl.train_state import TrainState, create_train_state, make_optimizer
from tg_jax.rl.train_step import make_train_step
from tg_jax.sampling import agent_loop, placement, rollout
from tg_jax.sampling.sampler import Sampler
from tg_jax.text import ChatRenderer
from tg_jax.train import reward_weights, rl_hosts, rl_rollouts


@dataclasses.dataclass
class Parts:
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


def max_lengths(
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


def build_parts(
    config: Any, workdir: str, init_params: Any, arm_name: str, seed: int, renderer: ChatRenderer
) -> Parts:
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
    student_max, teacher_max = max_lengths(config, renderer, requirements)
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
    return Parts(
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


def train_tasks(
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


def rollout_source(parts: Parts, tasks: TaskIterator, first_index: int) -> Any:
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
