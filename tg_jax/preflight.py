"""The start-up check of a run against what it will meet: checkpoint shapes, the engine's
limits, the reward weights.

`tg_jax.main` calls `check(config)` once, after the config is read and the devices are known,
before any data, SFT or RL stage. Each problem is a `ConfigError` (one `error: invalid
config:` line, exit 2) naming the field to change:

  shardings  every program's params (the trainer's mesh, the sampler's copy, the engine's
             mesh) against the model's real shapes (`model.hf_checkpoint`'s config.json):
             a dimension that does not divide its mesh axis is replicated over it
             (`sharding.fit_spec`, what every program does; the MoE experts' [E, D, F]
             weights too: their `shard_map` takes them as placed), a note; refused is a
             large param the trainer would hold whole on every device (as
             `sharding.check_params_sharded`). docs/tpu.md.
  engine     "vllm": the head dims and dtypes vLLM's attention runs on this platform
             (`vllm_engine.platform_limits`, read from the installed vllm); "builtin": a KV
             page no longer than the context, a pool that holds one whole context.
  rewards    `rl.reward_weights` against env.requirements and the environment's reward
             components (`advantages.resolve_weights`): a requirement without a weight gets
             its own, a non-zero weight nothing provides is refused naming both.

The pure parts (`sharding_problems`, `engine_problems`, `reward_weights`) take shapes and
sizes, so tests cover many checkpoints without building a mesh or running a step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from tg_jax.errors import ConfigError

# A trainer param of at least this many elements may not end up whole on every device
# (`sharding.check_params_sharded`'s threshold).
MIN_SPLIT_SIZE = 2**20
# The model field of each dimension of the MoE experts' [E, D, F] weights, named in their
# notes (replicated like any other dimension: tg_jax.models.moe takes them as placed).
_FIELDS = {"expert": "num_experts", "embed": "d_model", "moe_mlp": "moe_mlp_dim"}


@dataclasses.dataclass(frozen=True)
class Program:
    """One program's params layout: its name, the config section of its mesh, the mesh's
    axis sizes and its logical rules."""

    name: str
    section: str
    axes: Mapping[str, int]
    rules: Any


def abstract_params(model_cfg: Any) -> Any:
    """The model's params as abstract, logically annotated leaves (no memory)."""
    import jax
    import jax.numpy as jnp

    from tg_jax import tracing
    from tg_jax.models import Transformer

    model = Transformer(model_cfg)
    tokens = jnp.zeros((1, 1), jnp.int32)
    return tracing.eval_shape(lambda k: model.init(k, tokens)["params"], jax.random.key(0))


def sharding_problems(
    model_cfg: Any, programs: Sequence[Program], abstract: Any = None
) -> tuple[list[str], list[str]]:
    """(errors, notes) of `programs`' params for `model_cfg`: an error for each large trainer
    param the mesh cannot split (`check`), a note for each dimension replicated because it
    does not divide its mesh axis (an MoE expert weight's naming its model field)."""
    from tg_jax import sharding

    abstract = abstract_params(model_cfg) if abstract is None else abstract
    errors, notes = [], []
    for p in programs:
        unfit = sharding.unfit_dims(abstract, p.axes, p.rules)
        for path, dim, size, want, kept in unfit:
            lost = [a for a in want if a not in kept]
            axis = "/".join(f"{a!r} ({p.axes[a]})" for a in lost)
            names = _logical_names(abstract, path)
            field = _FIELDS.get(names[dim]) if "expert" in names else None
            why = f" (model.{field} {size}: the MoE experts' weights)" if field else ""
            notes.append(
                f"{p.name}: {path} dimension {dim} ({size}) does not divide mesh axis {axis}: "
                f"replicated over it{why}"
            )
        if p.section == "mesh":
            errors += _whole_params(abstract, p, unfit)
    return errors, notes


def _logical_names(abstract: Any, path: str) -> tuple[str | None, ...]:
    """The logical axis names of the leaf at `path` (keystr)."""
    import flax.linen as nn
    import jax

    for key, leaf in jax.tree_util.tree_leaves_with_path(
        abstract, is_leaf=lambda x: isinstance(x, nn.Partitioned)
    ):
        if jax.tree_util.keystr(key) == path and isinstance(leaf, nn.Partitioned):
            return tuple(leaf.names)
    return ()


def _whole_params(abstract: Any, p: Program, unfit: list) -> list[str]:
    """Errors for large params the rules split but the mesh leaves whole on every device."""
    import flax.linen as nn
    import jax

    if math.prod(p.axes.values()) == 1:
        return []
    lost: dict[str, list] = {}
    for path, dim, size, want, _ in unfit:
        lost.setdefault(path, []).append((dim, size, want))
    out = []
    for key, leaf in jax.tree_util.tree_leaves_with_path(
        abstract, is_leaf=lambda x: isinstance(x, nn.Partitioned)
    ):
        path = jax.tree_util.keystr(key)
        value = leaf.value if isinstance(leaf, nn.Partitioned) else leaf
        names = leaf.names if isinstance(leaf, nn.Partitioned) else ()
        split = [n for n in names if n is not None and nn.logical_to_mesh_axes((n,), p.rules)[0]]
        if path not in lost or math.prod(value.shape) < MIN_SPLIT_SIZE:
            continue
        if len(lost[path]) == len([s for s in split if _sized(s, p)]):
            dims = ", ".join(f"dimension {d} ({n}) over {w}" for d, n, w in lost[path])
            out.append(
                f"the trainer's mesh (mesh.shape {dict(p.axes)}) would hold {path} "
                f"{tuple(value.shape)} whole on every device: {dims} do not divide; set "
                "mesh.shape so that one of them does"
            )
    return out


def _sized(logical: str, p: Program) -> bool:
    import flax.linen as nn

    axes = nn.logical_to_mesh_axes((logical,), p.rules)[0]
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return math.prod(p.axes.get(a, 1) for a in axes) > 1


def engine_problems(
    model_cfg: Any,
    loop: Any,
    vllm_limits: tuple[tuple[int, ...] | None, tuple[str, ...]] | None = None,
    platform: str = "cpu",
) -> list[str]:
    """Why the rollout engine `loop.rollout_engine` cannot serve `model_cfg`, or [].

    Args:
      model_cfg: the resolved `ModelConfig` (the checkpoint's head_dim, dtype, max_seq_len).
      loop: config.rl_loop.
      vllm_limits: (head dims, dtypes) of vLLM here (`vllm_engine.platform_limits`).
    """
    from tg_jax.engine import vllm_engine

    kind = str(loop.get("rollout_engine", "builtin"))
    context = int(model_cfg.max_seq_len)
    if kind == "vllm" and vllm_limits is not None:
        try:
            vllm_engine.check_model(model_cfg, *vllm_limits, where=platform)
        except ValueError as e:
            return [str(e)]
    if kind == "builtin":
        page = int(loop.get("engine_page_size", 16))
        if page > context:
            return [
                f"rl_loop.engine_page_size {page} > the context model.max_seq_len {context}: "
                f"a KV page longer than a whole sequence; set rl_loop.engine_page_size <= {context}"
            ]
        kv = int(loop.get("engine_kv_tokens", 0))
        whole = -(-context // page) * page
        if 0 < kv < whole:
            return [
                f"rl_loop.engine_kv_tokens {kv} cannot hold one whole context (model.max_seq_len "
                f"{context} in pages of {page}: {whole} tokens); set it to 0 or >= {whole}"
            ]
    return []


def programs(config: Any, model_cfg: Any, devices: Sequence[Any] | None = None) -> list[Program]:
    """The params layouts a run of `config` uses on `devices` (default: jax's): the trainer's
    mesh, the sampler's copy (its own mesh, or each process's over its trainer devices), and
    the built-in engine's mesh."""
    import jax

    from tg_jax import sharding
    from tg_jax.engine import placement as engine_placement

    devices = list(devices) if devices is not None else jax.devices()
    trainer, sampler = sharding.split_devices(config, devices)
    sizes = sharding.resolve_mesh_shape(config.mesh.shape, len(trainer))
    rules = sharding.logical_rules(config.mesh)
    out = [Program("the trainer", "mesh", dict(zip(config.mesh.axes, sizes, strict=True)), rules)]
    processes = {int(getattr(d, "process_index", 0)) for d in devices}
    sm = config.get("sampler_mesh")
    if sm is not None and (sampler or len(processes) > 1):
        per = len(sampler or trainer) // max(1, len(processes))
        if sm.get("processes"):
            per = len(sampler) // int(sm.processes)
        shape = sharding.resolve_mesh_shape(sm.shape, per)
        axes = dict(zip(sm.axes, shape, strict=True))
        out.append(Program("the sampler", "sampler_mesh", axes, sharding.SAMPLER_RULES))
        engine = axes
    else:  # colocated: the engine remakes a mesh over the trainer's devices
        n = len(trainer)
        tensor = math.gcd(n, int(model_cfg.num_kv_heads)) if n > 1 else 1
        engine = {"data": n // tensor, "tensor": tensor}
    del engine_placement  # its Placement takes the sampler's rules on this mesh
    lc = config.get("rl_loop")
    if lc is not None and str(lc.get("rollout_engine", "builtin")) == "builtin":
        out.append(Program("the engine", "sampler_mesh", engine, sharding.SAMPLER_RULES))
    return out


def model_config(config: Any) -> Any:
    """The run's `ModelConfig`: config.model with `model.hf_checkpoint`'s architecture."""
    from tg_jax.models import ModelConfig

    if config.model.get("hf_checkpoint"):
        from tg_jax.models import hf_dir

        md = hf_dir.open_model_dir(
            config.model.hf_checkpoint, tool_format=config.model.get("tool_format", "")
        )
        return ModelConfig.from_config(hf_dir.resolve_model_section(config.model, md))
    return ModelConfig.from_config(config.model)


def _run_configs(config: Any) -> list[Any]:
    if config.stage == "pipeline" and "pipeline" in config:
        from tg_jax.train import pipeline

        return [pipeline.arm_config(config, a) for a in config.pipeline.arms]
    return [config]


def check(config: Any, devices: Sequence[Any] | None = None) -> list[str]:
    """Raises ConfigError (the first problem, naming the field to change) where the run of
    `config` cannot go; returns the notes (dimensions replicated) otherwise. Skipped for the
    data stage (no model)."""
    if config.stage == "data" or "model" not in config:
        return []
    try:
        model_cfg = model_config(config)
        errors, notes = sharding_problems(model_cfg, programs(config, model_cfg, devices))
    except ValueError as e:  # a checkpoint directory or mesh that cannot be used
        raise ConfigError(str(e)) from e
    if config.stage != "pipeline":
        if errors:
            raise ConfigError(errors[0])
        return notes
    from tg_jax.train import reward_weights

    limits = None
    for c in _run_configs(config):
        lc = c.get("rl_loop")
        if lc is not None and str(lc.get("rollout_engine", "builtin")) == "vllm" and not limits:
            limits = _vllm_limits()
        if lc is not None:
            errors += engine_problems(model_cfg, lc, limits, _platform())
        if "rl" in c and "env" in c:
            try:
                reward_weights.reward_weights(c)
            except ValueError as e:
                errors.append(str(e))
    if errors:
        raise ConfigError(errors[0])
    return notes


def _vllm_limits() -> tuple[tuple[int, ...] | None, tuple[str, ...]]:
    from tg_jax.engine import vllm_engine

    try:
        return vllm_engine.platform_limits()
    except ImportError as e:
        raise ConfigError(str(e)) from e


def _platform() -> str:
    import jax

    return jax.default_backend()


__all__ = ["Program", "check", "engine_problems", "programs", "sharding_problems"]
