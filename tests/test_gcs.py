"""gs:// through the real clients, against a local GCS (tests/gcs_emulator.py, in memory):
etils epath through gcsfs (tg_jax.paths, metrics), TensorBoard through google-cloud-storage,
orbax's arrays through tensorstore (tg_jax.checkpointing), and the user's command
`python -m tg_jax.main --workdir=gs://...` end to end.

Only ``STORAGE_EMULATOR_HOST`` names the emulator: tg_jax.paths passes it on to tensorstore.
The other variables keep every client off credential discovery (no metadata-server probe):
an emulator takes anonymous requests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from etils.epath import backend as backend_lib

gcsfs = pytest.importorskip("gcsfs")
pytest.importorskip("gcp_storage_emulator")

from tg_jax import checkpointing, paths  # noqa: E402
from tg_jax.metrics import MetricsWriter, read_metrics  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BUCKET = "tg-test"


def _client_env(host: str) -> dict[str, str]:
    return {
        "STORAGE_EMULATOR_HOST": host,  # gcsfs, google-cloud-storage; tensorstore via tg_jax
        "FSSPEC_GCS_TOKEN": "anon",  # gcsfs (as etils opens it): anonymous
        "NO_GCE_CHECK": "true",  # google-auth: no metadata-server probe
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",  # tensorstore: no credential lookup
        # gcsfs's plain client: the extended one first looks up each bucket's layout through a
        # gRPC API the emulator lacks, and waits on it (30 s timeouts) when anonymous.
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """The emulator (a subprocess), this process pointed at it, and bucket BUCKET in it."""
    import fsspec

    log_path = tmp_path_factory.mktemp("gcs") / "emulator.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "gcs_emulator.py")],
            stdout=subprocess.PIPE, stderr=log, text=True,
        )  # fmt: skip
    env_keys = [*_client_env(""), "TENSORSTORE_GCS_HTTP_URL"]
    saved_env = {k: os.environ.get(k) for k in env_keys}
    saved_conf = fsspec.config.conf.get("gcs")
    saved_impl = {}
    try:
        line = proc.stdout.readline()  # "port N" once it listens
        assert line.startswith("port "), f"emulator did not start: {log_path.read_text()[-3000:]}"
        host = f"http://localhost:{int(line.split()[1])}"
        env = _client_env(host)
        os.environ.update(env)
        os.environ.pop("TENSORSTORE_GCS_HTTP_URL", None)  # tg_jax.paths must set it
        fsspec.config.conf["gcs"] = {**(saved_conf or {}), "token": "anon"}
        # The plain client, as GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false picks it at import
        # (gcsfs is imported already): the extended one's layout lookup would wait on gRPC.
        for protocol in ("gcs", "gs"):
            saved_impl[protocol] = fsspec.get_filesystem_class(protocol)
            fsspec.register_implementation(protocol, gcsfs.core.GCSFileSystem, clobber=True)
        backend_lib.fsspec_backend._get_filesystem.cache_clear()  # etils: opened anew
        fs = gcsfs.core.GCSFileSystem(token="anon")
        fs.mkdir(BUCKET)
        yield SimpleNamespace(host=host, env=env, fs=fs, log=log_path, bucket=BUCKET)
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if saved_conf is None:
            fsspec.config.conf.pop("gcs", None)
        else:
            fsspec.config.conf["gcs"] = saved_conf
        for protocol, cls in saved_impl.items():
            fsspec.register_implementation(protocol, cls, clobber=True)
        backend_lib.fsspec_backend._get_filesystem.cache_clear()
        proc.terminate()
        proc.wait(timeout=30)


def _objects(gcs, prefix: str) -> set[str]:
    """Every object under gs://BUCKET/prefix, relative to it, as the plain client lists them."""
    gcs.fs.invalidate_cache()
    root = f"{BUCKET}/{prefix}/"
    return {p[len(root) :] for p in gcs.fs.find(root)}


def test_epath_files_json_and_metrics_on_gcs(gcs, tmp_path):
    run = paths.as_path(f"gs://{BUCKET}/paths")
    assert os.fspath(run) == f"gs://{BUCKET}/paths"
    # tensorstore (orbax's arrays) is given the same emulator as gcsfs.
    assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == gcs.host

    paths.write_json_atomic(run / "a.json", {"x": 1})
    paths.write_json_atomic(run / "a.json", {"x": 2})  # replaces an existing object
    assert paths.read_json(run / "a.json") == {"x": 2}
    (run / "sub").mkdir(parents=True, exist_ok=True)  # no-op on GCS, must not fail
    (run / "sub" / "b.txt").write_text("hello")
    assert (run / "sub").is_dir() and (run / "sub" / "b.txt").exists()
    assert not (run / "missing").exists()
    assert sorted(p.name for p in run.iterdir()) == ["a.json", "sub"]
    (run / "sub" / "b.txt").rename(run / "c.txt")
    assert (run / "c.txt").read_text() == "hello" and not (run / "sub").exists()
    local = tmp_path / "w.bin"
    local.write_bytes(b"\x00\x01")
    paths.as_path(local).copy(run / "w.bin")  # local -> gs:// (exports, base model)
    assert (run / "w.bin").read_bytes() == b"\x00\x01"

    # metrics.jsonl: rewritten per line (no append on GCS), then resumed. (TensorBoard on
    # gs:// is checked in the main job's subprocess: tensorboardX's GCS writer uploads again
    # at interpreter exit, which here would be after the emulator has stopped.)
    with MetricsWriter(run / "m", use_tensorboard=False, enabled=True) as w:
        w.write(1, {"loss": 1.0})
        assert [r["loss"] for r in read_metrics(run / "m")] == [1.0]  # visible before close
        w.write(2, {"loss": 0.5})
    with MetricsWriter(run / "m", use_tensorboard=False, enabled=True) as w:
        w.write(3, {"loss": 0.25}, stage="eval")
    assert [(r["step"], r["loss"]) for r in read_metrics(run / "m")] == [
        (1, 1.0), (2, 0.5), (3, 0.25),
    ]  # fmt: skip

    names = _objects(gcs, "paths")  # what the plain client sees, not epath
    assert {"a.json", "c.txt", "w.bin", "m/metrics.jsonl"} <= names, names
    assert not any(n.endswith(".tmp") for n in names), names
    assert json.loads(gcs.fs.cat(f"{BUCKET}/paths/a.json")) == {"x": 2}
    (run / "m").rmtree()
    assert not (run / "m").exists()


def _state(scale: float):
    return {
        "params": {"w": jnp.arange(12.0).reshape(3, 4) * scale, "b": jnp.ones((4,)) * scale},
        "step": jnp.asarray(int(scale), jnp.int32),
        "key": jax.random.key(int(scale)),
    }


def _assert_state_equal(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_orbax_checkpoints_on_gcs(gcs):
    url = f"gs://{BUCKET}/ckpt"
    with checkpointing.TrainingCheckpointer(url, max_to_keep=2) as ckpt:  # async saves
        assert ckpt.directory == url
        for step in (1, 2, 3):
            ckpt.save(step, _state(step), metadata={"data": {"pos": step}}, force=True)
    names = _objects(gcs, "ckpt")
    assert {n.split("/")[0] for n in names} == {"2", "3"}, names  # step 1 deleted on GCS
    assert any(n.startswith("3/state/") and "ocdbt" in n for n in names), names  # the arrays

    with checkpointing.TrainingCheckpointer(url) as ckpt:  # a fresh process's view
        assert ckpt.all_steps() == [2, 3]
        restored = ckpt.restore_latest(_state(0))
    assert restored.step == 3 and restored.metadata == {"data": {"pos": 3}}
    _assert_state_equal(restored.state, _state(3))
    # The read-only form a later stage uses, given one step directory.
    restored = checkpointing.restore_checkpoint(f"{url}/2", _state(0))
    assert restored.step == 2
    _assert_state_equal(restored.state, _state(2))

    # A newest step whose arrays are gone: set aside (a directory rename on GCS) and the
    # step before it restored.
    gcs.fs.rm(f"{BUCKET}/ckpt/3/state", recursive=True)
    gcs.fs.invalidate_cache()
    with checkpointing.TrainingCheckpointer(url) as ckpt:
        restored = ckpt.restore_latest(_state(0))
        assert restored.step == 2 and ckpt.all_steps() == [2]
    _assert_state_equal(restored.state, _state(2))
    names = _objects(gcs, "ckpt")
    assert any(n.startswith("3.corrupt/") for n in names), names
    assert not any(n.startswith("3/") for n in names), names


@pytest.mark.e2e
def test_the_main_job_with_a_gcs_workdir(gcs, tmp_path):
    """configs/tiny.py's pipeline (data, SFT, the tg arm, held-out evaluation, report) with
    --workdir=gs://...: every output lands in the bucket, nothing in a local `gs:` folder."""
    env = {**os.environ, **gcs.env, "JAX_PLATFORMS": "cpu", "TMPDIR": str(tmp_path)}
    for name in ("TENSORSTORE_GCS_HTTP_URL", "TG_JAX_FAULTS"):
        env.pop(name, None)  # only STORAGE_EMULATOR_HOST names the emulator
    workdir = f"gs://{BUCKET}/run"
    proc = subprocess.run(
        [sys.executable, "-m", "tg_jax.main", f"--config={ROOT}/configs/tiny.py",
         f"--workdir={workdir}",
         "--config.stage=pipeline", "--config.pipeline.arms=('tg',)",
         "--config.rl_loop.eval_every=0"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"report: {workdir}/report/report.md" in proc.stdout
    assert not os.path.exists(tmp_path / "gs:")

    names = _objects(gcs, "run")
    want = {
        "metrics.jsonl", "preregistration.json", "sft_eval.json", "sft/selection.json",
        "report/report.md", "report/results.json",
        "runs/tg_seed0/metrics.jsonl", "runs/tg_seed0/heldout.jsonl",
        "runs/tg_seed0/rl_summary.json",
        "base_model/config.json", "base_model/model.safetensors", "base_model/tokenizer.json",
        "export/tg_seed0/config.json", "export/tg_seed0/model.safetensors",
        "export/tg_seed0/tokenizer.json", "export/tg_seed0/chat_template.jinja",
    }  # fmt: skip
    assert want <= names, sorted(want - names)
    for ckpts, steps in (("sft/checkpoints", {"3", "6"}), ("sft/best", {"6"}),
                         ("runs/tg_seed0/checkpoints", {"3", "4"})):  # fmt: skip
        got = {n[len(ckpts) + 1 :].split("/")[0] for n in names if n.startswith(ckpts + "/")}
        assert got == steps, (ckpts, got)
        for s in steps:
            assert f"{ckpts}/{s}/commit_success.txt" in names
            assert any(n.startswith(f"{ckpts}/{s}/state/ocdbt.process_0/d/") for n in names)
    assert any(n.startswith("report/curve_") and n.endswith(".png") for n in names), names
    assert any(n.startswith("tb/sft/events.out.tfevents") for n in names), names

    report = gcs.fs.cat(f"{BUCKET}/run/report/report.md").decode()
    assert "tg" in report
    rows = read_metrics(f"{workdir}/runs/tg_seed0")
    assert len([r for r in rows if "loss" in r]) == 4  # the 4 RL steps
    # The RL run's last checkpoint, read back through orbax and tensorstore.
    import orbax.checkpoint as ocp

    last = paths.as_path(f"{workdir}/runs/tg_seed0/checkpoints/4/state")
    state = ocp.PyTreeCheckpointer().restore(last)
    leaves = jax.tree.leaves(state["params"])
    assert leaves and all(np.isfinite(np.asarray(x)).all() for x in leaves)
    # Task data stays local for a gs:// workdir (array_record writes local files only).
    assert os.path.isdir(tmp_path / "tg_jax" / "tfds")


def test_a_command_line_report_to_gcs(gcs):
    """`python -m tg_jax.evaluation.swe_protocol --out gs://...` (2 tasks): its JSON and
    Markdown land in the bucket (the evaluation commands write through tg_jax.paths)."""
    from tg_jax.evaluation import swe_protocol

    argv = ["--num_tasks", "2", "--n_boot", "20", "--no_progress", "--out", f"gs://{BUCKET}/swe"]
    assert swe_protocol.main(argv) == 0
    assert _objects(gcs, "swe") == {swe_protocol.JSON_FILE, swe_protocol.MD_FILE}
    doc = paths.read_json(f"gs://{BUCKET}/swe/{swe_protocol.JSON_FILE}")
    assert doc["num_tasks"] == 2 and doc["figures"]


# A gloo collective stuck for 10 minutes fails the workers (tg_jax.tpu.distributed.
# collective_timeout) instead of hanging to the timeout below.
@pytest.mark.multiprocess
@pytest.mark.timeout(2400)
def test_local_pods_with_a_gcs_workdir_train_what_one_process_trains(gcs, tmp_path):
    """The pod rehearsal as a user runs it: `launch/tpu.sh --local` with
    `configs/qwen3_coder_30b_a3b_tg.py:runlocal_split` from a tiny Qwen3-MoE checkpoint, 2
    processes x 4 CPU devices (each samples on its last 2, one trainer mesh over the first 2 of
    each), --workdir=gs://... on the local GCS emulator. SIGTERM to one worker once checkpoint
    1 is committed in the bucket: both stop (exit 143), the same command resumes; after 4 RL
    steps the pod's export equals an uninterrupted 1 x 8 run's within 1e-5, and both
    processes' checkpoint shards, the metrics (one writer), the report (once) and the export
    are in the bucket (tests/test_launch.py `_pods_train_what_one_process_trains`). The
    colocated layout on 2 processes x 4 equals 1 x 8 in tests/test_multihost.py (the tiny
    config) and runs the worker command in tests/test_launch.py."""
    from tests.test_launch import _pods_train_what_one_process_trains

    pods = {"split": (2, "runlocal_split", 1, 2)}
    _pods_train_what_one_process_trains(tmp_path, pods, gcs)
