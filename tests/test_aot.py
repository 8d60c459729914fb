"""Ahead-of-time compilation: memory accounting, and small compiles on CPU and (libtpu) TPU."""

import functools
import importlib.util
import os

import jax
import pytest
from jax.sharding import PartitionSpec as P

from tg_jax import config_lib, sharding
from tg_jax.tpu import aot

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "configs")
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None


def _tiny_config(mesh_shape, moe=True):
    cfg = config_lib.load_config_file(os.path.join(CONFIG_DIR, "default.py"))
    tiny = dict(
        vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        max_seq_len=64, mlp_dim=32,
    )  # fmt: skip
    if moe:
        tiny.update(mlp_dim=0, num_experts=8, experts_per_token=2, moe_mlp_dim=16)
    overrides = {f"model.{k}": v for k, v in tiny.items()}
    return config_lib.apply_overrides(
        cfg, {**overrides, "mesh.shape": mesh_shape, "rl.micro_batches": 2}
    )


def test_hbm_per_device():
    gib = aot.GIB
    assert aot.hbm_bytes_per_device("v5p:2x4x4", 32) == 95 * gib  # megacore: a device = a chip
    assert aot.hbm_bytes_per_device("v4:2x2x2", 16) == 16 * gib  # v4 devices are TensorCores
    assert aot.hbm_bytes_per_device("v5e:4x4", 16) == 16 * gib
    with pytest.raises(ValueError, match="Unknown TPU kind"):
        aot.hbm_bytes_per_device("v9:2x2", 4)


def test_memory_report_total_counts_donated_buffers_once():
    r = aot.MemoryReport("step", arguments=10, outputs=8, aliased=6, temps=3, code=1, hbm=20.0)
    assert r.total == 16
    assert "fits" in r.format() and "80%" in r.format()
    assert "DOES NOT FIT" in aot.MemoryReport("s", 30, 0, 0, 0, 0, 20.0).format()


def test_fit_drops_axes_that_do_not_divide():
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    assert aot._fit(P(None, "b"), (3, 4), mesh) == P(None, "b")
    assert aot._fit(P(None, "b"), (3, 6), mesh) == P(None, None)  # 4 does not divide 6
    assert aot._fit(P(("a", "b")), (6,), mesh) == P("a")  # keep what divides, in order


def test_compiles_on_cpu_devices():
    """The same lowering code on the 8 simulated CPU devices (no libtpu needed)."""
    moe = _tiny_config((1, 2, 2, 2))
    dense = _tiny_config((1, 8, 1, 1), moe=False)
    compiled = []
    for cfg, fn in (
        (dense, functools.partial(aot.compile_lm_train_step, rows=8, seq_len=32, chunk=16)),
        (moe, functools.partial(aot.compile_sample_step, rows=8, cache_len=32, max_new=8)),
    ):
        mesh = sharding.make_mesh(cfg.mesh)
        compiled.append(fn(cfg, mesh, sharding.logical_rules(cfg.mesh)))
    for c in compiled:
        report = aot.memory_report(c, "cpu", hbm=2.0**30)
        assert report.arguments > 0 and report.total > 0


@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu not installed (pip install libtpu)")
def test_tiny_moe_compiles_for_a_tpu_topology():
    devices = aot.topology_devices("v5e:2x2")
    assert len(devices) == 4 and "TPU" in devices[0].device_kind
    cfg = _tiny_config((1, 2, 1, 2))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    rules = sharding.logical_rules(cfg.mesh)
    hbm = aot.hbm_bytes_per_device("v5e:2x2", len(devices))
    # The real TG train step with the MoE's shard_map (ragged_dot / one-hot experts) on TPU;
    # the sample step's lowering is covered on CPU above (it compiles for TPU the same way).
    train = aot.compile_tg_train_step(cfg, mesh, rules, rows=8, seq_len=64, teacher_len=64)
    report = aot.memory_report(train, "train", hbm)
    assert 0 < report.total < hbm  # a tiny model: far below a v5e chip's 16 GiB
    assert report.arguments > 0
