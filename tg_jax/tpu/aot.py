"""Does a config fit a TPU slice? Compile its steps ahead of time on a CPU host and read memory.

    python -m tg_jax.tpu.aot --config=configs/qwen3_coder_30b_a3b_tg.py --topology=v5p:2x4x4 \
        [--config.model.hf_checkpoint=configs/hf/qwen3_coder_30b_a3b] [--config.a.b=v]

libtpu describes any TPU topology without the hardware (`jax.experimental.topologies`); a mesh
over those devices, abstract inputs (`jax.ShapeDtypeStruct` with their shardings) and
`jax.jit(...).lower(...).compile()` give the real XLA:TPU executable, whose
`memory_analysis()` is the per-chip HBM it needs: arguments + outputs - donated aliases +
temporaries + code. Nothing runs and no weights exist; only libtpu must be importable (the
`aot` extra: `pip install -e .[aot]`).

The architecture is the config's, or that of `model.hf_checkpoint`'s config.json (only that
file is read; configs/hf/ has the published ones of the Qwen3 checkpoints the qwen3 configs
are for). Two programs are compiled:
* train: the real RL train step as `tg_jax.train.rl` builds it (`make_train_step`, RL from the
  checkpoint's params) on the largest batch `build_batch` makes for the config (`train_shapes`:
  `--train_rows` student rows of `--seq_len` tokens; `--teacher_rows` teacher rows of
  `--teacher_len`, compact ones with `--prefix_len` student key/value slots when
  tg.compact), with `config.rl.micro_batches`; or, with `--step=lm`, a next-token loss +
  AdamW step of the same student shapes (no teacher), the baseline.
* sample: one step of the sampler's decode loop (`tg_jax.models.decode.decode_one`)
  for `--decode_rows` rows with a KV cache of `--cache_len` slots (prompt + generated).

With `config.sampler_mesh.num_devices = N > 0` the train step compiles over the first
(total - N) devices (config.mesh) and the sample step over the last N (the sampler's
("data", "tensor") mesh, `config.sampler_mesh.shape`); otherwise both over all devices.

The programs' builders are in `tg_jax.tpu.aot_steps`; here: a config's architecture, meshes
and batch shapes, `compile_programs` (the programs of a config and what stays beside each),
and the command line.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import types
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from absl import app, flags
from jax.sharding import Mesh
from ml_collections import config_flags

from tg_jax import config_files, paths, sharding
from tg_jax.models import ModelConfig, Transformer, hf_dir
from tg_jax.models.hf_io import model_config_from_hf
from tg_jax.sampling import placement
from tg_jax.tpu import aot_sampling
from tg_jax.tpu.aot_steps import (
    TrainShapes,
    abstract_params,
    compile_lm_train_step,
    compile_sample_step,
    compile_tg_train_step,
    in_dtype,
    state_bytes,
)
from tg_jax.tpu.hbm import bytes_per_device, hbm_bytes_per_device, memory_report


def topology_devices(topology: str) -> list[jax.Device]:
    """The devices of a TPU topology such as "v5p:2x4x4" (libtpu, no hardware needed)."""
    from jax.experimental import topologies  # noqa: PLC0415 (needs libtpu)

    # Off a TPU VM libtpu cannot discover worker hostnames; AOT does not need them. Nor does
    # it hold a chip: several compiles may run at once (libtpu's lockfile is for chips).
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return list(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)


# ---------------------------------------------------------------------------------------------
# A config's architecture, meshes and shapes.
# ---------------------------------------------------------------------------------------------


def resolve_architecture(config: Any) -> Any:
    """`config` with the architecture of `model.hf_checkpoint`'s config.json when one is set
    (only that file is read: no weights, no tokenizer; fields the config sets are checked
    against it, as `hf_dir.resolve_config` does). configs/hf/<model>/config.json are the
    published files of the Qwen3 checkpoints the configs/qwen3_*.py configs are for."""
    ckpt = config.model.get("hf_checkpoint")
    if ckpt:
        hf = paths.read_json(paths.as_path(ckpt) / hf_dir.CONFIG_FILE)
        md = types.SimpleNamespace(path=str(ckpt), architecture=model_config_from_hf(hf))
        fields = hf_dir.resolve_model_section(config.model, md)
        config = config_files.apply_overrides(config, {f"model.{k}": v for k, v in fields.items()})
    unset = [name for name in hf_dir.ARCHITECTURE_FIELDS if config.model.get(name) is None]
    if unset:
        raise ValueError(
            f"model.{unset[0]} (and {len(unset) - 1} more) unset: pass "
            "--config.model.hf_checkpoint=DIR, a directory with the checkpoint's config.json "
            "(e.g. configs/hf/qwen3_1p7b)"
        )
    return config


@dataclasses.dataclass(frozen=True)
class Meshes:
    """The trainer's mesh and rules, and the sampler's: the trainer's when colocated on one
    host; with several hosts, one host's sampler mesh (`placement.HostReplicas`: every host
    samples on its own chips, or its `sampler_mesh.num_devices / hosts` chips of its own, with
    its own bf16 copy); with `sampler_mesh.num_devices` on one host, the sampler's devices."""

    trainer: Mesh
    trainer_rules: Any
    sampler: Mesh
    sampler_rules: Any
    hosts: int = 1  # hosts (processes) of the slice; > 1: per-host samplers
    own: bool = False  # the sampler has devices of its own (`sharding.split_devices`)
    samplers: int = 1  # the hosts a step's rows are shared over (the whole-host split's last)

    @property
    def split(self) -> bool:
        return self.own and self.hosts == 1

    @property
    def per_host(self) -> bool:
        return self.hosts > 1


def make_meshes(
    config: Any, devices: Sequence[Any], hosts: Sequence[Sequence[Any]] | None = None
) -> Meshes:
    """The meshes of `config` over `devices` as a run places them (`sharding.split_devices`:
    with config.sampler_mesh.num_devices = N > 0 the last N / hosts of each host are the
    sampler's), with several hosts (`hosts`, default `devices` by process) one host's."""
    hosts = placement.devices_by_process(devices) if hosts is None else hosts
    trainer_devices, sampler_devices = sharding.split_devices(config, devices, hosts)
    mesh = sharding.make_mesh(config.mesh, trainer_devices)
    rules = sharding.logical_rules(config.mesh)
    own = sampler_devices is not None
    sampling = [h for h in hosts if not own or any(d in sampler_devices for d in h)]
    first = [d for d in sampling[0] if d in sampler_devices] if own else hosts[0]
    if len(hosts) > 1 or own:
        sampler, sampler_rules = sharding.make_sampler_mesh(
            config.sampler_mesh, first if len(hosts) > 1 else sampler_devices
        )
        return Meshes(mesh, rules, sampler, sampler_rules, len(hosts), own, len(sampling))
    return Meshes(mesh, rules, mesh, rules, samplers=1)


def train_shapes(config: Any, divisor: int, **given: int) -> TrainShapes:
    """The largest batch `build_batch` makes for `config` (a field of `given` that is > 0
    replaces its default): B = groups x rollouts padded as build_batch pads it; T =
    rl_loop.seq_len; B_t = B (per_trajectory: at most a row per trajectory) or
    tg.max_teacher_rows (per_turn); T_t = model.max_seq_len (a hinted sequence's limit);
    prefix = T (compact rows starting at the last student position)."""
    from tg_jax.rl.batch import num_rows  # noqa: PLC0415

    micro = int(config.rl.micro_batches) if "rl" in config else 1
    rows = num_rows(given.get("rows") or _config_rows(config), divisor, micro)
    seq_len = given.get("seq_len") or _config_seq_len(config)
    per_turn = "tg" in config and str(config.tg.teacher_mode) == "per_turn"
    teacher_rows = given.get("teacher_rows") or (
        int(config.tg.max_teacher_rows) if per_turn else rows
    )
    return TrainShapes(
        rows,
        seq_len,
        teacher_rows,
        given.get("teacher_len") or int(config.model.max_seq_len),
        given.get("prefix_len") or seq_len,
    )


def _config_rows(config: Any) -> int:
    """Rows of one train step: groups x rollouts per group (x turns with hidden thinking)."""
    for name in config.keys():
        s = config[name]
        if hasattr(s, "get") and s.get("groups_per_step") and s.get("rollouts_per_group"):
            rows = int(s.groups_per_step) * int(s.rollouts_per_group)
            from tg_jax.rl import hidden_thinking  # noqa: PLC0415 (as the train step's)

            return rows * hidden_thinking.rows_per_episode(config)
    raise ValueError("No groups_per_step / rollouts_per_group in the config: pass --train_rows")


def _config_seq_len(config: Any) -> int:
    """The padded student length: a section's `seq_len` when set, else model.max_seq_len."""
    for name in config.keys():
        s = config[name]
        if hasattr(s, "get") and s.get("seq_len"):
            return int(s.seq_len)
    return int(config.model.max_seq_len)


def _config_max_new(config: Any) -> int:
    """Generated-token slots of the decode cache: the config's decode budget per turn."""
    for name in config.keys():
        s = config[name]
        if hasattr(s, "get") and s.get("max_new_tokens"):
            return int(s.max_new_tokens)
    return 256


def compile_programs(
    config: Any,
    devices: Sequence[Any],
    what: Sequence[str],
    *,
    step: str = "tg",
    chunk: int = 512,
    decode_rows: int = 0,
    cache_len: int = 0,
    hosts: Sequence[Sequence[Any]] | None = None,
    **given: int,
) -> Iterator[Program]:
    """The `Program` of each of `what` ("train", "sample", "engine") for `config` on
    `devices`: the train step on the trainer's mesh, the sample step on the sampler's
    (`make_meshes`; with several hosts, one host's share of the rows with its bf16 copy of
    the weights); `given` = `train_shapes` overrides."""
    config = resolve_architecture(config)
    meshes = make_meshes(config, devices, hosts)
    mesh, rules = meshes.trainer, meshes.trainer_rules
    shapes = train_shapes(config, sharding.batch_divisor(mesh, rules), **given)
    micro = int(config.rl.micro_batches) if "rl" in config else 1
    logging.info("meshes %s; batch %s", meshes, shapes)
    for name in what:
        if name == "train" and step == "tg":
            compiled = compile_tg_train_step(config, mesh, rules, shapes)
            label = f"train step (TG, {micro} micro-batches of {shapes.rows // micro} rows)"
        elif name == "train":
            compiled = compile_lm_train_step(
                config, mesh, rules, shapes.rows, shapes.seq_len, chunk
            )
            label = f"train step (LM baseline, {shapes.rows} rows)"
        elif name == "sample":
            drows = decode_rows or _sampler_call_rows(config, shapes.rows, meshes.samplers)
            cache = cache_len or shapes.seq_len
            max_new = min(_config_max_new(config), cache // 2)
            compiled = compile_sample_step(
                config,
                meshes.sampler,
                meshes.sampler_rules,
                drows,
                cache,
                max_new,
                weights_dtype=_sampler_dtype(config, meshes),
            )
            label = f"sample step ({drows} rows, cache {cache})"
        elif name == "prompt":
            drows = decode_rows or _sampler_call_rows(config, shapes.rows, meshes.samplers)
            max_new = min(_config_max_new(config), shapes.seq_len // 2)
            compiled = aot_sampling.compile_sampler_call(
                config,
                meshes.sampler,
                meshes.sampler_rules,
                drows,
                shapes.seq_len,
                max_new,
                weights_dtype=_sampler_dtype(config, meshes),
            )
            label = f"sampler call ({drows} rows, prompts {shapes.seq_len - max_new} + {max_new})"
        elif name in ("engine", "engine_prefill"):
            yield _engine_program(config, meshes, shapes, prefill=name == "engine_prefill")
            continue
        elif name == "eval":
            yield _eval_program(config, meshes, shapes)
            continue
        else:
            raise ValueError(f"unknown program {name!r} (one of {PROGRAMS})")
        yield Program(
            label,
            compiled,
            meshes.trainer if name == "train" else meshes.sampler,
            resident_of(config, meshes, name),
        )


def _sampler_dtype(config: Any, meshes: Meshes) -> str | None:
    """The dtype of the sampler's weight matrices: its own copy's compute dtype (per host, or
    on its own devices), None where it reads the trainer's params (colocated on one host)."""
    return config.model.dtype if meshes.per_host or meshes.split else None


def _engine_program(
    config: Any,
    meshes: Meshes,
    shapes: TrainShapes,
    prefill: bool = False,
    geometry: Any = None,
    beside: int = 0,
) -> Program:
    """The built-in engine's decode call (prefill: its prefill call; `tg_jax.tpu.engine_fit`)
    on a host's sampler devices, for the rollouts' geometry (or `geometry`); beside it: the
    trainer's params and AdamW moments where the engine shares the trainer's chips on one
    host, else what `resident_of` puts beside a sampler and the published copy its weights were
    made from; and `beside` bytes more."""
    from tg_jax.engine import paged  # noqa: PLC0415
    from tg_jax.tpu import engine_fit  # noqa: PLC0415

    model = Transformer(ModelConfig.from_config(config.model))
    g = geometry or engine_fit.engine_shape(config, shapes.rows, meshes.samplers, shapes.seq_len)
    mesh = engine_fit.engine_mesh(config, meshes.sampler)
    params = abstract_params(model, mesh, sharding.SAMPLER_RULES)
    if _sampler_dtype(config, meshes):  # its own bf16 copy (colocated: the trainer's params)
        params = in_dtype(params, config.model.dtype)
    compile_call = engine_fit.compile_engine_prefill if prefill else engine_fit.compile_engine_step
    compiled = compile_call(config, mesh, g, params)
    if meshes.per_host or meshes.split:
        # + the published copy the engine's weights come from, less what they hold of it.
        outside = bytes_per_device(params) - bytes_per_device(paged.kept_params(model, params))
        resident = resident_of(config, meshes, "sample") + outside
    else:  # colocated: the trainer's params (published as they are) and AdamW moments
        resident = state_bytes(config, meshes.trainer, meshes.trainer_rules)
    call = (
        f"prefill call ({g.prefill_rows} rows of {g.prefill_chunk} tokens"
        if prefill
        else f"decode call ({g.slots} slots, {g.steps} token(s) a call"
    )
    label = (
        f"engine {call}, {g.num_pages - 1} pages of {g.page_size} tokens, tables {g.width} pages)"
    )
    return Program(label, compiled, mesh, resident + beside)


def _eval_program(config: Any, meshes: Meshes, shapes: TrainShapes) -> Program:
    """The evaluation's sampler call (`tg_jax.tpu.aot_sampling`): the built-in engine's decode
    call with the evaluation's own engine, the rollouts' pool beside it; or the lock-step
    call for the evaluation's episodes and contexts."""
    from tg_jax.sampling import agent_loop  # noqa: PLC0415
    from tg_jax.tpu import engine_fit  # noqa: PLC0415

    rows = aot_sampling.eval_rows(config, meshes.samplers)
    context = int(config.model.max_seq_len)
    max_new = min(aot_sampling.eval_max_new(config), context // 2)
    what = "periodic and final evaluation"
    if agent_loop.engine_kind(config.rl_loop) == "builtin":
        rollouts = engine_fit.engine_shape(config, shapes.rows, meshes.samplers, shapes.seq_len)
        mesh = engine_fit.engine_mesh(config, meshes.sampler)
        pool = engine_fit.pool_bytes_per_device(config, mesh, rollouts)
        g = engine_fit.engine_shape(config, rows, 1, context)
        p = _engine_program(config, meshes, shapes, geometry=g, beside=pool)
        return p._replace(name=f"{what}: {p.name}, + the rollouts' pool")
    compiled = aot_sampling.compile_sampler_call(
        config,
        meshes.sampler,
        meshes.sampler_rules,
        rows,
        context,
        max_new,
        weights_dtype=_sampler_dtype(config, meshes),
    )
    label = f"{what}: sampler call ({rows} rows, prompts {context - max_new} + {max_new})"
    return Program(label, compiled, meshes.sampler, resident_of(config, meshes, "sample"))


def _sampler_call_rows(config: Any, rows: int, hosts: int) -> int:
    """Rows of one sampler call as a run makes them: a host's share of the step's rows,
    at most `sampler_mesh.max_rows` (when set)."""
    share = -(-rows // hosts)
    cap = int(config.sampler_mesh.get("max_rows", 0)) if "sampler_mesh" in config else 0
    return min(share, cap) if cap else share


def resident_of(config: Any, meshes: Meshes, program: str) -> int:
    """Bytes per device that stay beside a program outside it. Split layout
    (`tg_jax.sampling.placement.WeightPublisher`): the published params (weight matrices in
    the compute dtype), the sampler's own copy beside the decode step, the staged copy (the
    sampler's specs on the trainer's devices) beside the next train step. Per-host samplers
    (`HostReplicas`): the host's bf16 copy (staged on its trainer chips) beside the train
    step; beside the decode step the trainer's params and AdamW moments (colocated) or the
    next bf16 copy arriving (on chips of its own). Colocated on one host: nothing beside the
    train step; beside a sampler call the trainer's state less the params it reads."""
    model = Transformer(ModelConfig.from_config(config.model))
    if not meshes.per_host and not meshes.split:  # the sampler reads the trainer's params
        if program == "train":
            return 0
        trainer_params = abstract_params(model, meshes.trainer, meshes.trainer_rules)
        return state_bytes(config, meshes.trainer, meshes.trainer_rules) - bytes_per_device(
            trainer_params
        )
    mesh = meshes.sampler
    if program == "train" and meshes.own:  # the staged copy: sampler specs on trainer chips
        tensor = int(meshes.sampler.shape.get("tensor", 1))
        devices = np.asarray(list(meshes.trainer.devices.flat)).reshape(-1, tensor)
        mesh = Mesh(devices, ("data", "tensor"))
    if meshes.per_host and program != "train" and not meshes.own:
        return state_bytes(config, meshes.trainer, meshes.trainer_rules)
    params = abstract_params(model, mesh, meshes.sampler_rules)
    return bytes_per_device(in_dtype(params, config.model.dtype))


PROGRAMS = ("train", "sample", "prompt", "engine", "engine_prefill", "eval")


class Program(NamedTuple):
    """A compiled program of `compile_programs`."""

    name: str
    compiled: Any
    mesh: Mesh
    resident: int  # bytes per device that stay on its devices outside it (`MemoryReport`)


def _define_flags() -> dict[str, Any]:
    """The command line's flags, defined only when this module runs as a program (tg_jax.main,
    which imports it for its fit check, has a --config flag of its own)."""
    return {
        "config": config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py)."),
        "topology": flags.DEFINE_string(
            "topology", "v5p:2x2x2", "TPU topology, e.g. v5p:2x4x4, v5e:4x4."
        ),
        "what": flags.DEFINE_list(
            "what", ["train", "sample"], f"Programs to compile, of {', '.join(PROGRAMS)}."
        ),
        "step": flags.DEFINE_enum(
            "step", "tg", ["tg", "lm"], "Train step: the real TG step or the LM baseline."
        ),
        "rows": flags.DEFINE_integer("train_rows", 0, "Student rows per train step; 0 = config."),
        "seq_len": flags.DEFINE_integer("seq_len", 0, "Student tokens per row; 0 = config."),
        "teacher_rows": flags.DEFINE_integer("teacher_rows", 0, "Teacher rows; 0 = the most."),
        "teacher_len": flags.DEFINE_integer(
            "teacher_len", 0, "Teacher tokens per row; 0 = model.max_seq_len."
        ),
        "prefix_len": flags.DEFINE_integer("prefix_len", 0, "Compact rows' prefix; 0 = seq_len."),
        "decode_rows": flags.DEFINE_integer(
            "decode_rows",
            0,
            "Rows per decode step; 0 = sampler_mesh.max_rows, else the train rows.",
        ),
        "cache_len": flags.DEFINE_integer("cache_len", 0, "KV-cache slots; 0 = the seq_len."),
        "chunk": flags.DEFINE_integer("chunk", 512, "Positions per logits chunk (LM baseline)."),
    }


_FLAGS: dict[str, Any] = {}


def main(argv: Sequence[str]) -> None:
    del argv
    f = {name: flag.value for name, flag in _FLAGS.items()}
    topology = f["topology"]
    if not re.fullmatch(r"v\w+:\d+(x\d+)*", topology):
        raise app.UsageError(f"--topology must look like v5p:2x4x4, got {topology!r}")
    devices = topology_devices(topology)
    hbm = hbm_bytes_per_device(topology, len(devices))
    print(f"topology {topology}: {len(devices)} devices {devices[0].device_kind}", flush=True)
    programs = compile_programs(
        f["config"],
        devices,
        f["what"],
        step=f["step"],
        chunk=f["chunk"],
        decode_rows=f["decode_rows"],
        cache_len=f["cache_len"],
        rows=f["rows"],
        seq_len=f["seq_len"],
        teacher_rows=f["teacher_rows"],
        teacher_len=f["teacher_len"],
        prefix_len=f["prefix_len"],
    )
    for p in programs:
        print(f"{p.name} on mesh {dict(p.mesh.shape)}", flush=True)
        print(memory_report(p.compiled, p.name, hbm, p.resident).format(), flush=True)


if __name__ == "__main__":
    _FLAGS.update(_define_flags())
    flags.mark_flags_as_required(["config"])
    app.run(main)
