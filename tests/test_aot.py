"""Ahead-of-time compilation: memory accounting, and small compiles on CPU and (libtpu) TPU."""

import dataclasses
import functools
import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from tg_jax import config_files, sharding
from tg_jax.models import ModelConfig, Transformer, hf_dir
from tg_jax.sampling import placement
from tg_jax.tpu import aot, aot_steps, hbm

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "configs")
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None


def _tiny_config(mesh_shape, moe=True):
    cfg = config_files.load_config_file(os.path.join(CONFIG_DIR, "default.py"))
    tiny = dict(
        vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        max_seq_len=64, mlp_dim=32,
    )  # fmt: skip
    if moe:
        tiny.update(mlp_dim=0, num_experts=8, experts_per_token=2, moe_mlp_dim=16)
    overrides = {f"model.{k}": v for k, v in tiny.items()}
    return config_files.apply_overrides(
        cfg, {**overrides, "mesh.shape": mesh_shape, "rl.micro_batches": 2}
    )


def test_hbm_per_device():
    gib = hbm.GIB
    assert hbm.hbm_bytes_per_device("v5p:2x4x4", 32) == 95 * gib  # megacore: a device = a chip
    assert hbm.hbm_bytes_per_device("v4:2x2x2", 16) == 16 * gib  # v4 devices are TensorCores
    assert hbm.hbm_bytes_per_device("v5e:4x4", 16) == 16 * gib
    with pytest.raises(ValueError, match="Unknown TPU kind"):
        hbm.hbm_bytes_per_device("v9:2x2", 4)


def test_memory_report_total_counts_donated_buffers_once():
    r = hbm.MemoryReport("step", arguments=10, outputs=8, aliased=6, temps=3, code=1, hbm=20.0)
    assert r.total == 16
    assert dataclasses.replace(r, resident=2).total == 18
    assert "fits" in r.format() and "80%" in r.format()
    assert "DOES NOT FIT" in hbm.MemoryReport("s", 30, 0, 0, 0, 0, 20.0).format()


def test_fit_drops_axes_that_do_not_divide():
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    assert aot_steps._fit(P(None, "b"), (3, 4), mesh) == P(None, "b")
    assert aot_steps._fit(P(None, "b"), (3, 6), mesh) == P(None, None)  # 4 does not divide 6
    assert aot_steps._fit(P(("a", "b")), (6,), mesh) == P("a")  # keep what divides, in order


@pytest.mark.slow
def test_compiles_on_cpu_devices():
    """The same lowering code on the 8 simulated CPU devices (no libtpu needed)."""
    moe = _tiny_config((1, 2, 2, 2))
    dense = _tiny_config((1, 8, 1, 1), moe=False)
    compiled = []
    for cfg, fn in (
        (dense, functools.partial(aot_steps.compile_lm_train_step, rows=8, seq_len=32, chunk=16)),
        (moe, functools.partial(aot_steps.compile_sample_step, rows=8, cache_len=32, max_new=8)),
    ):
        mesh = sharding.make_mesh(cfg.mesh)
        compiled.append(fn(cfg, mesh, sharding.logical_rules(cfg.mesh)))
    for c in compiled:
        report = hbm.memory_report(c, "cpu", hbm=2.0**30)
        assert report.arguments > 0 and report.total > 0


@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu not installed (pip install libtpu)")
def test_tiny_moe_compiles_for_a_tpu_topology():
    devices = aot.topology_devices("v5e:2x2")
    assert len(devices) == 4 and "TPU" in devices[0].device_kind
    cfg = _tiny_config((1, 2, 1, 2))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    rules = sharding.logical_rules(cfg.mesh)
    chip = hbm.hbm_bytes_per_device("v5e:2x2", len(devices))
    # The real TG train step with the MoE's shard_map (ragged_dot / one-hot experts) on TPU;
    # the sample step's lowering is covered on CPU above (it compiles for TPU the same way).
    shapes = aot_steps.TrainShapes(
        rows=8, seq_len=64, teacher_rows=8, teacher_len=64, prefix_len=64
    )
    train = aot_steps.compile_tg_train_step(cfg, mesh, rules, shapes)
    report = hbm.memory_report(train, "train", chip)
    assert 0 < report.total < chip  # a tiny model: far below a v5e chip's 16 GiB
    assert report.arguments > 0


@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu not installed (pip install libtpu)")
def test_a_split_of_every_host_meshes_chips_that_form_no_box():
    """v5p:4x4x4 (16 hosts of 4 chips), sampler_mesh.num_devices 32: each host's first 2
    chips train, which form no box of the torus (no physical layout of jax.make_mesh); it is
    laid out in device order instead, and each host's last 2 make its sampler mesh."""
    devices = aot.topology_devices("v5p:4x4x4")
    hosts = placement.devices_by_process(devices)
    assert len(hosts) == 16 and {len(h) for h in hosts} == {4}
    cfg = _with_sampler_mesh(_tiny_config((1, 8, 1, 4)), 32)
    meshes = aot.make_meshes(cfg, devices)
    assert meshes.per_host and meshes.own and meshes.hosts == 16
    assert list(meshes.trainer.devices.flat) == [d for h in hosts for d in h[:2]]
    assert list(meshes.sampler.devices.flat) == hosts[0][2:]


def _with_sampler_mesh(cfg, num_devices, shape=(-1, 2)):
    return config_files.apply_overrides(
        cfg, {"sampler_mesh.num_devices": num_devices, "sampler_mesh.shape": shape}
    )


def test_split_devices_last_n_sample():
    devices = jax.devices()
    cfg = _tiny_config((1, 2, 1, 2))
    assert sharding.split_devices(cfg, devices) == (devices, None)  # num_devices 0: colocated
    trainer, sampler = sharding.split_devices(_with_sampler_mesh(cfg, 4), devices)
    assert trainer == devices[:4] and sampler == devices[4:]
    with pytest.raises(ValueError, match="trainer needs at least one"):
        sharding.split_devices(_with_sampler_mesh(cfg, 8), devices)


def test_meshes_colocated_and_split():
    devices = jax.devices()
    colocated = aot.make_meshes(_tiny_config((1, -1, 1, 1)), devices)
    assert not colocated.split and colocated.sampler is colocated.trainer
    assert colocated.trainer.devices.size == 8
    meshes = aot.make_meshes(_with_sampler_mesh(_tiny_config((1, 2, 1, 2)), 4), devices)
    assert meshes.split
    assert list(meshes.trainer.devices.flat) == devices[:4]
    assert list(meshes.sampler.devices.flat) == devices[4:]
    assert dict(meshes.sampler.shape) == {"data": 2, "tensor": 2}
    assert sharding.batch_divisor(meshes.sampler, meshes.sampler_rules) == 2  # rows over data
    rules = dict(meshes.sampler_rules)
    assert rules["heads"] == rules["kv_heads"] == rules["mlp"] == "tensor"


def test_train_shapes_are_the_largest_batch_of_the_config():
    cfg = config_files.apply_overrides(
        _tiny_config((1, 2, 1, 2)),
        {"rl_loop.groups_per_step": 3, "rl_loop.rollouts_per_group": 3, "rl_loop.seq_len": 32},
    )
    shapes = aot.train_shapes(cfg, divisor=4)  # 9 rows padded to 4 x 2 micro-batches
    assert shapes == aot_steps.TrainShapes(16, 32, 16, 64, 32)
    per_turn = config_files.apply_overrides(cfg, {"tg.teacher_mode": "per_turn"})
    assert aot.train_shapes(per_turn, divisor=4).teacher_rows == per_turn.tg.max_teacher_rows
    assert aot.train_shapes(cfg, divisor=4, rows=8, teacher_len=40).teacher_len == 40


@pytest.mark.slow
def test_compile_programs_split_on_cpu():
    """The TG train step on the first 4 devices, the sample step on the last 4 (CPU)."""
    devices = jax.devices()
    cfg = config_files.apply_overrides(_tiny_config((1, 2, 1, 2)), {"rl_loop.seq_len": 32})
    cfg = _with_sampler_mesh(cfg, 4)
    programs = list(aot.compile_programs(cfg, devices, ["train", "sample"], rows=8))
    assert [p.name.split()[0] for p in programs] == ["train", "sample"]
    # The published params' staged copy (trainer) and the sampler's own copy count.
    assert programs[0].resident > 0 and programs[1].resident > 0
    for (_, compiled, mesh, _), want in zip(programs, (devices[:4], devices[4:]), strict=True):
        assert set(mesh.devices.flat) == set(want)
        used = {d for s in jax.tree.leaves(compiled.input_shardings) for d in s.device_set}
        assert used == set(want)
        assert hbm.memory_report(compiled, "cpu", hbm=2.0**30).arguments > 0


def test_architecture_from_config_json_only(tmp_path):
    cfg = config_files.load_config_file(os.path.join(CONFIG_DIR, "hf_tg.py"))
    with pytest.raises(ValueError, match="hf_checkpoint"):
        aot.resolve_architecture(cfg)  # the architecture is unset and no config.json
    hf = json.load(open(os.path.join(CONFIG_DIR, "hf", "qwen3_1p7b", "config.json")))
    (tmp_path / "config.json").write_text(json.dumps(hf))  # no weights, no tokenizer
    resolved = aot.resolve_architecture(
        config_files.apply_overrides(cfg, {"model.hf_checkpoint": str(tmp_path)})
    )
    assert resolved.model.num_layers == 28 and resolved.model.vocab_size == 151_936
    assert resolved.model.max_seq_len == 8192 + 512  # the run's context, not config.json's
    hf["num_hidden_layers"] = 27
    (tmp_path / "config.json").write_text(json.dumps(hf))
    qwen = config_files.load_config_file(os.path.join(CONFIG_DIR, "qwen3_1p7b_tg.py"))
    with pytest.raises(hf_dir.ModelDirError, match="num_layers = 28"):
        aot.resolve_architecture(
            config_files.apply_overrides(qwen, {"model.hf_checkpoint": str(tmp_path)})
        )


@pytest.mark.parametrize(
    "config,arg,hf",
    [
        ("qwen3_1p7b_tg.py", None, "qwen3_1p7b"),
        ("qwen3_coder_30b_a3b_tg.py", None, "qwen3_coder_30b_a3b"),
        ("qwen3_coder_30b_a3b_tg.py", "split", "qwen3_coder_30b_a3b"),
    ],
)
def test_qwen3_configs_match_their_published_config_json(config, arg, hf):
    """configs/hf/*/config.json (the published files) agree with the configs' architecture."""
    cfg = config_files.load_config_file(os.path.join(CONFIG_DIR, config), arg)
    ckpt = os.path.join(CONFIG_DIR, "hf", hf)
    resolved = aot.resolve_architecture(
        config_files.apply_overrides(cfg, {"model.hf_checkpoint": ckpt})
    )
    assert resolved.model.to_dict() == {**cfg.model.to_dict(), "hf_checkpoint": ckpt}
    assert resolved.model.vocab_size == 151_936
    if arg == "split":  # a v5p-128: 16 hosts of 4 chips, each samples on its last 2
        hosts = [list(range(4 * h, 4 * h + 4)) for h in range(16)]
        trainer, sampler = sharding.split_devices(resolved, list(range(64)), hosts)
        assert len(trainer) == 32 and sampler == [4 * h + i for h in range(16) for i in (2, 3)]


@pytest.mark.slow
def test_compile_programs_per_host_samplers_on_cpu():
    """8 CPU devices taken as 2 hosts of 4 (a pod's placement without a split): the train
    step over all 8; the sample step on one host's ("data", "tensor") mesh, for that host's
    half of the rows, with bf16 weight matrices; each beside what stays resident (the host's
    bf16 copy beside the train step, the trainer's params and moments beside the decode)."""
    devices = jax.devices()
    cfg = config_files.apply_overrides(
        _tiny_config((1, -1, 1, 1)),
        {"rl_loop.seq_len": 32, "sampler_mesh.shape": (-1, 2), "model.dtype": "bfloat16"},
    )
    hosts = [devices[:4], devices[4:]]
    meshes = aot.make_meshes(cfg, devices, hosts)
    assert meshes.per_host and not meshes.split and meshes.hosts == 2
    assert list(meshes.sampler.devices.flat) == devices[:4]
    programs = list(aot.compile_programs(cfg, devices, ["train", "sample"], rows=8, hosts=hosts))
    train, sample = programs
    divisor = sharding.batch_divisor(meshes.trainer, meshes.trainer_rules)
    rows = aot.train_shapes(aot.resolve_architecture(cfg), divisor, rows=8).rows
    assert set(train.mesh.devices.flat) == set(devices)
    assert sample.name.startswith(f"sample step ({rows // 2} rows")
    weights = jax.tree.leaves(sample.compiled.args_info[0][0])  # the step's first argument
    assert {a.dtype for a in weights if len(a.shape) >= 2} == {jnp.dtype("bfloat16")}
    assert train.resident > 0 and sample.resident > train.resident  # fp32 + 2 moments vs bf16
    capped = config_files.apply_overrides(cfg, {"sampler_mesh.max_rows": 2})
    (sample,) = aot.compile_programs(capped, devices, ["sample"], rows=8, hosts=hosts)
    assert sample.name.startswith("sample step (2 rows")
    # Each host's last 2 devices its sampler's: the trainer over the first 2 of each host,
    # the bf16 copy staged there beside the train step and the next one beside the decode.
    split = config_files.apply_overrides(cfg, {"sampler_mesh.num_devices": 4})
    meshes = aot.make_meshes(split, devices, hosts)
    assert meshes.per_host and meshes.own and not meshes.split and meshes.hosts == 2
    assert list(meshes.trainer.devices.flat) == devices[:2] + devices[4:6]
    assert list(meshes.sampler.devices.flat) == devices[2:4]
    train, sample = aot.compile_programs(split, devices, ["train", "sample"], rows=8, hosts=hosts)
    divisor = sharding.batch_divisor(meshes.trainer, meshes.trainer_rules)
    rows = aot.train_shapes(aot.resolve_architecture(split), divisor, rows=8).rows
    assert sample.name.startswith(f"sample step ({rows // 2} rows")  # a host's share
    assert set(train.mesh.devices.flat) == set(meshes.trainer.devices.flat)
    model = Transformer(ModelConfig.from_config(aot.resolve_architecture(split).model))
    bf16 = hbm.bytes_per_device(
        aot_steps.in_dtype(
            aot_steps.abstract_params(model, meshes.sampler, meshes.sampler_rules), "bfloat16"
        )
    )
    assert train.resident == sample.resident == bf16 > 0


@pytest.mark.slow
def test_router_replay_adds_its_routing_arrays_to_both_programs():
    """model.router_replay: the train step takes the batch's student and teacher routing
    records, the decode step's cache the sampler's; the compiled arguments grow by exactly
    their int16 bytes per device (rows split `batch_divisor` ways, hand-computed here)."""
    cfg = _tiny_config((1, 2, 2, 2))  # 2 layers, 2 experts per token
    mesh, rules = sharding.make_mesh(cfg.mesh), sharding.logical_rules(cfg.mesh)
    ways = sharding.batch_divisor(mesh, rules)
    shapes = aot_steps.TrainShapes(
        rows=8, seq_len=32, teacher_rows=8, teacher_len=40, prefix_len=32
    )
    sizes = {}
    for replay in (False, True):
        c = config_files.apply_overrides(cfg, {"model.router_replay": replay})
        train = aot_steps.compile_tg_train_step(c, mesh, rules, shapes)
        sample = aot_steps.compile_sample_step(c, mesh, rules, rows=8, cache_len=32, max_new=8)
        sizes[replay] = [hbm.memory_report(p, "cpu", hbm=2.0**30).arguments
                         for p in (train, sample)]  # fmt: skip
    per_token = 2 * 2 * 2  # layers x experts per token x int16 bytes
    want_train = (8 * 32 + 8 * 40) * per_token // ways
    want_sample = 8 * 32 * per_token // ways
    assert sizes[True][0] - sizes[False][0] == want_train
    assert sizes[True][1] - sizes[False][1] == want_sample
