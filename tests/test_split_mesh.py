"""Trainer and sampler on their own meshes (`config.sampler_mesh`), on 8 simulated CPU devices.

The trainer's mesh covers the first 4 devices, the sampler's ("data", "tensor") mesh the last
4; each published policy is resharded onto the sampler's shardings device to device. The
deterministic mode (staleness 0) then trains exactly what the colocated run trains; the async
mode completes and records the policy version of every step's rollouts; the command line
takes the split as an override; a split that cannot be built is a clear error.
"""

import os
import subprocess
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from tests import rl_loop_driver as driver
from tg_jax import config_files, config_lib, sharding
from tg_jax.metrics import last_per_step, read_metrics
from tg_jax.models import ModelConfig, Transformer, init_params
from tg_jax.sampling import placement
from tg_jax.sampling.sampler import Sampler
from tg_jax.tpu.distributed import cpu_devices_env
from tg_jax.train import rl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3
TOL = 1e-5


def _config(num_devices=4, shape=(-1, 1), async_sampling=False, steps=STEPS, **overrides):
    config = driver.make_config(async_sampling=async_sampling, steps=steps)
    return config_files.apply_overrides(
        config,
        {"sampler_mesh.num_devices": num_devices, "sampler_mesh.shape": tuple(shape),
         "rl_loop.eval_every": 0, **overrides},
    )  # fmt: skip


def _run(workdir, config):
    return rl.run_rl(
        config, str(workdir), driver.initial_params(config), arm_name="tg", seed=0,
        sources=driver.make_sources(),
    )  # fmt: skip


def _needs_8_devices():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py simulates them)")


def test_split_devices_and_the_two_meshes():
    _needs_8_devices()
    devices = jax.devices()[:8]
    config = _config(shape=(-1, 2))
    trainer, sampler = sharding.split_devices(config, devices)
    assert trainer == devices[:4] and sampler == devices[4:]  # the LAST N are the sampler's
    mesh = sharding.make_mesh(config.mesh, trainer)
    assert set(mesh.devices.flat) == set(trainer) and mesh.shape["fsdp"] == 4
    s_mesh, s_rules = sharding.make_sampler_mesh(config.sampler_mesh, sampler)
    assert set(s_mesh.devices.flat) == set(sampler)
    assert dict(s_mesh.shape) == {"data": 2, "tensor": 2}
    rules = dict(s_rules)
    assert rules["batch"] == "data"
    assert all(rules[n] == "tensor" for n in ("heads", "kv_heads", "mlp"))
    assert sharding.batch_divisor(s_mesh, s_rules) == 2
    colocated = _config(num_devices=0)
    assert sharding.split_devices(colocated, devices) == (devices, None)
    assert "sampler_mesh" in config_files.load_config_file("configs/default.py")


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"sampler_mesh.num_devices": 8}, "must be below the 8 devices"),
        ({"sampler_mesh.num_devices": 9}, "must be below the 8 devices"),
        ({"sampler_mesh.num_devices": -1}, "must be >= 0"),
        ({"sampler_mesh.shape": (3, -1)}, "sampler_mesh over its 4 devices: .* does not divide"),
        ({"mesh.shape": (1, 8, 1, 1)}, "mesh over the trainer's 4 devices: .* needs 8 devices"),
        ({"sampler_mesh.num_devices": 5, "sampler_mesh.shape": (-1, 5)},
         "tensor axis 5 does not divide the trainer's 3 devices"),
    ],
    ids=["all_devices", "more_than_all", "negative", "sampler_shape", "trainer_shape", "tensor"],
)  # fmt: skip
def test_split_that_cannot_be_built_is_a_clear_error(overrides, match):
    _needs_8_devices()
    config = config_files.apply_overrides(_config(), overrides)
    with pytest.raises(ValueError, match=match):
        sharding.split_devices(config, jax.devices()[:8])


class _Dev(NamedTuple):  # a device of a multi-host slice: its id and process
    id: int
    process_index: int


def test_split_over_several_processes_gives_each_its_own_sampler_devices():
    """2 hosts x 4 devices, num_devices 4: the last 2 of each host sample, the first 2 of each
    train (one trainer mesh over both hosts); the per-host checks name the process share."""
    devices = [_Dev(i, i // 4) for i in range(8)]
    config = _config(num_devices=4)
    config = config_files.apply_overrides(config, {"sampler_mesh.shape": (-1, 2)})
    trainer, sampler = sharding.split_devices(config, devices)
    assert [d.id for d in trainer] == [0, 1, 4, 5] and [d.id for d in sampler] == [2, 3, 6, 7]
    cases = [
        (3, (-1, 1), "num_devices=3 over 2 processes: .* multiple of 2"),
        (8, (-1, 1), "below each process's 4 devices \\(4 per process\\)"),
        (4, (-1, 4), "sampler_mesh over its 2 devices per process: .* does not divide"),
        (2, (-1, 1), None),  # 3 trainer devices per process, 1 sampler device
        (2, (1, 1), None),
    ]
    for n, shape, match in cases:
        c = config_files.apply_overrides(
            config, {"sampler_mesh.num_devices": n, "sampler_mesh.shape": shape}
        )
        if match is None:
            trainer, sampler = sharding.split_devices(c, devices)
            assert [d.id for d in sampler] == [3, 7] and len(trainer) == 6
            continue
        with pytest.raises(ValueError, match=match):
            sharding.split_devices(c, devices)
    c = config_files.apply_overrides(
        config, {"sampler_mesh.num_devices": 2, "sampler_mesh.shape": (1, 1)}
    )
    six = [_Dev(i, i // 3) for i in range(6)]  # 2 trainer devices per host, tensor 1: fine
    assert [d.id for d in sharding.split_devices(c, six)[1]] == [2, 5]
    assert sharding.split_devices(_config(num_devices=0), devices)[1] is None


def test_whole_host_split_gives_the_last_processes_to_the_sampler():
    """sampler_mesh.processes H: the last H processes' devices sample, the others' train; the
    mesh after RL spreads fsdp over every device; each refusal names its reason."""
    devices = [_Dev(i, i // 2) for i in range(8)]  # 4 processes x 2 devices
    whole = {"sampler_mesh.num_devices": 0, "sampler_mesh.processes": 2,
             "sampler_mesh.shape": (-1, 2), "mesh.shape": (1, 2, 2, 1)}  # fmt: skip
    config = config_files.apply_overrides(_config(), whole)
    trainer, sampler = sharding.split_devices(config, devices)
    assert [d.id for d in trainer] == [0, 1, 2, 3] and [d.id for d in sampler] == [4, 5, 6, 7]
    assert sharding.sampler_processes(config, count=4) == (2, 3)
    assert sharding.sampler_processes(_config(), count=4) == (0, 1, 2, 3)
    if jax.device_count() >= 8:  # fsdp takes the rest: 8 / (data 1 x tensor 2 x expert 1)
        assert dict(sharding.every_device_mesh(config).shape) == {
            "data": 1, "fsdp": 4, "tensor": 2, "expert": 1}  # fmt: skip
    cases = [
        ({"sampler_mesh.processes": 3}, "needs at least 2 trainer processes"),
        (
            {
                "sampler_mesh.processes": 1,
                "mesh.shape": (1, -1, 1, 1),
                "sampler_mesh.shape": (-1, 4),
            },
            "sampler_mesh over a sampler process's 2 devices: .* does not divide",
        ),  # fmt: skip
        ({"mesh.shape": (1, 3, 1, 1)}, "mesh over the trainer processes' 4 devices"),
        ({"sampler_mesh.num_devices": 2}, "two layouts: set one of them"),
    ]
    for overrides, match in cases:
        with pytest.raises(ValueError, match=match):
            sharding.split_devices(config_files.apply_overrides(config, overrides), devices)
    uneven = [_Dev(i, min(i, 2)) for i in range(6)]  # 1 + 1 trainer devices, 4 sampler ones
    narrow = {
        "sampler_mesh.processes": 1,
        "mesh.shape": (1, -1, 1, 1),
        "sampler_mesh.shape": (-1, 1),
    }
    with pytest.raises(ValueError, match="4 sampler devices must be at most the trainer's 2"):
        sharding.split_devices(config_files.apply_overrides(config, narrow), uneven)


def test_sampler_axes_are_checked():
    _needs_8_devices()
    cfg = config_lib.sampler_mesh_config(num_devices=4)
    cfg.axes = ("tensor", "data")
    with pytest.raises(ValueError, match="sampler_mesh.axes must be"):
        sharding.make_sampler_mesh(cfg, jax.devices()[4:8])


def _model_and_trainer_params(**overrides):
    config = _config(shape=(-1, 2), **overrides)
    model = Transformer(ModelConfig.from_config(config.model))
    trainer, sampler_devices = sharding.split_devices(config, jax.devices()[:8])
    mesh = sharding.make_mesh(config.mesh, trainer)
    rules = sharding.logical_rules(config.mesh)
    params = jax.device_put(
        init_params(model, jax.random.key(0)), sharding.param_partition_specs(model, mesh, rules)
    )
    return config, model, mesh, rules, params, sampler_devices


@pytest.mark.slow
def test_publisher_reshards_device_to_device_into_new_buffers():
    """Every sampler shard is copied from a trainer device (the staged arrays are never
    fetched to the host, as a plain device_put from the FSDP shards is), into buffers of
    their own: deleting the trainer's params leaves the sampler's intact."""
    _needs_8_devices()
    config, model, mesh, rules, params, sampler_devices = _model_and_trainer_params()
    sampler, publish = placement.rollout_sampler(
        model, 0, mesh, rules, sharding.batch_divisor(mesh, rules),
        sampler_mesh_cfg=config.sampler_mesh, sampler_devices=sampler_devices,
    )  # fmt: skip
    assert dict(sampler.mesh.shape) == {"data": 2, "tensor": 2} and sampler.batch_divisor == 2
    expected = jax.tree.map(np.asarray, jax.device_get(params))
    staged = publish._stage(params)
    out = jax.device_put(staged, publish.shardings)
    jax.block_until_ready(out)
    assert all(x._npy_value is None for x in jax.tree.leaves(staged))  # no host copy was made
    targets = jax.tree.leaves(publish.shardings)
    for leaf, target in zip(jax.tree.leaves(staged), targets, strict=True):
        have = set(map(str, leaf.sharding.devices_indices_map(leaf.shape).values()))
        assert set(map(str, target.devices_indices_map(leaf.shape).values())) <= have
    heads = out["layers"]["attn"]["q_proj"]
    assert "tensor" in str(heads.sharding.spec)  # tensor parallel over the sampler's mesh
    # The check above does catch a host round trip: the FSDP shards straight to the sampler.
    naive = jax.tree.leaves(params)[0]
    jax.device_put(naive, NamedSharding(sampler.mesh, jax.P())).block_until_ready()
    assert naive._npy_value is not None
    got = publish(params)
    for leaf, target in zip(jax.tree.leaves(got), targets, strict=True):
        assert leaf.sharding == target
        assert set(leaf.sharding.device_set) == set(sampler_devices)
    jax.tree.map(lambda x: x.delete(), params)
    for a, b in zip(jax.tree.leaves(jax.device_get(got)), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)


def test_publisher_gives_the_sampler_a_bf16_copy_that_samples_as_fp32_does():
    """With a bf16 compute dtype the own-mesh sampler's copy (and the staged one) holds the
    weight matrices in bf16, norm scales in fp32: per sampler device at most half the fp32
    copy's bytes; and a sampler samples from that copy exactly what it samples from the fp32
    params (its matmuls cast them to bf16 anyway): same tokens, same log-probs."""
    _needs_8_devices()
    config, model, mesh, rules, params, sampler_devices = _model_and_trainer_params(
        **{"model.dtype": "bfloat16"}
    )
    _, publish = placement.own_mesh_sampler(
        model, 0, config.sampler_mesh, sampler_devices, list(mesh.devices.flat)
    )
    staged = publish.stage(params)
    got = publish.copy(staged)
    want = jax.device_get(params)
    for g, s, w in zip(jax.tree.leaves(got), jax.tree.leaves(staged), jax.tree.leaves(want),
                       strict=True):  # fmt: skip
        assert g.dtype == s.dtype == (jnp.bfloat16 if w.ndim >= 2 else w.dtype)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w.astype(g.dtype)))

    def per_device(tree):
        return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
                   if s.device == sampler_devices[0])  # fmt: skip

    fp32 = jax.device_put(want, publish.shardings)
    assert per_device(got) <= per_device(fp32) / 2 + 4096
    one = Sampler(model, pad_id=0)
    prompts = [[1, 5, 9, 13], [2, 4], [7, 7, 7], [3]]
    kw = dict(max_new_tokens=6, temperature=1.0, rng=jax.random.key(1), row_ids=[0, 1, 2, 3])
    ref = one.sample(want, prompts, **kw)
    out = one.sample(jax.device_get(got), prompts, **kw)
    for a, b in zip(ref.tokens, out.tokens, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(ref.logprobs, out.logprobs, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_tensor_parallel_sampler_samples_what_one_device_samples():
    _needs_8_devices()
    config, model, mesh, _, params, sampler_devices = _model_and_trainer_params()
    sampler, publish = placement.own_mesh_sampler(
        model, 0, config.sampler_mesh, sampler_devices, list(mesh.devices.flat)
    )
    one = Sampler(model, pad_id=0)
    prompts = [[1, 5, 9, 13], [2, 4], [7, 7, 7], [3]]
    kw = dict(max_new_tokens=6, temperature=1.0, rng=jax.random.key(1), row_ids=[0, 1, 2, 3])
    ref = one.sample(jax.device_get(params), prompts, **kw)
    got = sampler.sample(publish(params), prompts, **kw)
    for a, b in zip(ref.tokens, got.tokens, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def colocated_run(tmp_path_factory):
    _needs_8_devices()
    workdir = tmp_path_factory.mktemp("colocated")
    return workdir, _run(workdir, _config(num_devices=0))


@pytest.mark.slow
def test_deterministic_split_run_equals_the_colocated_run(colocated_run, tmp_path):
    """Trainer 4 + sampler 4 devices, staleness 0: the params after 3 TG steps are the colocated
    run's (8 devices) within 1e-5, from the same rollouts."""
    _, colocated = colocated_run
    split = _run(tmp_path, _config())
    assert colocated.finished and split.finished and split.step == STEPS
    a, b = driver.flat_params(colocated.state.params), driver.flat_params(split.state.params)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(b[k], a[k], atol=TOL, rtol=0, err_msg=k)
    assert split.costs["sampled_tokens"] == colocated.costs["sampled_tokens"]
    assert split.costs["teacher_forward_flops"] == colocated.costs["teacher_forward_flops"] > 0
    init = driver.flat_params(driver.initial_params(_config()))
    assert any(not np.array_equal(init[k], b[k]) for k in b)  # the training moved them
    trainer_devices = set(jax.devices()[:4])
    assert all(set(x.sharding.device_set) == trainer_devices
               for x in jax.tree.leaves(split.state.params))  # fmt: skip


@pytest.mark.slow
def test_async_split_run_completes_and_reports_its_policy_versions(tmp_path):
    _needs_8_devices()
    config = _config(async_sampling=True, steps=4)
    result = _run(tmp_path, config)
    assert result.finished and result.step == 4
    train = [r for r in last_per_step(read_metrics(str(tmp_path))) if r["stage"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    versions = [int(r["policy_version"]) for r in train]
    print("policy versions of steps 1-4:", versions)
    max_staleness = int(config.rl.max_staleness)
    for r, v in zip(train, versions, strict=True):
        # Step s trains on rollouts of a policy at most max_staleness versions behind s - 1.
        assert r["step"] - 1 - max_staleness <= v <= r["step"] - 1
        assert r["staleness"] == r["step"] - 1 - v
    assert versions == sorted(versions)


@pytest.mark.e2e
def test_command_line_split_runs_end_to_end(tmp_path):
    """The user's command: the main job of configs/tiny.py with a sampler on 4 of 8 devices."""
    env = {**cpu_devices_env(8), "JAX_PLATFORMS": "cpu"}
    work = tmp_path / "w"
    cmd = [sys.executable, "-m", "tg_jax.main", "--config=configs/tiny.py", f"--workdir={work}",
           "--config.stage=pipeline", "--config.sampler_mesh.num_devices=4",
           "--config.rl_loop.steps=2", "--config.rl_loop.eval_every=0"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert os.path.exists(work / "report" / "report.md")
    bad = subprocess.run(
        cmd[:-3] + ["--config.sampler_mesh.num_devices=8"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "error: invalid config: sampler_mesh.num_devices=8 must be below the 8 devices: the "
        "trainer needs at least one"
    ]
    alone = subprocess.run(  # the whole-host split asked of one process
        cmd[:-3] + ["--config.sampler_mesh.num_devices=0", "--config.sampler_mesh.processes=1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert alone.returncode == 2
    assert alone.stderr.strip().splitlines() == [
        "error: invalid config: sampler_mesh.processes=1 of 1 processes: the whole-host split "
        "needs at least 2 trainer processes besides the sampler's (orbax checkpoints no array "
        "that one process of several holds whole); use num_devices for a share of every "
        "process instead"
    ]


def test_two_step_place_copies_in_the_loop_thread_between_batches(monkeypatch):
    """The trainer's publish only stages; the sampling thread copies a staged policy at a batch
    boundary once it is computed, and samples with the policy it has until then."""
    import threading
    import time

    from tg_jax.sampling import loop

    ready = threading.Event()
    monkeypatch.setattr(loop, "_ready", lambda tree: ready.is_set())
    threads = []

    class Place:
        def stage(self, params):
            threads.append(("stage", threading.current_thread().name))
            return {"staged": params}

        def copy(self, staged):
            threads.append(("copy", threading.current_thread().name))
            return staged["staged"]

    used = []

    def rollout_fn(params, index, tasks, version):
        used.append((index, params, version))
        time.sleep(0.01)
        return []

    sampling = loop.SamplingLoop(rollout_fn, [[i] for i in range(400)], queue_size=1, place=Place())
    try:
        sampling.publish(100, 0)  # the first batch copies it at once, computed or not
        sampling.get(max_staleness=10)
        sampling.publish(101, 1)
        assert sampling.version == 1
        for _ in range(3):
            group = sampling.get(max_staleness=10)
            assert group.policy_version == 0  # not computed yet: the old policy samples
        ready.set()
        deadline = time.monotonic() + 30
        while sampling.get(max_staleness=10).policy_version != 1:
            assert time.monotonic() < deadline
    finally:
        sampling.close()
    assert all(p == 100 + v for _, p, v in used)
    assert {t for kind, t in threads if kind == "stage"} == {threading.current_thread().name}
    assert {t for kind, t in threads if kind == "copy"} == {"tg_jax-sampling-loop"}


@pytest.mark.slow
def test_host_replicas_give_each_process_a_bf16_tensor_parallel_copy():
    """The placement of several processes, on 8 devices taken as 2 hosts of 4: each host's
    copy of the FSDP-sharded fp32 params is whole on its own devices, its weight matrices in
    the bf16 compute dtype split 2 ways (tensor) and norm scales in fp32; per device that is a
    quarter of an fp32 replica or less; and a tensor-parallel sampler on a host's copy samples
    what one device samples with the same bf16 weights."""
    _needs_8_devices()
    config = _config(num_devices=0, shape=(-1, 2), **{"model.dtype": "bfloat16"})
    model = Transformer(ModelConfig.from_config(config.model))
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:8])
    rules = sharding.logical_rules(config.mesh)
    params = jax.device_put(
        init_params(model, jax.random.key(0)), sharding.param_partition_specs(model, mesh, rules)
    )
    hosts = [jax.devices()[:4], jax.devices()[4:8]]
    replicas = placement.HostReplicas(model, config.sampler_mesh, hosts)
    both = replicas.copy(params)
    expected = jax.device_get(params)
    full_fp32 = sum(x.nbytes for x in jax.tree.leaves(expected))
    for h, devices in enumerate(hosts):
        copy = replicas.local(both, h)
        assert dict(replicas.meshes[h].shape) == {"data": 2, "tensor": 2}
        for got, want in zip(jax.tree.leaves(copy), jax.tree.leaves(expected), strict=True):
            assert set(got.sharding.device_set) == set(devices)
            assert got.dtype == (jnp.bfloat16 if want.ndim >= 2 else want.dtype)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(got.dtype)))
        on_device = sum(s.data.nbytes for x in jax.tree.leaves(copy) for s in x.addressable_shards
                        if s.device == devices[0])  # fmt: skip
        assert on_device <= full_fp32 / 4 + 4096
        assert "tensor" in str(copy["layers"]["attn"]["q_proj"].sharding.spec)
    sampler = Sampler(model, pad_id=0, mesh=replicas.meshes[1], rules=replicas.rules,
                      batch_divisor=2)  # fmt: skip
    one = Sampler(model, pad_id=0)
    prompts = [[1, 5, 9, 13], [2, 4], [7, 7, 7], [3]]
    kw = dict(max_new_tokens=6, temperature=1.0, rng=jax.random.key(1), row_ids=[0, 1, 2, 3])
    ref = one.sample(jax.device_get(replicas.local(both, 0)), prompts, **kw)
    got = sampler.sample(replicas.local(both, 1), prompts, **kw)
    for a, b in zip(ref.tokens, got.tokens, strict=True):
        np.testing.assert_array_equal(a, b)
