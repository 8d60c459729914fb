"""The local pod (the TPU launcher's rehearsal on CPU processes) and the distributed set-up;
the launcher's rules (retries, dry run, dirty tree, install) are in tests/test_tpu_launcher.py."""

import os

import jax
import numpy as np
import pytest

from tests import compile_settings
from tg_jax.tpu import distributed, launch, pod_commands


def test_distributed_env():
    assert not distributed.requested({})
    assert distributed.requested({"TG_JAX_DISTRIBUTED": "1"})
    assert distributed.initialize_kwargs({}) == {}  # Cloud TPU: auto-detected
    env = {
        "TG_JAX_COORDINATOR": "10.0.0.2:1234", "TG_JAX_NUM_PROCESSES": "4",
        "TG_JAX_PROCESS_ID": "3",
    }  # fmt: skip
    assert distributed.initialize_kwargs(env) == {
        "coordinator_address": "10.0.0.2:1234", "num_processes": 4, "process_id": 3,
    }  # fmt: skip
    assert not distributed.initialize_from_env({})  # no flag: nothing happens


def test_local_pod_arguments_need_no_cloud():
    job, args = launch.parse_args(
        ["--local", "--processes=3", "--devices-per-process=2", "--config=configs/tiny.py",
         "--workdir=/tmp/w", "--", "--config.rl_loop.steps=2"]
    )  # fmt: skip
    assert args.local and (args.processes, args.devices_per_process) == (3, 2)
    assert pod_commands.worker_args(job, "/c") == [
        "--config=configs/tiny.py", "--workdir=/tmp/w", "--config.rl_loop.steps=2",
        "--config.model.hf_checkpoint=/c",
    ]  # fmt: skip
    with pytest.raises(SystemExit):  # a pod launch still needs its zone and topology
        launch.parse_args(["--config=configs/tiny.py", "--workdir=gs://b/w"])


def test_local_pod_stops_every_worker_once_one_fails_and_labels_their_lines(
    tmp_path, monkeypatch, capfd
):
    """The launcher's supervision, with tests/pod_worker_stub.py as the workers: worker 1 of 3
    fails (exit 3) while 0 and 2 would wait 10 minutes; the launcher stops them at once and
    exits 3, and every line a worker printed reaches the launcher's stream it was printed to,
    labelled with the worker's number."""
    import time

    monkeypatch.chdir(os.path.join(os.path.dirname(__file__), ".."))
    (tmp_path / "marks").mkdir()
    monkeypatch.setenv("TG_JAX_TEST_STUB_DIR", str(tmp_path / "marks"))
    job, _ = launch.parse_args(["--local", "--config=configs/tiny.py", f"--workdir={tmp_path}"])
    start = time.monotonic()
    code = launch.local_pod(job, 3, 1, stage_dir=str(tmp_path), module="tests.pod_worker_stub")
    assert code == 3 and time.monotonic() - start < 120
    out, err = capfd.readouterr()
    for i in range(3):
        assert f"[w{i}] worker {i} starts\n" in out, out
    assert "[w1] worker 1 fails\n" in err and "fails" not in out
    assert "[local pod] worker 0 exited with -15" in out  # SIGTERM
    assert "[local pod] worker 1 exited with 3" in out


def _pod_command(tmp_path, *extra, workdir=None):
    from tests.hf_checkpoints import make_model_dir
    from tests.test_hf_run import DENSE

    ckpt = tmp_path / "ckpt"
    if not ckpt.exists():
        make_model_dir(ckpt, DENSE)
    # The workers' device counts are the launcher's; the quick compile flags stay.
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    env.update(compile_settings.with_quick_flags({}))
    cmd = ["bash", "launch/tpu.sh", "--local", "--processes=2", "--devices-per-process=4",
           "--config=configs/hf_tg.py:runlocal", f"--workdir={workdir or tmp_path / 'w'}",
           f"--hf-checkpoint={ckpt}", "--", *extra]  # fmt: skip
    return cmd, {"cwd": os.path.join(os.path.dirname(__file__), ".."), "env": env, "text": True}


def _local_pod(tmp_path, *extra):
    import subprocess

    cmd, kw = _pod_command(tmp_path, *extra)
    proc = subprocess.run(cmd, capture_output=True, timeout=1400, **kw)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "process 1/2: 4 local of 8 devices" in proc.stdout
    staged = tmp_path / "home" / ".cache" / "tg_jax" / "local_pod" / "local"
    for i in (0, 1):
        assert (staged / f"worker{i}" / "hf_checkpoint" / "model.safetensors").exists()
    return proc


@pytest.mark.multiprocess
def test_local_pod_runs_the_worker_command_on_two_processes(tmp_path):
    """`launch/tpu.sh --local`: 2 workers x 4 CPU devices join one JAX runtime of 8 devices,
    each from its own staged copy of the checkpoint (the forward stage: one sharded pass)."""
    proc = _local_pod(tmp_path, "--config.stage=forward")
    # Counted, not split in lines: the two workers share the pipe, and one's line can land in
    # the middle of the other's.
    out = proc.stdout
    assert out.count("forward ok") == 2 and out.count("'fsdp': 8") == 2, out[-2000:]


def _worker_pid(workdir, process_id: int) -> int | None:
    """The pid of the local pod's worker `process_id` running on `workdir` (from /proc)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if (
            b"tg_jax.main" in cmd
            and f"--workdir={workdir}".encode() in cmd
            and (f"TG_JAX_PROCESS_ID={process_id}".encode() in env)
        ):
            return int(entry)
    return None


# Opt-in until 2026-12-08 (1 of 6 runs ended in the resumed final evaluation on a worker's
# heartbeat timeout); since the final evaluation is split over the processes, 5 of 5 passed.
@pytest.mark.multiprocess
def test_local_pod_of_the_whole_host_split_through_a_sigterm_trains_what_one_process_trains(
    tmp_path,
):
    """`configs/qwen3_coder_30b_a3b_tg.py:runlocal_whole`, the whole-host split, 4 processes x 2
    devices (processes 0 and 1 train, 2 and 3 sample), SIGTERM to worker 3 (a sampler process)
    once checkpoint 1 is written (`_pods_train_what_one_process_trains`)."""
    _pods_train_what_one_process_trains(tmp_path, {"whole": (4, "runlocal_whole", 3, 2)})


@pytest.mark.multiprocess
def test_local_pod_with_slow_tools_trains_and_evaluates_what_one_process_does(tmp_path):
    """`configs/qwen3_coder_30b_a3b_tg.py:runlocal`, colocated (each process samples on its 4
    devices, one trainer mesh of 8), 2 processes x 4 devices with every tool call slowed
    (`SLOW_TOOLS`), run through without a stop: it trains and evaluates on the held-out tasks
    what 1 x 8 does (`_pods_train_what_one_process_trains`; the launcher's SIGTERM and resume:
    the split layout's pod in tests/test_gcs.py)."""
    _pods_train_what_one_process_trains(tmp_path, {"colocated": (2, "runlocal", None, 2)})


# The pods' RL steps: checkpoint 1, the SIGTERM while a later step runs, then a resumed session.
POD_STEPS = 4
# The pods' fault (tg_jax.faults): every tool call sleeps a heavy-tailed time seeded per
# process, so the hosts' tools return at other times (the final evaluation must not care).
SLOW_TOOLS = "env.slow@1+"


def _pods_train_what_one_process_trains(tmp_path, pods, gcs=None) -> None:
    """`configs/qwen3_coder_30b_a3b_tg.py` from a tiny Qwen3-MoE checkpoint on each local pod
    of `pods` ({name: (processes, config argument, the worker to SIGTERM or None, the
    processes that save checkpoints: the first N)}), then each on 1 process x 8, uninterrupted
    (the split layouts' as `:runlocal_split`, whose last 4 devices sample). A pod with a worker
    to SIGTERM stops at the step its workers agree on (exit 143), and the same command resumes.
    Every pod's tool calls sleep (`SLOW_TOOLS`), every worker's. Every run exports the same
    weights after POD_STEPS deterministic RL steps, moved from the checkpoint, and its final
    evaluation has the same held-out episodes, outcome for outcome (heldout.jsonl, each process
    having played its share of the tasks); each pod logged each weight sync's seconds, one
    record a step, and trained with MoE router replay (the config's), each rollout's routing
    recorded. With `gcs` (tests/test_gcs.py's emulator) the pods' workdirs are
    gs://BUCKET/<name>: every process's checkpoint shards, the metrics,
    the report and the export are written there, the report once."""
    import subprocess

    from safetensors.numpy import load_file

    from tests.hf_checkpoints import make_model_dir
    from tests.test_hf_run import MOE
    from tg_jax import paths
    from tg_jax.evaluation.heldout import load_records
    from tg_jax.metrics import read_metrics, read_rl_summary

    ckpt = tmp_path / "ckpt"
    make_model_dir(ckpt, MOE)
    root = os.path.join(os.path.dirname(__file__), "..")

    def workdir(name):
        return f"gs://{gcs.bucket}/{name}" if gcs and name in pods else str(tmp_path / name)

    def start(name, p, layout):
        extra = [f"--config.rl_loop.steps={POD_STEPS}",
                 f"--config.optim.total_steps={POD_STEPS}", "--config.eval.num_tasks=2",
                 "--config.rl_loop.checkpoint_every=1",
                 "--config.rl_loop.async_sampling=False"]  # fmt: skip
        if layout != "runlocal":  # the split layouts' trainer mesh: 4 devices
            extra.insert(0, "--config.mesh.shape=(1,2,2,1)")
        env = {**os.environ, **(gcs.env if gcs else {}), "HOME": str(tmp_path / f"home_{name}")}
        for var in ("TENSORSTORE_GCS_HTTP_URL", "TG_JAX_FAULTS"):
            env.pop(var, None)
        if name in pods:
            env["TG_JAX_FAULTS"] = SLOW_TOOLS
        env.update(compile_settings.with_quick_flags({}))  # device counts: the launcher's
        cmd = ["bash", "launch/tpu.sh", "--local", f"--processes={p}",
               f"--devices-per-process={8 // p}",
               f"--config=configs/qwen3_coder_30b_a3b_tg.py:{layout}",
               f"--workdir={workdir(name)}", f"--hf-checkpoint={ckpt}",
               "--", *extra]  # fmt: skip
        return subprocess.Popen(
            cmd, cwd=root, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )

    def export(name):
        local = tmp_path / f"export_{name}.safetensors"
        weights = f"{workdir(name)}/export/tg_seed0/model.safetensors"
        local.write_bytes(paths.as_path(weights).read_bytes())
        return load_file(str(local))

    def reference(layout):  # the 1 x 8 run a pod of `layout` equals
        return "runlocal" if layout == "runlocal" else "runlocal_split"

    def committed(name):  # checkpoint 1 complete (on GCS orbax's commit_success.txt marks it)
        if not gcs:
            return (tmp_path / name / "runs/tg_seed0/checkpoints/1").is_dir()
        gcs.fs.invalidate_cache()
        return gcs.fs.exists(f"{gcs.bucket}/{name}/runs/tg_seed0/checkpoints/1/commit_success.txt")

    # One run at a time: with the 1 x 8 run beside the pod, in the full suite beside a long
    # RL run on 2 cores, both pod workers once aborted in the coordination service
    # (CoordinationServiceAgent::SetError) before the first checkpoint; cause not found.
    outs = {}
    for name, (p, layout, victim, _) in pods.items():
        if victim is None:
            pod = start(name, p, layout)
            outs[name] = pod.communicate(timeout=1200)[0]
            assert pod.returncode == 0, _why(outs[name])
            continue
        outs[name] = _pod_through_sigterm(
            workdir(name), lambda n=name, p=p, lay=layout: start(n, p, lay), p, victim,
            lambda n=name: committed(n),
        )  # fmt: skip
    ones, heldouts = {}, {}  # the 1 x 8 runs
    for layout in sorted({reference(lay) for _, lay, _, _ in pods.values()}):
        one = start(f"one_{layout}", 1, layout)
        out = one.communicate(timeout=1200)[0]
        assert one.returncode == 0, _why(out)
        ones[layout] = export(f"one_{layout}")
        heldouts[layout] = load_records(f"{workdir(f'one_{layout}')}/runs/tg_seed0/heldout.jsonl")
    start_w = load_file(str(ckpt / "model.safetensors"))
    for name, (p, layout, victim, savers) in pods.items():
        one_w = ones[reference(layout)]
        assert max(float(np.abs(one_w[k] - start_w[k]).max()) for k in one_w) > 1e-5
        run = f"{workdir(name)}/runs/tg_seed0"
        summary = read_rl_summary(run)
        assert summary["finished"] and len(summary["sessions"]) == (1 if victim is None else 2)
        if victim is not None:
            assert 1 <= summary["sessions"][1]["start_step"] < POD_STEPS, name
        pod_w = export(name)
        assert sorted(pod_w) == sorted(one_w) == sorted(start_w)
        for k in one_w:
            np.testing.assert_allclose(pod_w[k], one_w[k], rtol=1e-5, atol=1e-5, err_msg=k)
        train = [r for r in read_metrics(run) if r["stage"] == "train"]
        assert [r["step"] for r in train] == list(range(1, POD_STEPS + 1)), name  # one writer
        assert all(r["time/publish_s"] > 0 for r in train), name
        # The config replays the rollouts' routing (router_replay): recorded across processes.
        assert all(r["rollout/routed_share"] > 0.5 for r in train), name
        assert outs[name].count(f"report: {workdir(name)}/report/report.md") == 1, name
        for i in range(savers, p) if savers < p else range(p):  # every sampling worker's tools
            assert f"TG_JAX_FAULTS: env.slow on process {i}" in outs[name], name
        one_h, pod_h = heldouts[reference(layout)], load_records(f"{run}/heldout.jsonl")
        assert len(one_h) == 2 * 2 and {r.condition for r in one_h} == {"plain", "hinted"}
        assert pod_h == one_h, name  # every episode's outcome, in the same order
        shards = paths.as_path(f"{run}/checkpoints/{POD_STEPS}/state")
        for process in range(p):  # each saving process's shards of the last checkpoint
            assert (shards / f"ocdbt.process_{process}").is_dir() == (process < savers)


def _why(out: str) -> str:
    """The errors anywhere in a worker's output, and its end."""
    errors = [ln for ln in out.splitlines() if "rror" in ln or ln[:1] in ("E", "F")]
    return "\n".join(errors[-30:]) + "\n...\n" + out[-2000:]


def _pod_through_sigterm(workdir: str, start, processes: int, victim: int, committed) -> str:
    """A local pod's run (`start()`), SIGTERMed at worker `victim` once its checkpoint 1 is
    written (`committed()`): every worker stops (exit 143) with no export or report yet; the
    same command then resumes to the end (exit 0). Returns the resumed run's output."""
    import signal
    import time

    from tg_jax import paths

    pod = start()
    deadline = time.monotonic() + 900
    while not committed():
        assert pod.poll() is None and time.monotonic() < deadline, _why(pod.communicate()[0])
        time.sleep(0.5)
    pid = _worker_pid(workdir, victim)
    assert pid is not None
    os.kill(pid, signal.SIGTERM)
    out = pod.communicate(timeout=900)[0]
    assert pod.returncode == 143, _why(out)
    assert f"process {processes - 1}/{processes}: {8 // processes} local of 8 devices" in out
    assert not paths.as_path(f"{workdir}/export/tg_seed0").exists()
    assert "report: " not in out
    proc = start()
    out = proc.communicate(timeout=1200)[0]
    assert proc.returncode == 0, _why(out)
    return out


def test_a_child_process_asks_for_its_cpu_devices():
    """cpu_devices_env replaces the device count in XLA_FLAGS (other flags kept) and drops
    JAX_NUM_CPU_DEVICES; local_cpu_devices reads either, the larger, else its default."""
    env = {"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=8",
           "JAX_NUM_CPU_DEVICES": "4", "OTHER": "x"}  # fmt: skip
    assert distributed.local_cpu_devices(env) == 8
    child = distributed.cpu_devices_env(2, env)
    assert child == {"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=2",
                     "OTHER": "x"}  # fmt: skip
    assert distributed.local_cpu_devices(child) == 2
    assert env["JAX_NUM_CPU_DEVICES"] == "4"  # the caller's dict is not changed
    assert distributed.local_cpu_devices({}) == 1
    assert distributed.local_cpu_devices({}, default=0) == 0
    assert distributed.local_cpu_devices({"JAX_NUM_CPU_DEVICES": "3"}, default=0) == 3


def test_cpu_processes_get_threads_for_blocking_collectives(monkeypatch):
    """16 intra-op threads per local CPU device (XLA_FLAGS or JAX_NUM_CPU_DEVICES), set
    through NPROC before the CPU client exists, with one process or several; a user's NPROC
    stands."""
    monkeypatch.delenv("NPROC", raising=False)
    distributed.threads_for_blocking_collectives(
        {"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=4"}
    )
    assert os.environ["NPROC"] == str(max(os.cpu_count() or 1, 64))
    monkeypatch.delenv("NPROC")
    distributed.threads_for_blocking_collectives({"JAX_NUM_CPU_DEVICES": "8"})
    assert os.environ["NPROC"] == str(max(os.cpu_count() or 1, 128))
    monkeypatch.setenv("NPROC", "3")
    distributed.threads_for_blocking_collectives({"JAX_NUM_CPU_DEVICES": "8"})
    assert os.environ["NPROC"] == "3"
    # A one-process CPU run gets them too (tg_jax.main's first call), a TPU run does not.
    monkeypatch.delenv("NPROC")
    assert not distributed.initialize_from_env({"JAX_PLATFORMS": "tpu", "JAX_NUM_CPU_DEVICES": "8"})
    assert "NPROC" not in os.environ
    try:
        assert not distributed.initialize_from_env(
            {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "8"}
        )
    finally:  # 8 CPU devices also turned the tests' compilation cache off (test below)
        jax.config.update("jax_enable_compilation_cache", True)
    assert os.environ["NPROC"] == str(max(os.cpu_count() or 1, 128))


def test_several_cpu_devices_in_one_process_compile_afresh(capsys):
    """A CPU run with collectives (several CPU devices in one process, as a CPU pod's
    processes) turns the persistent compilation cache off: executables loaded from it can
    deadlock XLA:CPU's collectives (tg_jax.tpu.distributed.no_persistent_cache_on_cpu). One
    CPU device, or a TPU run, keeps it."""
    assert jax.config.jax_enable_compilation_cache  # the tests' own cache (conftest)
    try:
        one = "--xla_force_host_platform_device_count=1"
        for env in ({"JAX_PLATFORMS": "cpu"}, {"JAX_PLATFORMS": "tpu", "JAX_NUM_CPU_DEVICES": "8"},
                    {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": one}):  # fmt: skip
            distributed.initialize_from_env(env)
            assert jax.config.jax_enable_compilation_cache, env
        assert capsys.readouterr().out == ""
        flags = "--xla_foo=1 --xla_force_host_platform_device_count=8"
        distributed.initialize_from_env({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags})
        assert not jax.config.jax_enable_compilation_cache
        assert "8 CPU devices in one process: no persistent compilation cache" in (
            capsys.readouterr().out
        )
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
