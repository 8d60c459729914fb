"""Run a tg_jax job on a Cloud TPU VM or pod slice, and keep it running through preemptions.

    bash launch/tpu.sh --name=tg-30b --zone=us-east5-a --project=my-project \
        --topology=v5p:2x4x4 --config=configs/qwen3_coder_30b_a3b_tg.py \
        --workdir=gs://my-bucket/runs/tg-30b [--spot] [--queued] [--vllm] [--allow-dirty] \
        [--dry-run] [-- --config.rl_loop.steps=200 ...]

What it does, with `gcloud` (each command is printed before it runs; `--dry-run` prints the
commands of a first start, the install script included, without running anything):

1. code: a clean git tree ships its HEAD commit, resolved once (a reinstall after a preemption
   ships the same code). A dirty tree is refused (`git archive HEAD` would silently leave the
   uncommitted edits behind) unless `--allow-dirty`, which ships the working tree as it is and
   lists the uncommitted paths (`tg_jax.tpu.pod_setup`).
2. create: the TPU VM / slice (`gcloud compute tpus tpu-vm create`), or with `--queued` a
   queued resource that waits for capacity (`gcloud compute tpus queued-resources create`);
   then polls its state until READY / ACTIVE.
3. install: the code's archive is copied to every worker (`tpu-vm scp --worker=all`) and
   installed by `pod_setup.install_script`: Python 3.12 from uv (not the image's 3.10), a venv
   with the `tpu` extra, `jax[tpu]==0.11.2`, flax 0.12.10 and the pins of constraints-tpu.txt
   (`--vllm`: also vllm-tpu 0.32.0); with `--hf-checkpoint=gs://...` the Hugging Face
   checkpoint is copied to each worker's disk.
4. run: `tpu-vm ssh --worker=all` starts `python -m tg_jax.main` on all workers at once with
   TG_JAX_DISTRIBUTED=1, so `tg_jax.tpu.distributed` joins them into one JAX runtime, and
   TG_JAX_TRANSFER_ADDRESS=<the worker's own address>:`--transfer-port` (the whole-host
   split's device-to-device weight copies; `pod_worker_env`). The workdir is on GCS:
   checkpoints and metrics outlive the VMs.
5. what to retry (`exit_rule`, `outcome`): every remote command ends by printing its exit
   status per worker (`[tg_jax-exit] STEP CODE HOST`; `gcloud ... ssh --worker=all` itself
   may exit 0 when a worker failed). A config error (exit 2, the fit check's refusal
   included), a base model that failed its gates (3) or a fault the run cannot go past (4)
   stops the launcher at once with the workers' `error:` line, and exits with that status.
   A preemption (143), a lost ssh connection (255), a signal or a crash is retried: the
   slice's state is read again; a preempted, terminated or failed slice (or queued resource)
   is deleted and recreated, the code reinstalled, and the job rerun (it resumes from the
   latest checkpoint in the workdir); a healthy slice just reruns it. `--max-quick-failures`
   failures in a row, each within `QUICK_S` of its start on a slice that stayed up, stop it
   (a crash loop, not a flaky machine), as do `--max-restarts` reruns in all.

A local pod (`--local`) rehearses a pod run on one machine: `tg_jax.tpu.local_pod`.

Only the Python standard library is used here, so the launcher runs from any machine with
gcloud, without JAX installed.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import math
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

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
    "v4": "v4",
    "v5p": "v5p",
    "v5e": "v5litepod",
    "v5litepod": "v5litepod",
    "v6e": "v6e",
}
READY_STATES = {"READY", "ACTIVE"}
WAIT_STATES = {"CREATING", "STARTING", "PROVISIONING", "WAITING_FOR_RESOURCES", "ACCEPTED"}
REMOTE_DIR = "~/tg_jax"
REMOTE_CKPT = "~/hf_checkpoint"
TRANSFER_PORT = 8482  # each pod worker's TG_JAX_TRANSFER_ADDRESS port (JAX's own: 8470-8479)
# Chips per host of a multi-host slice; v5e / v6e slices of up to 8 chips are one host.
_CHIPS_PER_HOST = {"v4": 4, "v5p": 4, "v5e": 4, "v5litepod": 4, "v6e": 4}
_SINGLE_HOST_CHIPS = {"v5e": 8, "v5litepod": 8, "v6e": 8}


def _chips(topology: str) -> tuple[str, int]:
    m = re.fullmatch(r"(v\w+?):(\d+(?:x\d+)*)", topology)
    if not m or m.group(1) not in _CORES_PER_CHIP:
        raise ValueError(f"Topology must look like v5p:2x4x4 (kinds {sorted(_CORES_PER_CHIP)})")
    kind, dims = m.groups()
    return kind, math.prod(int(d) for d in dims.split("x"))


def accelerator_type(topology: str) -> str:
    """ "v5p:2x4x4" -> "v5p-64"; "v5e:4x4" -> "v5litepod-16"; "v6e:2x2" -> "v6e-4"."""
    kind, chips = _chips(topology)
    return f"{_TYPE_PREFIX[kind]}-{chips * _CORES_PER_CHIP[kind]}"


def worker_count(topology: str) -> int:
    """The slice's hosts (TPU VM workers): "v5p:2x4x4" -> 8; "v6e:2x4" -> 1; "v5e:4x4" -> 4."""
    kind, chips = _chips(topology)
    if chips <= _SINGLE_HOST_CHIPS.get(kind, 0):
        return 1
    return max(1, chips // _CHIPS_PER_HOST[kind])


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
    code: str = "HEAD"  # the commit (or, --allow-dirty, the tree) shipped to the workers
    vllm: bool = False  # also install vllm-tpu (rollout_engine="vllm")
    python: str = ""  # an interpreter the workers have (default: uv installs pod_setup.PYTHON)
    transfer_port: int = TRANSFER_PORT

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
        return [
            "gcloud",
            "compute",
            "tpus",
            "queued-resources",
            "create",
            job.name,
            f"--node-id={job.name}",
            *job.where(),
            acc,
            f"--runtime-version={version}",
            *spot,
        ]
    return [
        "gcloud",
        "compute",
        "tpus",
        "tpu-vm",
        "create",
        job.name,
        *job.where(),
        acc,
        f"--version={version}",
        *spot,
    ]


def describe_command(job: Job) -> list[str]:
    if job.queued:
        return [
            "gcloud",
            "compute",
            "tpus",
            "queued-resources",
            "describe",
            job.name,
            *job.where(),
            "--format=value(state.state)",
        ]
    return [
        "gcloud",
        "compute",
        "tpus",
        "tpu-vm",
        "describe",
        job.name,
        *job.where(),
        "--format=value(state)",
    ]


def delete_command(job: Job) -> list[str]:
    if job.queued:
        return [
            "gcloud",
            "compute",
            "tpus",
            "queued-resources",
            "delete",
            job.name,
            *job.where(),
            "--force",
            "--quiet",
        ]
    return ["gcloud", "compute", "tpus", "tpu-vm", "delete", job.name, *job.where(), "--quiet"]


EXIT_MARK = "[tg_jax-exit]"  # what each worker prints last: "[tg_jax-exit] STEP CODE HOST"


def ssh_command(job: Job, remote: str, step: str = "") -> list[str]:
    """`remote` on every worker; with `step`, run by bash, then each worker prints its exit
    status behind EXIT_MARK (gcloud's own exit status does not always carry the workers')."""
    if step:
        remote = f'bash -c {shlex.quote(remote)}; echo "{EXIT_MARK} {step} $? $(hostname)"'
    return [
        "gcloud",
        "compute",
        "tpus",
        "tpu-vm",
        "ssh",
        job.name,
        *job.where(),
        "--worker=all",
        f"--command={remote}",
    ]


def install_script(job: Job) -> str:
    """What every worker runs to install the shipped code (`pod_setup.install_script`)."""
    from tg_jax.tpu import pod_setup  # noqa: PLC0415 (stdlib only, like this module)

    return pod_setup.install_script(
        REMOTE_DIR, os.path.basename(job.tarball), vllm=job.vllm, python=job.python
    )


def install_steps(job: Job) -> list[tuple[str, list[str]]]:
    """(step, command) pairs that ship the code to every worker and install it (plus the HF
    checkpoint): "archive" runs here, "copy" through gcloud, the others on the workers."""
    steps = [
        ("archive", ["git", "archive", "--format=tar.gz", f"--output={job.tarball}", job.code]),
        (
            "copy",
            [
                "gcloud",
                "compute",
                "tpus",
                "tpu-vm",
                "scp",
                job.tarball,
                f"{job.name}:{os.path.basename(job.tarball)}",
                *job.where(),
                "--worker=all",
            ],
        ),
        ("install", ssh_command(job, install_script(job), "install")),
    ]
    if job.hf_checkpoint:
        copy = f"rm -rf {REMOTE_CKPT} && gcloud storage cp -r {job.hf_checkpoint} {REMOTE_CKPT}"
        steps.append(("checkpoint", ssh_command(job, copy, "checkpoint")))
    return steps


def install_commands(job: Job) -> list[list[str]]:
    return [cmd for _, cmd in install_steps(job)]


def worker_args(job: Job, checkpoint: str | None) -> list[str]:
    """The arguments of `python -m tg_jax.main` on every worker (pod or local pod);
    `checkpoint` is the worker's copy of the Hugging Face checkpoint."""
    args = [f"--config={job.config}", f"--workdir={job.workdir}", *job.extra_args]
    # The checkpoint copied to every worker by the set-up is the run's model.
    return args + ([f"--config.model.hf_checkpoint={checkpoint}"] if checkpoint else [])


def pod_worker_env(job: Job) -> dict[str, str]:
    """The environment of `tg_jax.main` on every pod worker, as bash text evaluated there:
    each worker's transfer address is its own first address (`hostname -I`) and the port."""
    return {
        "TG_JAX_DISTRIBUTED": "1",
        "TG_JAX_TRANSFER_ADDRESS": f'"$(hostname -I | cut -d" " -f1):{job.transfer_port}"',
    }


def local_pod(job: Job, processes: int, devices_per_process: int, **kw: Any) -> int:
    """Runs the job as a local pod (`tg_jax.tpu.local_pod.run`, its keywords)."""
    from tg_jax.tpu import local_pod as pod  # noqa: PLC0415

    args_of = functools.partial(worker_args, job)
    return pod.run(job, processes, devices_per_process, args_of=args_of, **kw)


def run_command(job: Job) -> list[str]:
    """The job on all workers at once; each joins the others through tg_jax.tpu.distributed."""
    args = shlex.join(worker_args(job, None))
    if job.hf_checkpoint:  # the copy the set-up made on each worker
        args += ' --config.model.hf_checkpoint="$HOME/hf_checkpoint"'
    env = " ".join(f"{k}={v}" for k, v in pod_worker_env(job).items())
    remote = (
        f"set -o pipefail; cd {REMOTE_DIR} && export {env} && "
        f".venv/bin/python -m tg_jax.main {args} 2>&1 | tee -a ~/tg_jax_run.log"
    )
    return ssh_command(job, remote, "run")


# -- what to retry ---------------------------------------------------------------------------

# The exit statuses of `tg_jax.main` (tg_jax.cli's USAGE_ERROR, GATE_ERROR, RUN_ERROR;
# tg_jax.checkpointing.PREEMPTED_EXIT_CODE) and of ssh: (action, meaning).
EXIT_RULES = {
    0: ("done", "finished"),
    2: ("stop", "a config error (exit 2): change the config and launch again"),
    3: ("stop", "the base model failed its gates (exit 3)"),
    4: ("stop", "a fault the run cannot go past (exit 4); the error line says what was kept"),
    143: ("retry", "preempted (exit 143); the rerun resumes from the last checkpoint"),
    255: ("retry", "ssh failed (exit 255)"),
}
PREEMPTED = 143
# The start-up fit check's refusal (tg_jax.tpu.fit.FitError), whatever the exit status.
_FIT_FAILURE = re.compile(r"does not fit its devices' memory|FitError")
QUICK_S = 1800.0  # a failure this soon after its start counts toward --max-quick-failures


def exit_rule(code: int) -> tuple[str, str]:
    """("done" | "stop" | "retry", what the exit status means) for one worker's status."""
    if code in EXIT_RULES:
        return EXIT_RULES[code]
    if code > 128 or code < 0:  # a shell's 128 + N, or Popen's -N
        return "retry", f"killed by signal {code - 128 if code > 0 else -code} (exit {code})"
    return "retry", f"crashed (exit {code})"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a step on the workers came to, and what the launcher does next."""

    action: str  # "done", "retry" or "stop"
    code: int  # the failing workers' status (the launcher's own when it stops here)
    why: str
    error: str = ""  # the last `error: ...` line the workers printed


def worker_codes(output: str, step: str) -> list[int]:
    """The exit statuses the workers printed behind EXIT_MARK for `step`."""
    pattern = re.compile(rf"{re.escape(EXIT_MARK)} {re.escape(step)} (-?\d+)\b")
    return [int(m.group(1)) for m in pattern.finditer(output)]


def error_line(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if re.search(r"\berror: ", ln)]
    return lines[-1] if lines else ""


def outcome(rc: int, output: str, n_workers: int, step: str) -> Outcome:
    """The step's outcome from gcloud's exit status `rc` and the workers' output: done when
    all `n_workers` printed 0; stop on a status `exit_rule` stops on (or the fit check's
    refusal); else retry, a preemption first among the failures."""
    codes, error = worker_codes(output, step), error_line(output)
    if fit := [ln.strip() for ln in output.splitlines() if _FIT_FAILURE.search(ln)]:
        return Outcome("stop", 2, "the config does not fit the chips' memory (fit check)", fit[-1])
    if len(codes) >= n_workers and not any(codes):
        return Outcome("done", 0, "finished")
    failed = [c for c in codes if c] or ([rc] if rc else [])
    if not failed:
        why = f"{len(codes)} of {n_workers} workers reported an exit status (ssh lost?)"
        return Outcome("retry", 1, why, error)
    stops = [c for c in failed if exit_rule(c)[0] == "stop"]
    code = stops[0] if stops else PREEMPTED if PREEMPTED in failed else failed[0]
    action, why = exit_rule(code)
    return Outcome(action, code, why, error)


Runner = Callable[[list[str]], tuple[int, str]]
TAIL_LINES = 200  # of a command's output kept for its outcome, beside its marks and errors


def subprocess_runner(cmd: list[str]) -> tuple[int, str]:
    """Runs `cmd`, its output streamed here as it comes; returns its exit status and what
    `outcome` reads: every EXIT_MARK line, the last 100 `error:` lines and the last lines."""
    print("+ " + shlex.join(cmd), flush=True)
    marks: list[str] = []
    errors: collections.deque[str] = collections.deque(maxlen=100)
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, errors="replace") as proc:
        for line in proc.stdout:
            print(line, end="", flush=True)
            if EXIT_MARK in line:
                marks.append(line)
            elif re.search(r"\berror: ", line):
                errors.append(line)
            else:
                tail.append(line)
    return proc.returncode, "".join([*tail, *errors, *marks])


class DryRun:
    """A runner that prints each command and answers like a first start: the slice is absent,
    then READY; every worker's step exits 0."""

    def __init__(self, n_workers: int):
        self.n_workers, self.describes = n_workers, 0

    def __call__(self, cmd: list[str]) -> tuple[int, str]:
        print(shlex.join(cmd), flush=True)
        if "describe" in cmd:
            self.describes += 1
            return (1, "") if self.describes == 1 else (0, "READY\n")
        m = re.search(rf"{re.escape(EXIT_MARK)} (\w+) ", cmd[-1])
        if not m:
            return 0, ""
        return 0, "".join(f"{EXIT_MARK} {m.group(1)} 0 w{i}\n" for i in range(self.n_workers))


def state(job: Job, runner: Runner) -> str:
    """The slice's (or queued resource's) state, "ABSENT" when it does not exist."""
    rc, out = runner(describe_command(job))
    return out.strip().upper() if rc == 0 and out.strip() else "ABSENT"


def wait_ready(job: Job, runner: Runner, poll_s: float, sleep=time.sleep) -> str:
    while (s := state(job, runner)) in WAIT_STATES:
        sleep(poll_s)
    return s


def install(job: Job, runner: Runner) -> Outcome:
    """Runs `install_steps`; the first step that did not finish decides."""
    n = worker_count(job.topology)
    for step, cmd in install_steps(job):
        rc, out = runner(cmd)
        if step == "archive":  # here, from the repository: nothing a retry changes
            if rc:
                return Outcome("stop", 2, f"git archive {job.code} failed (exit {rc})")
            continue
        o = outcome(rc, out, n, step) if step != "copy" else None
        if o is None:
            o = Outcome("done", 0, "") if rc == 0 else Outcome("retry", rc, f"scp exit {rc}")
        if o.action != "done":
            return dataclasses.replace(o, why=f"{step}: {o.why}")
    return Outcome("done", 0, "installed")


def _stop(job: Job, o: Outcome) -> int:
    print(
        f"[launch] {job.name}: stopping, {o.why}" + (f"\n[launch] {o.error}" if o.error else ""),
        flush=True,
    )
    return o.code or 1


def launch(
    job: Job,
    runner: Runner,
    *,
    max_restarts: int = 20,
    max_quick_failures: int = 3,
    poll_s: float = 60.0,
    sleep=time.sleep,
    clock=time.monotonic,
) -> int:
    """Create (or reuse), install, run; retry what `outcome` retries (module docstring);
    returns the exit code: 0 when the job finished, else the status it stopped on."""
    installed, quick = False, 0
    for attempt in range(max_restarts + 1):
        s = wait_ready(job, runner, poll_s, sleep)
        if s not in READY_STATES:
            quick = 0  # the slice went away: the machines' failure, not the job's
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
        start = clock()
        if not installed:
            o = install(job, runner)
            installed = o.action == "done"
        if installed:
            start = clock()
            rc, out = runner(run_command(job))
            o = outcome(rc, out, worker_count(job.topology), "run")
            if o.action == "done":
                print(f"[launch] {job.name}: job finished", flush=True)
                return 0
        if o.action == "stop":
            return _stop(job, o)
        quick = 0 if o.code == PREEMPTED or clock() - start >= QUICK_S else quick + 1
        if quick >= max_quick_failures:
            loop = f"{quick} failures in a row, each within {QUICK_S / 60:.0f} min of its start"
            return _stop(job, dataclasses.replace(o, why=f"{o.why}; {loop} (a crash loop)"))
        print(
            f"[launch] {o.why} (attempt {attempt + 1}); checking the slice, then again "
            f"in {poll_s:.0f}s",
            flush=True,
        )
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
    p.add_argument("--vllm", action="store_true", help="also install vllm-tpu on the workers")
    p.add_argument("--python", default="", help="the workers' Python 3.12 (default: uv's)")
    p.add_argument("--allow-dirty", action="store_true", help="ship uncommitted changes too")
    p.add_argument(
        "--transfer-port",
        type=int,
        default=TRANSFER_PORT,
        help="each worker's TG_JAX_TRANSFER_ADDRESS port",
    )
    p.add_argument("--max-restarts", type=int, default=20)
    p.add_argument(
        "--max-quick-failures",
        type=int,
        default=3,
        help=f"failures in a row within {QUICK_S:.0f}s of start: stop",
    )
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
        try:
            accelerator_type(args.topology)
        except ValueError as e:
            p.error(f"--topology: {e}")
    job = Job(
        name=args.name,
        zone=args.zone,
        project=args.project,
        topology=args.topology,
        runtime_version=args.runtime_version,
        config=args.config,
        workdir=args.workdir,
        spot=args.spot,
        queued=args.queued,
        hf_checkpoint=args.hf_checkpoint,
        extra_args=tuple(args.extra),
        vllm=args.vllm,
        python=args.python,
        transfer_port=args.transfer_port,
    )
    return job, args


def shipped_code(job: Job, allow_dirty: bool, dry_run: bool, git=None) -> Job | str:
    """The job with the code to ship (`Job.code`), or the error line refusing a dirty tree
    (a dry run notes it and goes on). `git`: pod_setup's functions (tests pass fakes)."""
    from tg_jax.tpu import pod_setup  # noqa: PLC0415

    git = git or pod_setup
    head, porcelain = git.git_status()
    paths = pod_setup.dirty_paths(porcelain)
    refusal = pod_setup.dirty_refusal(porcelain, allow_dirty)
    if refusal and not dry_run:
        return refusal
    if refusal:
        print(f"# a real launch stops here: error: {refusal}", flush=True)
        return dataclasses.replace(job, code=head)
    if not paths:
        print(f"[launch] code: commit {head}", flush=True)
        return dataclasses.replace(job, code=head)
    tree = git.working_tree()
    print(
        f"[launch] code: the working tree (git tree {tree}): commit {head} and "
        f"{len(paths)} uncommitted paths: {', '.join(paths)}",
        flush=True,
    )
    return dataclasses.replace(job, code=tree)


def main(argv: Sequence[str] | None = None, git=None) -> int:
    job, args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.local:
        return local_pod(job, args.processes, args.devices_per_process)
    try:
        shipped = shipped_code(job, args.allow_dirty, args.dry_run, git)
    except RuntimeError as e:  # not a git repository, no commit yet
        shipped = f"cannot tell which code to ship: {e}"
    if isinstance(shipped, str):
        print(f"error: {shipped}", file=sys.stderr, flush=True)
        return 2
    job = shipped
    if args.dry_run:
        n = worker_count(job.topology)
        print(f"# dry run: {job.name} ({accelerator_type(job.topology)}, {n} workers), first start")
        rc = launch(job, DryRun(n), max_restarts=0, poll_s=0, sleep=lambda _: None)
        print("# the install script each worker runs (bash -c, in the install step above):")
        print(install_script(job))
        print("# after a preemption the launcher runs:")
        print(shlex.join(delete_command(job)))
        print("# ... then create, install and run again (resuming from the workdir)")
        return rc
    return launch(
        job,
        subprocess_runner,
        max_restarts=args.max_restarts,
        max_quick_failures=args.max_quick_failures,
        poll_s=args.poll_seconds,
    )


if __name__ == "__main__":
    sys.exit(main())
