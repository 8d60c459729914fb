"""Tests for tg_jax.metrics and tg_jax.progress."""

import dataclasses
import glob
import importlib.machinery
import importlib.util
import io
import json
import os
import struct
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from tg_jax.metrics import LaggedMetrics, MetricsWriter, last_per_step, read_metrics
from tg_jax.progress import ProgressBar, format_duration


def _tb_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """Parses TensorBoard event files (TFRecord framing) without TensorFlow."""
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        data = open(path, "rb").read()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_write_jsonl_and_tensorboard(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.write(1, {"loss": jnp.float32(0.5), "pass_rate": np.float64(0.25), "n": 3})
        writer.write(2, {"loss": 0.25, "ok": jnp.array(True)}, stage="train")
        writer.write(2, {"pass_rate": jnp.array([0.75])}, stage="eval")
    records = read_metrics(tmp_path)
    assert [(r["step"], r["stage"]) for r in records] == [(1, "train"), (2, "train"), (2, "eval")]
    assert records[0]["loss"] == 0.5 and records[0]["pass_rate"] == 0.25 and records[0]["n"] == 3
    assert isinstance(records[0]["n"], int) and records[1]["ok"] == 1
    assert all(isinstance(r["time"], float) for r in records)
    assert read_metrics(tmp_path, stage="eval") == [records[2]]

    train = _tb_scalars(str(tmp_path / "tb" / "train"))
    assert train["loss"] == [(1, 0.5), (2, 0.25)]
    assert train["n"] == [(1, 3.0)]
    assert _tb_scalars(str(tmp_path / "tb" / "eval")) == {"pass_rate": [(2, 0.75)]}


def test_write_rejects_bad_values(tmp_path):
    with MetricsWriter(tmp_path, use_tensorboard=False) as writer:
        with pytest.raises(ValueError, match="metric 'v' is not a scalar: shape \\(2,\\)"):
            writer.write(1, {"v": jnp.zeros(2)})
        with pytest.raises(ValueError, match="'step' is reserved"):
            writer.write(1, {"step": 1})
    assert not os.path.exists(tmp_path / "tb")


def test_nested_and_struct_metrics_are_named_by_path(tmp_path):
    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Metrics:
        loss: jax.Array
        kl: dict

    with MetricsWriter(tmp_path, use_tensorboard=False) as writer:
        record = writer.write(7, Metrics(jnp.float32(1.0), {"tg": jnp.float32(0.5)}))
    assert record["loss"] == 1.0 and record["kl/tg"] == 0.5


def test_appends_across_writers_and_torn_last_line(tmp_path):
    with MetricsWriter(tmp_path, use_tensorboard=False) as writer:
        writer.write(1, {"x": 1.0})
        writer.write(2, {"x": 2.0})
    # A resumed run logs step 2 again.
    with MetricsWriter(tmp_path, use_tensorboard=False) as writer:
        writer.write(2, {"x": 2.5})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "sta')  # killed mid-write
    records = read_metrics(tmp_path)
    assert [r["x"] for r in records] == [1.0, 2.0, 2.5]
    assert [r["x"] for r in last_per_step(records)] == [1.0, 2.5]

    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write("\n" + json.dumps({"step": 4, "stage": "train", "time": 0.0}) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:4: not a JSON line"):
        read_metrics(tmp_path)


def test_disabled_writer_writes_nothing(tmp_path):
    with MetricsWriter(tmp_path / "w", enabled=False) as writer:
        assert writer.write(1, {"x": 1.0})["x"] == 1.0
    assert not os.path.exists(tmp_path / "w")


@pytest.fixture
def wandb_calls(monkeypatch):
    """A fake `wandb` module in sys.modules; the list of its init / log / finish calls."""
    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return calls


def test_wandb_only_when_configured(tmp_path, monkeypatch, wandb_calls):
    calls = wandb_calls
    with MetricsWriter(tmp_path, use_tensorboard=False):
        pass
    assert calls == []
    with MetricsWriter(tmp_path, use_tensorboard=False, wandb_config={"project": "p"}) as w:
        w.write(3, {"loss": 0.5}, stage="eval")
    assert calls == [("init", {"project": "p"}), ("log", {"eval/loss": 0.5}, 3), ("finish",)]

    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    with pytest.raises(ImportError, match="wandb is not installed"):
        MetricsWriter(tmp_path, wandb_config={"project": "p"})


def test_lagged_metrics_fetch_one_step_late(tmp_path):
    step_fn = jax.jit(lambda x: (x + 1, {"loss": x.sum(), "max": x.max()}))
    with MetricsWriter(tmp_path, use_tensorboard=False) as writer:
        lagged = LaggedMetrics(writer)
        x = jnp.zeros(4)
        returned = []
        for step in range(1, 4):
            x, metrics = step_fn(x)
            returned.append(lagged.push(step, metrics))
            # The step just dispatched is never written before the next one is.
            assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, step))
        assert returned[0] is None
        assert returned[1] == (1, {"loss": 0.0, "max": 0.0})
        assert returned[2] == (2, {"loss": 4.0, "max": 1.0})
        assert lagged.flush() == (3, {"loss": 8.0, "max": 2.0})
        assert lagged.flush() is None
    assert [r["loss"] for r in read_metrics(tmp_path)] == [0.0, 4.0, 8.0]


def test_progress_lines_when_not_a_tty():
    out = io.StringIO()
    with ProgressBar(10, initial=2, keys=("loss",), log_every=4, stream=out) as bar:
        for step in range(3, 11):
            bar.update(step, {"loss": 1.0 / step, "ignored": 5})
    lines = out.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == ["4/10", "8/10", "10/10"]
    assert "loss=0.25 " in lines[0] + " " and "eta" in lines[0] and "ignored" not in out.getvalue()
    assert "(100%)" in lines[-1]


def test_progress_close_prints_unprinted_last_step():
    out = io.StringIO()
    bar = ProgressBar(100, log_every=50, stream=out)
    bar.update(7)
    bar.close()
    assert out.getvalue().split()[2] == "7/100"


def test_progress_disabled_and_tqdm_modes():
    quiet = io.StringIO()
    with ProgressBar(5, enabled=False, stream=quiet, use_tqdm=True) as bar:
        for step in range(1, 6):
            bar.update(step, {"loss": 1.0})
    assert quiet.getvalue() == ""

    out = io.StringIO()
    with ProgressBar(5, keys=("loss",), stream=out, use_tqdm=True) as bar:
        for step in range(1, 6):
            bar.update(step, {"loss": 0.5})
    assert "5/5" in out.getvalue() and "loss=0.5" in out.getvalue()


def test_format_duration():
    assert [format_duration(s) for s in (5, 185, 7620)] == ["5s", "3m05s", "2h07m"]


def test_rl_runs_log_to_the_wandb_project_the_config_names(tmp_path, monkeypatch, wandb_calls):
    """rl_loop.wandb_project: the RL stage's writer opens one wandb run per arm and seed (the
    config attached; its id from the workdir, so a resumed run continues it) and logs there
    what metrics.jsonl gets; "" opens none; set without wandb installed, the config is
    refused at start-up."""
    from tg_jax import config_files
    from tg_jax.train import rl
    from tg_jax.train.loop_settings import LoopConfig

    calls = wandb_calls
    cfg = config_files.apply_overrides(
        config_files.load_config_file("configs/default.py"), {"rl_loop.wandb_project": "tg-runs"}
    )
    LoopConfig.from_config(cfg.rl_loop)  # the start-up check passes: wandb is there
    parts = types.SimpleNamespace(config=cfg, workdir=str(tmp_path), arm_name="tg", seed=3)
    first = types.SimpleNamespace(figures={"student_max": 1e-7})  # self_tests.run figures
    with rl._metrics_writer(parts, first):
        pass
    (_, kw), log, finish = calls
    assert kw["project"] == "tg-runs" and kw["name"] == "tg_seed3" and kw["resume"] == "allow"
    assert kw["config"]["rl_loop"]["wandb_project"] == "tg-runs"
    assert kw["id"] == rl.wandb_settings(cfg, str(tmp_path), "tg", 3)["id"]  # resumes it
    assert kw["id"] != rl.wandb_settings(cfg, str(tmp_path / "other"), "tg", 3)["id"]
    assert log == ("log", {"selftest/student_max": 1e-7}, 0) and finish == ("finish",)
    off = config_files.apply_overrides(cfg, {"rl_loop.wandb_project": ""})
    assert rl.wandb_settings(off, str(tmp_path), "tg", 3) is None
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match=r"rl_loop.wandb_project 'tg-runs' needs wandb"):
        LoopConfig.from_config(cfg.rl_loop)
