"""Run a tg_jax job on a Cloud TPU VM or pod slice, and keep it running through preemptions.

    bash launch/tpu.sh --name=tg-30b --zone=us-east5-a --project=my-project \
        --topology=v5p:2x4x4 --config=configs/qwen3_coder_30b_a3b_tg.py \
        --workdir=gs://my-bucket/runs/tg-30b [--spot] [--queued] [--dry-run] \
        [-- --config.rl_loop.steps=200 ...]

What it does, with `gcloud` (each command is printed before it runs; `--dry-run` prints the
commands of a first start without running anything):

1. create: the TPU VM / slice (`gcloud compute tpus tpu-vm create`), or with `--queued` a
   queued resource that waits for capacity (`gcloud compute tpus queued-resources create`);
   then polls its state until READY / ACTIVE.
2. install: the committed code (`git archive HEAD`) is copied to every worker
   (`tpu-vm scp --worker=all`) and installed in a venv with the `tpu` extra; with
   `--hf-checkpoint=gs://...` the Hugging Face checkpoint is copied to each worker's disk.
3. run: `tpu-vm ssh --worker=all` starts `python -m tg_jax.main` on all workers at once with
   TG_JAX_DISTRIBUTED=1, so `tg_jax.tpu.distributed` joins them into one JAX runtime. The workdir
   is on GCS: checkpoints and metrics outlive the VMs.
4. preemption / failure: when the run exits non-zero, the slice's state is read again. A
   preempted, terminated or failed slice (or queued resource) is deleted and recreated, the
   code reinstalled, and the job rerun; the trainer resumes from the latest checkpoint in the
   workdir. A healthy slice just reruns the job. After `--max-restarts` reruns it gives up.

A local pod (`--local --processes=P --devices-per-process=D`) rehearses a pod run on one
machine: the same per-worker command and environment (`worker_args`, TG_JAX_DISTRIBUTED=1) as P
local processes joined by `jax.distributed` on localhost, each with D CPU devices
(JAX_PLATFORMS=cpu, collectives over gloo) and its own copy of the checkpoint, staged as the
pod's set-up stages it. A SIGTERM (or Ctrl-C) to the launcher reaches every worker; the exit
status is the first failing worker's (0 when all finish), and the first worker to fail stops
the others at once. Each line a worker prints carries its number ("[w1] ..."), on the stream
it was printed to. Rerunning the command resumes.

Only the Python standard library is used here, so the launcher runs from any machine with
gcloud, without JAX installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

RUNTIME_VERSIONS = {
    "v4": "tpu-ubuntu2204-base",
    "v5e": "v2-alpha-tpuv5-lite",
    "v5litepod": "v2-alpha-tpuv5-lite",
    "v5p": "v2-alpha-tpuv5",
    "v6e": "v2-alpha-tpuv6e",
}
# Accelerator types count TensorCores on v4 / v5p (two per chip) and chips on v5e / v6e.
_CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v5e": 1, "v5litepod": 1, "v6e": 1}
_TYPE_PREFIX = {
    "v4": "v4", "v5p": "v5p", "v5e": "v5litepod", "v5litepod": "v5litepod", "v6e": "v6e",
}  # fmt: skip
READY_STATES = {"READY", "ACTIVE"}
WAIT_STATES = {"CREATING", "STARTING", "PROVISIONING", "WAITING_FOR_RESOURCES", "ACCEPTED"}
REMOTE_DIR = "~/tg_jax"
REMOTE_CKPT = "~/hf_checkpoint"


def accelerator_type(topology: str) -> str:
    """ "v5p:2x4x4" -> "v5p-64"; "v5e:4x4" -> "v5litepod-16"; "v6e:2x2" -> "v6e-4"."""
    m = re.fullmatch(r"(v\w+?):(\d+(?:x\d+)*)", topology)
    if not m or m.group(1) not in _CORES_PER_CHIP:
        raise ValueError(f"Topology must look like v5p:2x4x4 (kinds {sorted(_CORES_PER_CHIP)})")
    kind, dims = m.groups()
    chips = math.prod(int(d) for d in dims.split("x"))
    return f"{_TYPE_PREFIX[kind]}-{chips * _CORES_PER_CHIP[kind]}"


@dataclasses.dataclass(frozen=True)
class Job:
    """Everything the gcloud commands need."""

    name: str
    zone: str
    topology: str
    config: str
    workdir: str
    project: str = ""
    runtime_version: str = ""
    spot: bool = False
    queued: bool = False
    hf_checkpoint: str = ""
    extra_args: tuple[str, ...] = ()
    tarball: str = "/tmp/tg_jax_code.tar.gz"

    @property
    def kind(self) -> str:
        return self.topology.split(":")[0]

    def where(self) -> list[str]:
        return [f"--zone={self.zone}"] + ([f"--project={self.project}"] if self.project else [])


def create_command(job: Job) -> list[str]:
    version = job.runtime_version or RUNTIME_VERSIONS[job.kind]
    acc = f"--accelerator-type={accelerator_type(job.topology)}"
    spot = ["--spot"] if job.spot else []
    if job.queued:
        return ["gcloud", "compute", "tpus", "queued-resources", "create", job.name,
                f"--node-id={job.name}", *job.where(), acc, f"--runtime-version={version}",
                *spot]  # fmt: skip
    return ["gcloud", "compute", "tpus", "tpu-vm", "create", job.name, *job.where(), acc,
            f"--version={version}", *spot]  # fmt: skip


def describe_command(job: Job) -> list[str]:
    if job.queued:
        return ["gcloud", "compute", "tpus", "queued-resources", "describe", job.name,
                *job.where(), "--format=value(state.state)"]  # fmt: skip
    return ["gcloud", "compute", "tpus", "tpu-vm", "describe", job.name, *job.where(),
            "--format=value(state)"]  # fmt: skip


def delete_command(job: Job) -> list[str]:
    if job.queued:
        return ["gcloud", "compute", "tpus", "queued-resources", "delete", job.name,
                *job.where(), "--force", "--quiet"]  # fmt: skip
    return ["gcloud", "compute", "tpus", "tpu-vm", "delete", job.name, *job.where(), "--quiet"]


def ssh_command(job: Job, remote: str) -> list[str]:
    return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", job.name, *job.where(),
            "--worker=all", f"--command={remote}"]  # fmt: skip


def install_commands(job: Job) -> list[list[str]]:
    """Ship the committed code to every worker and install it (plus the HF checkpoint)."""
    remote = (
        f"set -e; rm -rf {REMOTE_DIR} && mkdir -p {REMOTE_DIR} && "
        f"tar xzf ~/{os.path.basename(job.tarball)} -C {REMOTE_DIR} && cd {REMOTE_DIR} && "
        "python3 -m venv .venv && .venv/bin/pip install -q --upgrade pip && "
        ".venv/bin/pip install -q -e '.[tpu]' -c constraints.txt"
    )
    cmds = [
        ["git", "archive", "--format=tar.gz", f"--output={job.tarball}", "HEAD"],
        ["gcloud", "compute", "tpus", "tpu-vm", "scp", job.tarball,
         f"{job.name}:{os.path.basename(job.tarball)}", *job.where(), "--worker=all"],
        ssh_command(job, remote),
    ]  # fmt: skip
    if job.hf_checkpoint:
        copy = f"rm -rf {REMOTE_CKPT} && gcloud storage cp -r {job.hf_checkpoint} {REMOTE_CKPT}"
        cmds.append(ssh_command(job, copy))
    return cmds


def worker_args(job: Job, checkpoint: str | None) -> list[str]:
    """The arguments of `python -m tg_jax.main` on every worker (pod or local pod);
    `checkpoint` is the worker's copy of the Hugging Face checkpoint."""
    args = [f"--config={job.config}", f"--workdir={job.workdir}", *job.extra_args]
    # The checkpoint copied to every worker by the set-up is the run's model.
    return args + ([f"--config.model.hf_checkpoint={checkpoint}"] if checkpoint else [])


def run_command(job: Job) -> list[str]:
    """The job on all workers at once; each joins the others through tg_jax.tpu.distributed."""
    args = shlex.join(worker_args(job, None))
    if job.hf_checkpoint:  # the copy the set-up made on each worker
        args += ' --config.model.hf_checkpoint="$HOME/hf_checkpoint"'
    remote = (
        f"set -o pipefail; cd {REMOTE_DIR} && TG_JAX_DISTRIBUTED=1 "
        f".venv/bin/python -m tg_jax.main {args} 2>&1 | tee -a ~/tg_jax_run.log"
    )
    return ssh_command(job, remote)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def _stage_checkpoint(src: str, dst: str) -> None:
    """A worker's copy of the checkpoint, as the pod set-up copies it (`gcloud storage cp -r`);
    gs:// sources go through tg_jax's own staging (etils), local ones are copied."""
    if os.path.exists(os.path.join(dst, "config.json")):
        return  # staged by an earlier run of this local pod
    if "://" in src:
        from tg_jax.models.hf_dir import stage_locally  # noqa: PLC0415 (needs tg_jax)

        src = stage_locally(src)
    tmp = dst + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    os.replace(tmp, dst)


def local_pod(
    job: Job,
    processes: int,
    devices_per_process: int,
    *,
    stage_dir: str | None = None,
    module: str = "tg_jax.main",
) -> int:
    """Runs the job as `processes` local workers of `devices_per_process` CPU devices each
    (see the module docstring); returns the exit status. `module` is what each worker runs
    (`python -m`), with `worker_args`."""
    if processes < 1 or devices_per_process < 1:
        raise ValueError("--processes and --devices-per-process must be >= 1")
    port = _free_port()
    root = stage_dir or os.path.join(
        os.path.expanduser("~"), ".cache", "tg_jax", "local_pod", job.name
    )
    workers = []
    for i in range(processes):
        ckpt = None
        if job.hf_checkpoint:
            ckpt = os.path.join(root, f"worker{i}", "hf_checkpoint")
            os.makedirs(os.path.dirname(ckpt), exist_ok=True)
            _stage_checkpoint(job.hf_checkpoint, ckpt)
        env = {
            **os.environ,
            "TG_JAX_DISTRIBUTED": "1",
            "TG_JAX_COORDINATOR": f"localhost:{port}",
            "TG_JAX_NUM_PROCESSES": str(processes),
            "TG_JAX_PROCESS_ID": str(i),
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": " ".join(
                [os.environ.get("XLA_FLAGS", ""),
                 f"--xla_force_host_platform_device_count={devices_per_process}"]
            ).strip(),
        }  # fmt: skip
        env["PYTHONUNBUFFERED"] = "1"  # lines reach the launcher as they are printed
        cmd = [sys.executable, "-m", module, *worker_args(job, ckpt)]
        print(f"[local pod] worker {i}: {shlex.join(cmd)}", flush=True)
        workers.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE))  # fmt: skip
    copiers = [threading.Thread(target=_copy_lines, args=(pipe, stream, f"[w{i}] ".encode()),
                                daemon=True)
               for i, w in enumerate(workers)
               for pipe, stream in ((w.stdout, sys.stdout), (w.stderr, sys.stderr))]  # fmt: skip
    for t in copiers:
        t.start()

    def forward(signum, frame):
        del frame
        for w in workers:
            if w.poll() is None:
                w.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        failed_first = None  # one worker failed: the others cannot go on alone
        while any(w.poll() is None for w in workers):
            if failed_first is None:
                failed_first = next((i for i, w in enumerate(workers) if w.poll()), None)
                if failed_first is not None:
                    forward(signal.SIGTERM, None)
            time.sleep(0.2)
        codes = [w.wait() for w in workers]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for t in copiers:
            t.join(timeout=10)
    for i, c in enumerate(codes):
        if c:
            print(f"[local pod] worker {i} exited with {c}", flush=True)
    if failed_first is None:  # none had failed at a poll: all ended between two
        failed_first = next((i for i, c in enumerate(codes) if c), None)
    return 0 if failed_first is None else codes[failed_first]


_OUTPUT_LOCK = threading.Lock()  # the workers' copier threads share the launcher's streams


def _copy_lines(pipe, stream, prefix: bytes) -> None:
    """Copies a worker's output to `stream` line by line (carriage returns kept, so progress
    bars stay one line), each line behind `prefix`."""
    out = getattr(stream, "buffer", None)
    for line in iter(pipe.readline, b""):
        with _OUTPUT_LOCK:
            if out is None:  # a text stream without a buffer (a test's capture)
                stream.write((prefix + line).decode(errors="replace"))
            else:
                stream.flush()
                out.write(prefix + line)
            stream.flush()
    pipe.close()


Runner = Callable[[list[str]], tuple[int, str]]


def subprocess_runner(cmd: list[str]) -> tuple[int, str]:
    print("+ " + shlex.join(cmd), flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if proc.stdout:
        print(proc.stdout, end="", flush=True)
    return proc.returncode, proc.stdout or ""


def dry_run_runner(cmd: list[str]) -> tuple[int, str]:
    """Prints the command; answers `describe` like a first start (absent, then ready)."""
    print(shlex.join(cmd), flush=True)
    if "describe" in cmd:
        dry_run_runner.describes = getattr(dry_run_runner, "describes", 0) + 1
        return (1, "") if dry_run_runner.describes == 1 else (0, "READY\n")
    return 0, ""


def state(job: Job, runner: Runner) -> str:
    """The slice's (or queued resource's) state, "ABSENT" when it does not exist."""
    rc, out = runner(describe_command(job))
    return out.strip().upper() if rc == 0 and out.strip() else "ABSENT"


def wait_ready(job: Job, runner: Runner, poll_s: float, sleep=time.sleep) -> str:
    while (s := state(job, runner)) in WAIT_STATES:
        sleep(poll_s)
    return s


def launch(
    job: Job, runner: Runner, *, max_restarts: int = 20, poll_s: float = 60.0, sleep=time.sleep
) -> int:
    """Create (or reuse), install, run; recreate after preemption; returns the exit code."""
    installed = False
    for attempt in range(max_restarts + 1):
        s = wait_ready(job, runner, poll_s, sleep)
        if s not in READY_STATES:
            if s != "ABSENT":  # preempted, terminated, suspended, failed: start over
                print(f"[launch] {job.name} is {s}: deleting and recreating", flush=True)
                runner(delete_command(job))
            rc, _ = runner(create_command(job))
            if rc != 0:
                print(f"[launch] create failed (rc {rc}); retrying in {poll_s:.0f}s", flush=True)
                sleep(poll_s)
                continue
            if (s := wait_ready(job, runner, poll_s, sleep)) not in READY_STATES:
                print(f"[launch] {job.name} is {s} after create; retrying", flush=True)
                continue
            installed = False
        if not installed:
            if any(runner(cmd)[0] != 0 for cmd in install_commands(job)):
                print("[launch] install failed; checking the slice again", flush=True)
                sleep(poll_s)
                continue
            installed = True
        rc, _ = runner(run_command(job))
        if rc == 0:
            print(f"[launch] {job.name}: job finished", flush=True)
            return 0
        print(f"[launch] run exited with {rc} (attempt {attempt + 1}); resuming", flush=True)
        sleep(poll_s)
    print(f"[launch] giving up after {max_restarts} restarts", flush=True)
    return 1


def parse_args(argv: Sequence[str]) -> tuple[Job, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local", action="store_true", help="a local pod: workers as processes here")
    p.add_argument("--processes", type=int, default=2, help="--local: worker processes")
    p.add_argument("--devices-per-process", type=int, default=4, help="--local: CPU devices")
    p.add_argument("--name", default="local", help="TPU VM / queued resource name")
    p.add_argument("--zone", default="")
    p.add_argument("--project", default="")
    p.add_argument("--topology", default="", help="e.g. v5p:2x4x4, v5e:4x4")
    p.add_argument("--runtime-version", default="", help="default: by TPU kind")
    p.add_argument("--config", required=True, help="configs/NAME.py (path inside the repo)")
    p.add_argument("--workdir", required=True, help="gs://bucket/path (outlives the VMs)")
    p.add_argument("--spot", action="store_true", help="preemptible (spot) capacity")
    p.add_argument("--queued", action="store_true", help="use a queued resource")
    p.add_argument("--hf-checkpoint", default="", help=f"gs:// HF checkpoint -> {REMOTE_CKPT}")
    p.add_argument("--max-restarts", type=int, default=20)
    p.add_argument("--poll-seconds", type=float, default=60.0)
    p.add_argument("--allow-local-workdir", action="store_true", help="workdir not on GCS")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("extra", nargs="*", help="after --: flags for tg_jax.main (--config.a=b)")
    args = p.parse_args(argv)
    if not args.local:
        if not args.zone or not args.topology:
            p.error("--zone and --topology are required (or --local for a local pod)")
        if not args.workdir.startswith("gs://") and not args.allow_local_workdir:
            p.error("--workdir must be on GCS (gs://...): worker disks vanish on preemption")
        accelerator_type(args.topology)  # validates
    job = Job(
        name=args.name, zone=args.zone, project=args.project, topology=args.topology,
        runtime_version=args.runtime_version, config=args.config, workdir=args.workdir,
        spot=args.spot, queued=args.queued, hf_checkpoint=args.hf_checkpoint,
        extra_args=tuple(args.extra),
    )  # fmt: skip
    return job, args


def main(argv: Sequence[str] | None = None) -> int:
    job, args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.local:
        return local_pod(job, args.processes, args.devices_per_process)
    if args.dry_run:
        dry_run_runner.describes = 0
        print(f"# dry run: {job.name} ({accelerator_type(job.topology)}), first start")
        rc = launch(job, dry_run_runner, max_restarts=0, poll_s=0, sleep=lambda _: None)
        print("# after a preemption the launcher runs:")
        print(shlex.join(delete_command(job)))
        print("# ... then create, install and run again (resuming from the workdir)")
        return rc
    return launch(job, subprocess_runner, max_restarts=args.max_restarts, poll_s=args.poll_seconds)


if __name__ == "__main__":
    sys.exit(main())
