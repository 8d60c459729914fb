"""gs:// user paths stay URLs (tg_jax.paths): nothing becomes a local folder named ``gs:``.

The fake GCS is an etils epath backend: ``gpath._PREFIX_TO_BACKEND["gs"]`` (the table epath
picks a backend from by URL scheme) is replaced by an ``os`` backend that maps
``gs://bucket/x`` onto ``<tmp>/gcs/bucket/x``, so every epath call on a gs:// path lands
there. Orbax's array writes (tensorstore) bypass epath, so checkpointing is checked at the
orbax constructor instead.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from etils.epath import backend as backend_lib
from etils.epath import gpath

from tg_jax import checkpointing, paths
from tg_jax.data import task_data, tfds_builders
from tg_jax.evaluation import protocol
from tg_jax.metrics import MetricsWriter, read_metrics
from tg_jax.notebook import demo_workdir, results_view

_ONE_PATH = ("open", "exists", "isdir", "listdir", "makedirs", "mkdir", "rmtree", "remove", "stat")


class _FakeGcs(backend_lib._OsPathBackend):
    """epath's os backend with gs://bucket/x mapped onto root/bucket/x."""

    def __init__(self, root: str):
        self.root = root

    def local(self, path) -> str:
        path = os.fspath(path)
        if path.startswith(self.root):  # the os backend calls itself on mapped paths
            return path
        assert path.startswith("gs://"), path
        return os.path.join(self.root, path[len("gs://") :])

    def url(self, path: str) -> str:
        return "gs://" + os.path.relpath(path, self.root)

    def glob(self, path):
        return [self.url(p) for p in super().glob(self.local(path))]

    def walk(self, path, **kwargs):
        for root, dirs, files in super().walk(self.local(path), **kwargs):
            yield self.url(root), dirs, files

    def rename(self, path, dst):
        super().rename(self.local(path), self.local(dst))

    def replace(self, path, dst):
        super().replace(self.local(path), self.local(dst))

    def copy(self, path, dst, overwrite):
        super().copy(self.local(path), self.local(dst), overwrite)


def _one_path(name):
    def method(self, path, *args, **kwargs):
        return getattr(backend_lib._OsPathBackend, name)(self, self.local(path), *args, **kwargs)

    return method


for _name in _ONE_PATH:
    setattr(_FakeGcs, _name, _one_path(_name))


@pytest.fixture
def gcs(tmp_path, monkeypatch):
    """The fake GCS root; cwd is an empty directory that must stay empty."""
    root = tmp_path / "gcs"
    root.mkdir()
    monkeypatch.setitem(gpath._PREFIX_TO_BACKEND, "gs", _FakeGcs(str(root)))
    monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield root
    assert not os.path.exists(cwd / "gs:")
    assert os.listdir(cwd) == []


def test_as_path_keeps_urls_and_makes_local_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert paths.is_url("gs://bucket/run") and not paths.is_url("run/gs:x")
    assert os.fspath(paths.as_path("gs://bucket/run")) == "gs://bucket/run"
    assert os.fspath(paths.as_path("gs://bucket/run") / "metrics.jsonl") == (
        "gs://bucket/run/metrics.jsonl"
    )
    assert os.fspath(paths.as_path("run")) == str(tmp_path / "run")


def test_metrics_jsonl_on_gcs_is_rewritten_and_resumed(gcs):
    with MetricsWriter("gs://bucket/run", use_tensorboard=False, enabled=True) as w:
        w.write(1, {"loss": 1.0})
        # Visible before close: each line rewrites the object (object stores have no append).
        assert len(read_metrics("gs://bucket/run")) == 1
        w.write(2, {"loss": 0.5})
    with MetricsWriter("gs://bucket/run", use_tensorboard=False, enabled=True) as w:
        w.write(3, {"loss": 0.25}, stage="eval")
    records = read_metrics("gs://bucket/run")
    assert [(r["step"], r["stage"], r["loss"]) for r in records] == [
        (1, "train", 1.0), (2, "train", 0.5), (3, "eval", 0.25),
    ]  # fmt: skip
    assert len((gcs / "bucket/run/metrics.jsonl").read_text().splitlines()) == 3


def test_tensorboard_to_gcs_needs_google_cloud_storage(gcs, monkeypatch):
    from tensorboardX import record_writer

    # As on a machine without google-cloud-storage (the test extra brings it, with gcsfs).
    monkeypatch.setattr(record_writer, "GCS_ENABLED", False)
    with MetricsWriter("gs://bucket/run", use_tensorboard=True, enabled=True) as w:
        with pytest.raises(ImportError, match="google-cloud-storage"):
            w.write(1, {"loss": 1.0})


def test_report_results_and_metrics_on_gcs(gcs):
    url = demo_workdir.make_demo_workdir(
        "gs://bucket/demo", steps=8, eval_every=4, num_tasks=6, n_boot=50
    )
    assert url == "gs://bucket/demo"
    report_dir = gcs / "bucket/demo/report"
    assert {"results.json", "report.md", "heldout_differences.png"} <= set(os.listdir(report_dir))
    assert (report_dir / "heldout_differences.png").read_bytes()[:4] == b"\x89PNG"
    assert results_view.find_results_file(url) == "gs://bucket/demo/report/results.json"
    res = results_view.load_results(url)
    assert res == json.loads((report_dir / "results.json").read_text())
    runs = results_view.load_run_metrics(url)
    assert runs and all(k.startswith("runs/") for k in runs)


def test_preregistration_on_gcs(gcs):
    import ml_collections

    config = ml_collections.ConfigDict(
        {"eval": {"margin": -0.05, "floor": 0.5, "collapse_drop": 0.1, "baseline": "grpo",
                  "candidate": "tg", "level": 0.9}}
    )  # fmt: skip
    arms = {"grpo": ml_collections.ConfigDict({"a": 1}), "tg": ml_collections.ConfigDict({"a": 2})}
    out = protocol.preregister(config, "gs://bucket/w", arms)
    assert out["path"] == "gs://bucket/w/preregistration.json"
    stored = json.loads((gcs / "bucket/w/preregistration.json").read_text())
    assert stored == protocol.preregistration(config, arms)
    assert not os.path.exists(gcs / "bucket/w/preregistration.json.tmp")


def test_checkpointer_passes_the_url_to_orbax(gcs, monkeypatch):
    seen = []

    class Recorder:
        def __init__(self, directory, **kwargs):
            seen.append(directory)

        def close(self):
            pass

    monkeypatch.setattr(checkpointing.ocp, "CheckpointManager", Recorder)
    checkpointing.TrainingCheckpointer("gs://bucket/run/checkpoints").close()
    (gcs / "bucket/sft/7/state").mkdir(parents=True)
    checkpointing.TrainingCheckpointer("gs://bucket/sft", read_only=True).close()
    assert [os.fspath(d) for d in seen] == ["gs://bucket/run/checkpoints", "gs://bucket/sft"]
    with pytest.raises(checkpointing.CheckpointError, match="gs://bucket/missing does not"):
        checkpointing.TrainingCheckpointer("gs://bucket/missing", read_only=True)


def test_task_data_on_gcs_is_a_clear_error_and_the_stage_stays_local(gcs):
    with pytest.raises(ValueError, match="array_record writes local files only"):
        tfds_builders.prepare_task_dataset(
            "gs://bucket/w/tfds", config_name="c", generate=lambda split: iter(())
        )
    assert not paths.is_url(task_data.tasks_dir("gs://bucket/w"))
    assert task_data.tasks_dir("w") == os.path.join("w", task_data.TFDS_DIR)


def test_relative_local_workdir_still_works(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with MetricsWriter("rel/run", use_tensorboard=False, enabled=True) as w:
        w.write(1, {"loss": 1.0})
    assert [r["loss"] for r in read_metrics("rel/run")] == [1.0]
    assert (tmp_path / "rel/run/metrics.jsonl").exists()
    state = {"w": np.arange(3, dtype=np.float32)}
    with checkpointing.TrainingCheckpointer("rel/ck", async_save=False) as ckpt:
        assert ckpt.directory == str(tmp_path / "rel/ck")
        ckpt.save(1, state, metadata={"k": 1}, force=True)
    restored = checkpointing.restore_checkpoint("rel/ck/1", state)
    assert restored.step == 1 and restored.metadata == {"k": 1}
    np.testing.assert_array_equal(restored.state["w"], state["w"])
