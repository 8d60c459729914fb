"""A TPU slice as gcloud sees it (`tg_jax.tpu.launch`): the accelerator type and the workers
of a topology, the `Job` a launch describes, and the commands that create, describe and delete
the slice (a TPU VM / pod slice, or with `Job.queued` a queued resource).

Only the standard library: the launcher runs without JAX.
"""

from __future__ import annotations

import dataclasses
import math
import re

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
