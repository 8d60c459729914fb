"""The background sampling loop: version tags, staleness, errors, shutdown, devices."""

import functools
import itertools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_rollout import RENDERER, RUN, SUBMIT, TASKS, ScriptedSampler, _env
from tg_jax.sampling.loop import InlineLoop, SamplingLoop, data_parallel_mesh
from tg_jax.sampling.rollout import RolloutConfig, rollout_groups
from tg_jax.sampling.trajectory import Trajectory


def _traj(version, task):
    n = 3
    return Trajectory(
        tokens=np.zeros(n, np.int32), roles=np.zeros(n, np.int8),
        turn_ids=np.array([-1, 0, 0], np.int32), turn_starts=np.zeros(1, np.int32),
        behaviour_logprobs=np.zeros(n, np.float32), turn_verdicts=[{}], rewards={"task": 0.0},
        hint_tokens={}, group_id=0, policy_version=version, task_id=str(task),
    )  # fmt: skip


def _fake_rollouts(params, index, tasks, version, seen=None):
    if seen is not None:
        seen.append((params, version))
    return [_traj(version, t) for t in tasks]


def _wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_version_tags_and_staleness_filter():
    seen = []
    fn = functools.partial(_fake_rollouts, seen=seen)
    batches = ([i] for i in itertools.count())
    with SamplingLoop(fn, batches, queue_size=2) as loop:
        loop.publish({"w": jnp.ones(2)}, version=0)
        group = loop.get(max_staleness=0, timeout=10)
        assert group.policy_version == 0 and group.staleness == 0 and group.batch_index == 0
        assert group.trajectories[0].task_id == "0" and group.sampled_tokens == 2
        # Batches 1, 2 queued; batch 3 sampled (at version 0) and waiting for room.
        _wait(lambda: loop.stats()["queue_size"] == 2 and len(seen) == 4)
        for v in (1, 2, 3):
            loop.publish({"w": v * jnp.ones(2)}, version=v)
        group = loop.get(max_staleness=1, timeout=10)
        # The three groups sampled at version 0 are 3 versions old: dropped, not delivered.
        assert group.policy_version == 3 and group.staleness == 0 and group.batch_index == 4
        stats = loop.stats()
        assert stats["groups_dropped_stale"] == 3 and stats["groups_delivered"] == 2
        # Lineage: the next delivered group lists them (the step's step_<N>.dropped.json).
        why = "stale: sampled by policy version 0, 3 behind the trainer (rl.max_staleness 1)"
        assert group.trajectories[0].info["dropped_groups"] == [
            {"batch_index": i, "group_ids": [0], "task_ids": [str(i)], "why": why}
            for i in (1, 2, 3)
        ]
        loop.publish({"w": jnp.ones(2)}, version=4)
        group = loop.get(max_staleness=1, timeout=10)  # sampled at 3 or 4: kept
        assert group.policy_version >= 3 and group.staleness == 4 - group.policy_version
        assert "dropped_groups" not in group.trajectories[0].info  # listed once
        with pytest.raises(ValueError, match="went back"):
            loop.publish({"w": jnp.ones(2)}, version=2)
    assert not loop.running


def test_loop_exception_reaches_get_quickly():
    go = threading.Event()

    def failing(params, index, tasks, version):
        if tasks[0] == 1:
            go.wait(10)
            raise ValueError("environment exploded")
        return _fake_rollouts(params, index, tasks, version)

    loop = SamplingLoop(failing, ([i] for i in itertools.count()))
    loop.publish({"w": jnp.ones(2)}, version=0)
    assert loop.get(max_staleness=0, timeout=10).batch_index == 0
    go.set()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="environment exploded") as err:
        loop.get(max_staleness=0, timeout=30)
    assert time.monotonic() - start < 5 and isinstance(err.value.__cause__, ValueError)
    loop.close()
    assert not loop.running


def test_close_joins_a_blocked_or_waiting_thread():
    # Waiting for its first params.
    loop = SamplingLoop(_fake_rollouts, iter([[0]]))
    loop.close(timeout=5)
    assert not loop.running
    # Blocked on a full queue of an endless task stream.
    loop = SamplingLoop(_fake_rollouts, ([i] for i in itertools.count()))
    loop.publish({"w": jnp.ones(2)}, version=0)
    _wait(lambda: loop.stats()["queue_size"] == 2)
    start = time.monotonic()
    loop.close(timeout=5)
    assert not loop.running and time.monotonic() - start < 5


def test_exhausted_task_stream_ends_with_none():
    loop = SamplingLoop(_fake_rollouts, [[0], [1], [2]], queue_size=1)
    loop.publish({"w": jnp.ones(2)}, version=5)
    got = [loop.get(max_staleness=0, timeout=10) for _ in range(3)]
    assert [g.batch_index for g in got] == [0, 1, 2] and {g.policy_version for g in got} == {5}
    assert loop.get(max_staleness=0, timeout=10) is None
    assert loop.get(max_staleness=0, timeout=10) is None
    loop.close()


def test_batches_count_from_first_index_in_both_loops():
    def fn(params, index, tasks, version, seen):
        seen.append((index, list(tasks), version))
        return [_traj(version, t) for t in tasks]

    batches = [[3], [4, 5], [6]]
    seen_thread, seen_inline = [], []
    loop = SamplingLoop(functools.partial(fn, seen=seen_thread), batches, first_index=7)
    inline = InlineLoop(functools.partial(fn, seen=seen_inline), batches, first_index=7)
    groups = {}
    for name, source in (("thread", loop), ("inline", inline)):
        with source:
            source.publish({"w": jnp.ones(2)}, version=2)
            groups[name] = [source.get(max_staleness=0, timeout=10) for _ in batches]
            assert source.get(max_staleness=0, timeout=10) is None
            assert source.stats()["groups_dropped_stale"] == 0
            with pytest.raises(ValueError, match="went back"):
                source.publish({"w": jnp.ones(2)}, version=1)
    # The rollout function gets the absolute batch index; both loops hand it the same batches.
    assert seen_thread == seen_inline == [(7, [3], 2), (8, [4, 5], 2), (9, [6], 2)]
    for a, b in zip(groups["thread"], groups["inline"], strict=True):
        assert (a.batch_index, a.policy_version, a.staleness) == (
            b.batch_index, b.policy_version, b.staleness,
        )  # fmt: skip
        assert [t.task_id for t in a.trajectories] == [t.task_id for t in b.trajectories]
    assert [g.batch_index for g in groups["inline"]] == [7, 8, 9]
    assert inline.stats()["groups_delivered"] == 3 and inline.version == 2


def test_params_are_copied_to_the_sampler_devices():
    seen = []
    fn = functools.partial(_fake_rollouts, seen=seen)
    device = jax.devices()[-1]
    loop = SamplingLoop(fn, iter([[0]]), devices=[device])
    w = jnp.arange(4.0)
    loop.publish({"w": w}, version=0)
    loop.get(max_staleness=0, timeout=10)
    loop.close()
    params = seen[0][0]
    assert params["w"].devices() == {device}
    # A copy: the trainer may donate (free) its own buffers in the next train step.
    w.delete()
    np.testing.assert_array_equal(params["w"], np.arange(4.0))
    # Shared devices: still a copy.
    seen.clear()
    loop = SamplingLoop(fn, iter([[0]]))
    w = jnp.arange(4.0)
    loop.publish({"w": w}, version=0)
    w.delete()
    loop.get(max_staleness=0, timeout=10)
    loop.close()
    np.testing.assert_array_equal(seen[0][0]["w"], np.arange(4.0))
    # Several devices: replicated on all of them.
    seen.clear()
    loop = SamplingLoop(fn, iter([[0]]), devices=jax.devices()[:2])
    loop.publish({"w": jnp.ones(3)}, version=0)
    loop.get(max_staleness=0, timeout=10)
    loop.close()
    assert seen[0][0]["w"].devices() == set(jax.devices()[:2])


def test_loop_runs_real_rollouts_against_the_env():
    sampler = ScriptedSampler(lambda text, turn: [RUN, SUBMIT][min(turn, 1)])

    def fn(params, index, tasks, version):
        return rollout_groups(
            sampler, params, RENDERER, _env, tasks, rollouts_per_task=2,
            config=RolloutConfig(max_total_tokens=1024),
            rng=jax.random.fold_in(jax.random.key(0), index), policy_version=version,
        )  # fmt: skip

    loop = SamplingLoop(fn, [TASKS, TASKS[:1]])
    loop.publish({}, version=1)
    first, second = (loop.get(max_staleness=0, timeout=30) for _ in range(2))
    loop.close()
    assert len(first.trajectories) == 4 and len(second.trajectories) == 2
    assert all(t.policy_version == 1 and t.num_turns == 2 for t in first.trajectories)
    assert [t.group_id for t in first.trajectories] == [0, 0, 1, 1]


@pytest.mark.slow
def test_data_parallel_sampler_on_a_device_subset():
    from tg_jax import config_lib
    from tg_jax.models import ModelConfig, Transformer, init_params
    from tg_jax.sampling.sampler import Sampler

    cfg = ModelConfig.from_config(config_lib.tiny_model_config())
    model = Transformer(cfg)
    params = init_params(model, jax.random.key(0))
    devices = jax.devices()[2:4]
    mesh, rules = data_parallel_mesh(devices)
    sharded = Sampler(model, pad_id=0, mesh=mesh, rules=rules, batch_divisor=len(devices))
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    kw = dict(max_new_tokens=6, temperature=0.0, rng=jax.random.key(0))
    ref = Sampler(model, pad_id=0).sample(params, prompts, **kw)

    def fn(params, index, tasks, version):
        assert params["embed"].sharding.device_set == set(devices)
        out = sharded.sample(params, prompts, **kw)
        return [_traj(version, [int(t) for t in out.tokens[i]]) for i in range(len(prompts))]

    loop = SamplingLoop(fn, iter([[0]]), devices=devices)
    loop.publish(params, version=0)
    group = loop.get(max_staleness=0, timeout=60)
    loop.close()
    assert [t.task_id for t in group.trajectories] == [str(t.tolist()) for t in ref.tokens]
