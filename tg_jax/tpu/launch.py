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

Here: the retry loop (`launch`), the runners of its commands and the command line. The
slice's commands: `tg_jax.tpu.pod_slice`; the workers' (install, run):
`tg_jax.tpu.pod_commands`; what their exit statuses mean: `tg_jax.tpu.pod_outcome`.

Only the Python standard library is used here, so the launcher runs from any machine with
gcloud, without JAX installed.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from tg_jax.tpu.pod_commands import (
    EXIT_MARK,
    REMOTE_CKPT,
    install_script,
    install_steps,
    run_command,
    worker_args,
)
from tg_jax.tpu.pod_outcome import PREEMPTED, Outcome, outcome
from tg_jax.tpu.pod_slice import (
    READY_STATES,
    TRANSFER_PORT,
    WAIT_STATES,
    Job,
    accelerator_type,
    create_command,
    delete_command,
    describe_command,
    worker_count,
)

Runner = Callable[[list[str]], tuple[int, str]]
TAIL_LINES = 200  # of a command's output kept for its outcome, beside its marks and errors
QUICK_S = 1800.0  # a failure this soon after its start counts toward --max-quick-failures


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


def local_pod(job: Job, processes: int, devices_per_process: int, **kw: Any) -> int:
    """Runs the job as a local pod (`tg_jax.tpu.local_pod.run`, its keywords)."""
    from tg_jax.tpu import local_pod as pod  # noqa: PLC0415

    args_of = functools.partial(worker_args, job)
    return pod.run(job, processes, devices_per_process, args_of=args_of, **kw)


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
