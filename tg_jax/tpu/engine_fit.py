"""The built-in engine's decode call compiled ahead of time (`python -m tg_jax.tpu.aot
--what=engine`): the fit of `rl_loop.rollout_engine = "builtin"` on a pod's chips.

It lowers the engine's decode call (`tg_jax.engine.paged.sample_steps` as `decode_jit` jits
it, what `Engine` runs each step, its unread arguments kept: they stay in memory) on the mesh
an `Engine` makes on the sampler's devices (`tg_jax.engine.placement`: weights and the
pool's KV heads over "tensor"), for the geometry
`EngineRunner` builds from the config: `rl_loop.engine_slots` decode rows (0 = a host's
episodes of a step), a pool of `rl_loop.engine_kv_tokens` tokens (0 = every slot at its whole
context) in pages of `rl_loop.engine_page_size`, page tables as wide as one whole context (the
widest bucket, so the largest gather), `rl_loop.engine_decode_steps` tokens a call. The
weights are in the dtype a run gives the engine (a host's bf16 copy on several hosts, the
trainer's param_dtype colocated on one), prepared as `Engine.update_weights` prepares them
(`kept_params`: the params its weights hold by reference).
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from tg_jax import sharding, tracing
from tg_jax.engine import paged
from tg_jax.engine.placement import Placement, for_sampler
from tg_jax.models import ModelConfig, Transformer
from tg_jax.sampling import agent_loop
from tg_jax.tpu import hbm


class EngineShape(NamedTuple):
    """The compiled geometry: decode rows, tokens a page, pages in the pool (+ the scratch
    page), page-table width, tokens a call; a prefill call's rows and tokens a row."""

    slots: int
    page_size: int
    num_pages: int
    width: int
    steps: int
    prefill_rows: int = 4
    prefill_chunk: int = 64


def engine_shape(config: Any, rows: int, hosts: int, context: int) -> EngineShape:
    """The geometry `agent_loop.runner_from_config` gives a host's engine (the runner it
    builds, read back): `rows` episodes a step over `hosts` hosts, contexts of `context`
    tokens."""
    model = Transformer(ModelConfig.from_config(config.model))
    config = copy.deepcopy(config)
    config.rl_loop.rollout_engine = "builtin"  # the geometry it would have
    runner = agent_loop.runner_from_config(
        config, None, model, episodes=-(-rows // hosts), max_total_tokens=context, pad_id=0
    )
    return EngineShape(
        runner.slots,
        runner.page_size,
        runner.num_pages,
        runner.max_pages,
        runner.decode_steps,
        runner.prefill_rows,
        runner.prefill_chunk,
    )


def engine_mesh(config: Any, sampler_mesh: Any) -> Any:
    """The mesh an `Engine` makes on `sampler_mesh`'s devices."""
    return for_sampler(sampler_mesh, ModelConfig.from_config(config.model).num_kv_heads)


def _engine_inputs(config: Any, mesh: Any, geometry: EngineShape, params: Any):
    """(model, the engine's weights as `Engine` holds them, its pool, its `Placement`) as
    abstract arrays on the engine's `mesh` for `geometry`."""
    cfg = ModelConfig.from_config(config.model)
    model = Transformer(cfg)
    place = Placement(model, mesh)

    def prepare(p):
        with nn.logical_axis_rules(sharding.SAMPLER_RULES):
            return paged.engine_weights(model, p)

    with jax.set_mesh(mesh):
        prepared = tracing.jit(prepare).lower(params).compile()
    weights = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        tracing.eval_shape(prepare, params),
        prepared.output_shardings,
    )
    weights = paged.with_params(model, weights, params)  # by reference, as `Engine` holds them
    return model, weights, _abstract_pool(cfg, place, geometry), place


def _abstract_pool(cfg: ModelConfig, place: Placement, g: EngineShape) -> paged.PagedPool:
    """The engine's KV pool (and routing record) for `g` as abstract arrays placed as
    `Placement` places them: KV heads over "tensor", the routing record replicated."""
    kv = jax.ShapeDtypeStruct(
        (g.num_pages, g.page_size, cfg.num_kv_heads, cfg.head_dim),
        cfg.jnp_dtype,
        sharding=place.kv,
    )
    routes = None
    if cfg.router_replay:
        shape = (g.num_pages, g.page_size, cfg.num_layers, cfg.experts_per_token)
        routes = jax.ShapeDtypeStruct(shape, jnp.int16, sharding=place.replicated)
    return paged.PagedPool((kv,) * cfg.num_layers, (kv,) * cfg.num_layers, routes)


def pool_bytes_per_device(config: Any, mesh: Any, geometry: EngineShape) -> int:
    """Bytes per device of an engine's KV pool (and routing record) for `geometry`: what an
    engine keeps on its chips between calls."""
    cfg = ModelConfig.from_config(config.model)
    return hbm.bytes_per_device(_abstract_pool(cfg, Placement(Transformer(cfg), mesh), geometry))


def compile_engine_step(config: Any, mesh: Any, geometry: EngineShape, params: Any) -> Any:
    """The compiled decode call for `geometry` on the engine's `mesh` (`engine_mesh`), its
    params abstract arrays placed as `Placement.params` places them (module docstring)."""
    model, weights, pool, place = _engine_inputs(config, mesh, geometry, params)
    g = geometry
    b = g.slots
    rows = NamedSharding(mesh, PartitionSpec("data" if b % place.data == 0 else None))

    def a(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rows)

    batch = {
        name: a((b,), jnp.int32) for name in ("tokens", "pos", "seed", "index", "top_k", "steps")
    }
    batch.update(
        active=a((b,), jnp.bool_),
        temperature=a((b,), jnp.float32),
        top_p=a((b,), jnp.float32),
        stop=a((b, 4), jnp.int32),
        table=a((b, g.width), jnp.int32),
    )
    key = jax.random.key(0)
    rng = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=place.replicated)
    # `paged.decode_jit`'s function and arguments, keeping the arguments it does not read: the
    # engine holds all of its weights while the call runs.
    jitted = tracing.jit(
        paged.sample_steps, static_argnums=(0, 5), donate_argnums=(2,), keep_unused=True
    )
    with jax.set_mesh(mesh):
        return jitted.lower(model, weights, pool, rng, batch, g.steps).compile()


def compile_engine_prefill(config: Any, mesh: Any, geometry: EngineShape, params: Any) -> Any:
    """The compiled prefill call (`paged.prefill_chunk` as `prefill_jit` jits it, what
    `Engine` runs for up to `prefill_rows` sequences a call, `prefill_chunk` tokens each)
    against the widest page table, on the engine's `mesh`."""
    model, weights, pool, place = _engine_inputs(config, mesh, geometry, params)
    g = geometry
    b, c = g.prefill_rows, g.prefill_chunk

    def a(shape):  # host arrays as `Placement.host` places them: rows over "data"
        rows = PartitionSpec("data" if shape[0] % place.data == 0 else None)
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=NamedSharding(mesh, rows))

    jitted = tracing.jit(
        paged.prefill_chunk, static_argnums=(0,), donate_argnums=(2,), keep_unused=True
    )
    with jax.set_mesh(mesh):
        return jitted.lower(
            model, weights, pool, a((b, c)), a((b,)), a((b,)), a((b, g.width))
        ).compile()


__all__ = [
    "EngineShape",
    "compile_engine_prefill",
    "compile_engine_step",
    "engine_mesh",
    "engine_shape",
    "pool_bytes_per_device",
]
