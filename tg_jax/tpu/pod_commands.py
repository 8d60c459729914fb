"""The commands the launcher (`tg_jax.tpu.launch`) runs on a slice's workers, all at once
(`gcloud ... tpu-vm ssh --worker=all`), each ending with every worker's exit status behind
`EXIT_MARK`: shipping and installing the code (`install_steps`, the script from
`tg_jax.tpu.pod_setup`), then the job itself (`run_command`) with the arguments and the
environment of `tg_jax.main` on each worker (`worker_args`, shared with the local pod;
`pod_worker_env`).

Only the standard library: the launcher runs without JAX.
"""

from __future__ import annotations

import os
import shlex

from tg_jax.tpu.pod_slice import Job

REMOTE_DIR = "~/tg_jax"
REMOTE_CKPT = "~/hf_checkpoint"
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
