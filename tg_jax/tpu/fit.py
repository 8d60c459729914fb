"""The fit check at start-up: a config whose programs do not fit its chips is refused before
anything is loaded, not found by an out-of-memory error an hour in.

On a TPU backend `tg_jax.main` calls `check` (unless `rl_loop.check_fit` is False): it
compiles the train step and the sampler's call as `tg_jax.tpu.aot` does (`compile_programs`
on the run's own devices and hosts: the same programs, shapes and placement as the AOT tables
of docs/tpu.md) and reads XLA's memory analysis against the chip's HBM (`bytes_limit` of the
device's memory stats). It refuses when
  * a program alone (with what stays on its chips meanwhile, `MemoryReport.resident`) exceeds
    the HBM, or
  * with async sampling on chips the trainer shares (colocated, or each host's sampler beside
    its trainer), the train step and the sampler's call together do: the train step's total,
    plus the sampler call's own bytes (its total less what stays resident, less the published
    weights the train step's figure already holds: `shared_bytes`). This is the sum
    docs/tpu.md states for each config.
The sampler's call is the lock-step decode step (`rl_loop.rollout_engine` "lockstep") or the
built-in engine's decode call ("builtin"); vLLM's memory is vLLM's own (not checked).
Cost: the compilations (minutes on a pod host; the run's own programs are compiled again
unless the persistent compilation cache holds them). The same check for a TPU topology on a
CPU machine: `python -m tg_jax.tpu.fit --config=CONFIG --topology=v5p:2x4x4`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from tg_jax.tpu import aot, aot_steps, hbm


class FitError(ValueError):
    """The config's programs do not fit the chips' memory (the message has the figures)."""


def device_hbm(device: Any) -> float | None:
    """The bytes one device may allocate (`memory_stats()["bytes_limit"]`), None if unknown."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return float(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def sampler_program(config: Any) -> str | None:
    """The `compile_programs` name of the config's sampler call (None: vLLM)."""
    from tg_jax.sampling.agent_loop import engine_kind  # noqa: PLC0415

    kind = engine_kind(config.rl_loop) if "rl_loop" in config else "lockstep"
    return {"lockstep": "sample", "builtin": "engine"}.get(kind)


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
    if program == "engine":
        return hbm.bytes_per_device(paged.kept_params(model, published)) if meshes.per_host else 0
    return hbm.bytes_per_device(published)


def check(
    config: Any,
    devices: Sequence[Any] | None = None,
    hosts: Sequence[Sequence[Any]] | None = None,
    hbm_bytes: float | None = None,
) -> list[str]:
    """The fit report's lines; FitError (with them) when the config does not fit (module
    docstring). hbm_bytes: per device (default: the first device's `device_hbm`)."""
    devices = list(devices or jax.devices())
    limit = hbm_bytes or device_hbm(devices[0])
    if not limit:
        raise ValueError(f"the memory of {devices[0].device_kind} devices is unknown")
    config = aot.resolve_architecture(config)
    sampler = sampler_program(config)
    what = ["train"] + ([sampler] if sampler else [])
    programs = list(aot.compile_programs(config, devices, what, hosts=hosts))
    reports = [hbm.memory_report(p.compiled, p.name, limit, p.resident) for p in programs]
    lines = [r.format() for r in reports]
    bad = [r.name for r in reports if r.total > limit]
    if sampler and bool(config.rl_loop.get("async_sampling", False)):
        meshes = aot.make_meshes(config, devices, hosts)
        if not meshes.own:  # the sampler's call runs on the trainer's chips, beside its step
            train, call = reports
            beside = train.total + call.total - call.resident
            beside -= shared_bytes(config, meshes, sampler)
            fits = "fits" if beside <= limit else "DOES NOT FIT"
            lines.append(
                f"async sampling: the train step and the sampler's call on the same chips: "
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

__all__ = ["FitError", "check", "device_hbm", "sampler_program", "shared_bytes"]

if __name__ == "__main__":
    from absl import app, flags  # noqa: PLC0415
    from ml_collections import config_flags  # noqa: PLC0415

    _FLAGS["config"] = config_flags.DEFINE_config_file("config", None, "Config file.")
    _FLAGS["topology"] = flags.DEFINE_string("topology", "v5p:2x2x2", "TPU topology.")
    flags.mark_flags_as_required(["config"])
    app.run(main)
