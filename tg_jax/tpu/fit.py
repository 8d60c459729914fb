"""The fit check at start-up: a config whose programs do not fit its chips is refused before
anything is loaded, not found by an out-of-memory error an hour in.

On a TPU backend `tg_jax.main` calls `check` (unless `rl_loop.check_fit` is False): it
compiles every program the run compiles that holds much memory, as `tg_jax.tpu.aot` does
(`compile_programs` on the run's own devices and hosts: the same programs, shapes and
placement), and reads XLA's memory analysis against the chip's HBM (`bytes_limit` of the
device's memory stats):
  * the train step;
  * the rollout sampler's calls: the lock-step sampler's whole call (prefill and decode loop,
    `rl_loop.rollout_engine` "lockstep") or the built-in engine's prefill and decode calls
    ("builtin");
  * the evaluation's sampler call (periodic and final: their own episodes and contexts; the
    built-in engine's with the evaluation's own engine, the rollouts' pool beside it);
and sizes from shapes what is not a program of its own (`tg_jax.tpu.aot_sampling`): vLLM's
reservation (its weights and KV cache on its chip) and, with several hosts, the step's
trajectory gather on every chip. Each line is a program or buffer per device, with what stays
on its chips meanwhile (`MemoryReport.resident`). It refuses when
  * one of them exceeds the HBM, or
  * with async sampling on chips the trainer shares (colocated, or each host's sampler beside
    its trainer), the train step and the sampler's largest call together do: the train step's
    total, plus the call's own bytes (its total less what stays resident, less the published
    weights the train step's figure already holds: `shared_bytes`).
`python -m tg_jax.tpu.fit --config=CONFIG --topology=v5p:2x4x4` prints the same lines for a
TPU topology on a CPU machine (docs/tpu.md's tables come from it). Cost: the compilations
(minutes on a pod host; the run's own programs are compiled again unless the persistent
compilation cache holds them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from tg_jax.sampling.agent_loop import engine_kind
from tg_jax.tpu import aot, aot_sampling, aot_steps, hbm


class FitError(ValueError):
    """The config's programs do not fit the chips' memory (the message has the figures)."""


def device_hbm(device: Any) -> float | None:
    """The bytes one device may allocate (`memory_stats()["bytes_limit"]`), None if unknown."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return float(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def sampler_programs(config: Any) -> list[str]:
    """The `compile_programs` names of the config's rollout sampler calls: the lock-step
    sampler's whole call ("prompt"), the built-in engine's prefill and decode calls; none for
    vLLM (its reservation is sized, `aot_sampling.vllm_bytes`)."""
    kind = engine_kind(config.rl_loop) if "rl_loop" in config else "lockstep"
    return {"lockstep": ["prompt"], "builtin": ["engine_prefill", "engine"]}.get(kind, [])


def shared_bytes(config: Any, meshes: aot.Meshes, program: str) -> int:
    """Bytes per device of the sampler call's arguments that the train step's figure already
    counts: the published weights (the trainer's params colocated on one host, a host's bf16
    copy per host), all of them for the lock-step step (its weights are that copy), the part
    the engine holds by reference for the engine (colocated: none; it holds a copy)."""
    from tg_jax.engine import paged  # noqa: PLC0415
    from tg_jax.models import ModelConfig, Transformer  # noqa: PLC0415

    model = Transformer(ModelConfig.from_config(config.model))
    if meshes.per_host:
        published = aot_steps.in_dtype(
            aot_steps.abstract_params(model, meshes.sampler, meshes.sampler_rules),
            config.model.dtype,
        )
    else:
        published = aot_steps.abstract_params(model, meshes.trainer, meshes.trainer_rules)
    if program.startswith("engine"):
        return hbm.bytes_per_device(paged.kept_params(model, published)) if meshes.per_host else 0
    return hbm.bytes_per_device(published)


@dataclasses.dataclass(frozen=True)
class Measured:
    """A config's programs and sized buffers (`measure`), before they are held against a
    limit (`judge`)."""

    reports: list[hbm.MemoryReport]  # the train step first, then the sampler's calls
    calls: list[str]  # the sampler calls' names (`sampler_programs`), in `reports[1:]`
    shared: list[int]  # per call, `shared_bytes`
    beside_trainer: bool  # async sampling on the trainer's chips: the sum is checked


def measure(
    config: Any,
    devices: Sequence[Any] | None = None,
    hosts: Sequence[Sequence[Any]] | None = None,
) -> Measured:
    """Compiles and sizes the config's programs on `devices` (default: all; module
    docstring)."""
    devices = list(devices or jax.devices())
    config = aot.resolve_architecture(config)
    calls = sampler_programs(config)
    vllm = "rl_loop" in config and engine_kind(config.rl_loop) == "vllm"
    what = ["train", *calls] + ([] if vllm else ["eval"])
    programs = list(aot.compile_programs(config, devices, what, hosts=hosts))
    reports = [hbm.memory_report(p.compiled, p.name, 0.0, p.resident) for p in programs]
    meshes = aot.make_meshes(config, devices, hosts)
    reports += _estimates(config, meshes)
    beside = beside_trainer(config, meshes)
    shared = [shared_bytes(config, meshes, name) for name in calls] if beside else []
    return Measured(reports, calls, shared, beside)


def beside_trainer(config: Any, meshes: aot.Meshes) -> bool:
    """Whether the sampler's calls run beside the train step on the same chips: async
    sampling with the sampler on the trainer's chips (colocated, or per host), through a
    program of ours (vLLM's reservation is a line of its own)."""
    async_sampling = "rl_loop" in config and bool(config.rl_loop.get("async_sampling", False))
    return bool(sampler_programs(config)) and async_sampling and not meshes.own


def judge(measured: Measured, limit: float) -> list[str]:
    """The fit report's lines against `limit` bytes per device; FitError (with them) when a
    program, or the train step and the sampler's largest call together, exceed it."""
    reports = [dataclasses.replace(r, hbm=limit) for r in measured.reports]
    lines = [r.format() for r in reports]
    bad = [r.name for r in reports if r.total > limit]
    if measured.beside_trainer:  # the sampler's calls run on the trainer's chips, beside it
        train, calls = reports[0], reports[1 : 1 + len(measured.calls)]
        beside = train.total + max(
            c.total - c.resident - shared for c, shared in zip(calls, measured.shared, strict=True)
        )
        fits = "fits" if beside <= limit else "DOES NOT FIT"
        lines.append(
            f"async sampling: the train step and the sampler's largest call on the same chips: "
            f"{beside / hbm.GIB:.2f} GiB of {limit / hbm.GIB:.2f} GiB ({fits})"
        )
        if beside > limit:
            bad.append("the train step and the sampler's call together (async sampling)")
    if bad:
        raise FitError(
            f"the config does not fit its devices' memory: {'; '.join(bad)}. Raise "
            "rl.micro_batches, lower sampler_mesh.max_rows or rl_loop.engine_kv_tokens, or take "
            "a larger slice (rl_loop.check_fit=False skips this check).\n" + "\n".join(lines)
        )
    return lines


def check(
    config: Any,
    devices: Sequence[Any] | None = None,
    hosts: Sequence[Sequence[Any]] | None = None,
    hbm_bytes: float | None = None,
) -> list[str]:
    """`judge(measure(...))`: the fit report's lines, FitError when the config does not fit.
    hbm_bytes: per device (default: the first device's `device_hbm`)."""
    devices = list(devices or jax.devices())
    limit = hbm_bytes or device_hbm(devices[0])
    if not limit:
        raise ValueError(f"the memory of {devices[0].device_kind} devices is unknown")
    return judge(measure(config, devices, hosts), limit)


def _estimates(config: Any, meshes: aot.Meshes) -> list[hbm.MemoryReport]:
    """What is sized rather than compiled (`tg_jax.tpu.aot_sampling`): vLLM's reservation on
    its chip, and with several hosts the step's trajectory gather on every chip, beside the
    trainer's state (and a host's sampler copy staged on its trainer chips)."""
    out = []
    state = aot_steps.state_bytes(config, meshes.trainer, meshes.trainer_rules)
    if "rl_loop" in config and engine_kind(config.rl_loop) == "vllm":
        weights, kv = aot_sampling.vllm_bytes(config)
        beside = state if not meshes.own else 0  # colocated: the trainer's state stays
        out.append(hbm.estimate("vLLM engine (weights + KV cache)", weights + kv, 0.0, beside))
    if meshes.hosts > 1:
        shapes = aot.train_shapes(config, 1)
        gathered = aot_sampling.gather_bytes(config, shapes.rows, shapes.seq_len, meshes.hosts)
        beside = state + aot.resident_of(config, meshes, "train")
        out.append(
            hbm.estimate(
                f"trajectory gather ({meshes.hosts} hosts' trajectories on every chip, a step)",
                gathered,
                0.0,
                beside,
            )
        )
    return out


def main(argv: Sequence[str]) -> None:
    """`python -m tg_jax.tpu.fit --config=... --topology=v5p:2x4x4`: the start-up check for a
    TPU topology, on a CPU machine (libtpu's topology description, as `tg_jax.tpu.aot`)."""
    del argv
    topology = _FLAGS["topology"].value
    devices = aot.topology_devices(topology)
    limit = hbm.hbm_bytes_per_device(topology, len(devices))
    try:
        print("\n".join(check(_FLAGS["config"].value, devices, hbm_bytes=limit)), flush=True)
    except FitError as e:
        print(e, flush=True)
        raise SystemExit(1) from None


_FLAGS: dict[str, Any] = {}

__all__ = [
    "FitError",
    "Measured",
    "beside_trainer",
    "check",
    "device_hbm",
    "judge",
    "measure",
    "sampler_programs",
    "shared_bytes",
]

if __name__ == "__main__":
    from absl import app, flags  # noqa: PLC0415
    from ml_collections import config_flags  # noqa: PLC0415

    _FLAGS["config"] = config_flags.DEFINE_config_file("config", None, "Config file.")
    _FLAGS["topology"] = flags.DEFINE_string("topology", "v5p:2x2x2", "TPU topology.")
    flags.mark_flags_as_required(["config"])
    app.run(main)
