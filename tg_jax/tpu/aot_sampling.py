"""The sampling side of a run, ahead of time: the lock-step sampler's whole call, the
evaluation's sampler, vLLM's reservation and the per-step trajectory gather.

`tg_jax.tpu.aot.compile_programs` compiles these beside the train step; `tg_jax.tpu.fit`
lists them. What each one is:
* prompt: the lock-step sampler's call on whole prompts (`Sampler` kind "prompt",
  `sampling.decoding.sample_tokens`: prefill + decode loop in one program), lowered through
  the run's own `Sampler` on its mesh: a host's share of the step's episodes (at most
  `sampler_mesh.max_rows`), each prompt as long as a turn's context may be (the student's
  `seq_len` less one turn's decode budget), the decode budget `rl_loop.max_new_tokens`.
* eval: the evaluation's call. The periodic evaluation (`rl_loop.eval_tasks` episodes) and
  the final one (a sampling process's share of `eval.num_tasks`, one call per sample) play
  on the rollout sampler's devices with contexts up to `model.max_seq_len` and
  `eval.max_new_tokens` a turn: the lock-step call for the larger of the two, or the
  built-in engine's decode call with the engine the evaluation builds (its own slots and
  pool) while the rollouts' engine keeps its pool (resident beside it).
* vLLM (`rl_loop.rollout_engine` "vllm"): not compiled here; one engine per sampling host
  on one chip, holding the checkpoint's weights in `model.dtype` and the KV cache
  `vllm_engine.kv_cache_bytes` reserves (`kv_cache_memory_bytes`).
* gather (several hosts): `multihost.allgather_objects` of the step's trajectories, a
  host's share pickled and all-gathered onto every chip in slices of
  `multihost.gather_buffer` bytes (at most `GATHER_CHUNK_BYTES`): processes x that slice per
  chip, the share sized from a trajectory of the longest student length (with its routing
  record under router replay) pickled as the run pickles it.
"""

from __future__ import annotations

import pickle
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from tg_jax import multihost, sharding
from tg_jax.models import ModelConfig, Transformer
from tg_jax.sampling.rows import batch_bucket, length_bucket
from tg_jax.sampling.sampler import Sampler
from tg_jax.sampling.trajectory import Trajectory
from tg_jax.tpu.aot_steps import abstract_params, in_dtype


def compile_sampler_call(
    config: Any,
    mesh: Any,
    rules: Any,
    rows: int,
    context: int,
    max_new: int,
    weights_dtype: str | None = None,
) -> Any:
    """The lock-step sampler's whole call (module docstring) for `rows` episodes whose prompts
    fill `context - max_new` tokens, on `mesh` as `placement.rollout_sampler` builds the
    sampler there (row streams per episode, as rollouts draw them)."""
    cfg = ModelConfig.from_config(config.model)
    model = Transformer(cfg)
    params = abstract_params(model, mesh, rules)
    if weights_dtype:
        params = in_dtype(params, weights_dtype)
    divisor = sharding.batch_divisor(mesh, rules)
    kw = {"mesh": mesh, "rules": rules} if mesh.devices.size > 1 else {}
    sampler = Sampler(model, pad_id=0, batch_divisor=divisor, record_routes=cfg.router_replay, **kw)
    b = batch_bucket(rows, divisor)
    n = length_bucket(max(int(max_new), 1), sampler.length_multiple)
    p = length_bucket(max(int(context) - int(max_new), 1), sampler.length_multiple)

    def a(shape, dtype):  # as `Sampler.place` places a call's host arrays
        return jax.ShapeDtypeStruct(
            shape, dtype, sharding=sharding.data_sharding(mesh, rules, len(shape))
        )

    i32, f32 = jnp.int32, jnp.float32
    args = (
        a((b, p), i32),  # prompts
        a((b,), i32),  # their lengths
        a((b,), i32),  # max_new_B
        a((b, sampler.stop_width), i32),
        a((b,), f32),  # temperature
        a((b,), i32),  # top_k
        a((b,), f32),  # top_p
        a((b,), i32),  # the rows' random streams
    )
    key = jax.random.key(0)
    rng = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, PartitionSpec()))
    per_shard, context = sampler.in_mesh(params)  # one loop per shard of rows, or one loop
    with context:
        lowered = sampler._jitted.lower(  # noqa: SLF001 (the sampler's own program)
            params, *args, rng, kind="prompt", max_new_bucket=n, per_shard=per_shard, per_row=True
        )
    return lowered.compile()


def eval_rows(config: Any, samplers: int) -> int:
    """Episodes of the evaluation's largest sampler call on one sampling host: the periodic
    evaluation's or a host's share of the final one's, at most `sampler_mesh.max_rows`."""
    periodic = int(config.rl_loop.get("eval_tasks", 0)) if "rl_loop" in config else 0
    ev = config.get("eval") or {}
    final = -(-int(ev.get("num_tasks", 0)) // max(1, samplers))  # a call per sample
    rows = max(periodic, final, 1)
    cap = int(config.sampler_mesh.get("max_rows", 0)) if "sampler_mesh" in config else 0
    return min(rows, cap) if cap else rows


def eval_max_new(config: Any) -> int:
    """A turn's decode budget in the evaluation (the larger of the periodic one's,
    `rl_loop.max_new_tokens`, and `eval.max_new_tokens`)."""
    ev = config.get("eval") or {}
    loop = int(config.rl_loop.get("max_new_tokens", 0)) if "rl_loop" in config else 0
    return max(int(ev.get("max_new_tokens", 0)), loop, 1)


def vllm_bytes(config: Any) -> tuple[int, int]:
    """(weights, KV cache) bytes a vLLM engine holds on its chip: the checkpoint's params in
    `model.dtype`, and the KV bytes `VllmEngine` reserves for its slots at `model.max_seq_len`
    (`kv_cache_bytes`; slots `rl_loop.engine_slots`, 0 = the step's episodes)."""
    from tg_jax.engine.vllm_engine import kv_cache_bytes  # noqa: PLC0415

    cfg = ModelConfig.from_config(config.model)
    weights = cfg.num_params() * np.dtype(cfg.jnp_dtype).itemsize
    lc = config.rl_loop
    slots = int(lc.get("engine_slots", 0)) or int(lc.groups_per_step) * int(lc.rollouts_per_group)
    return int(weights), kv_cache_bytes(cfg, slots, int(cfg.max_seq_len))


def gather_bytes(config: Any, rows: int, seq_len: int, hosts: int) -> int:
    """Bytes per chip of the step's trajectory gather over `hosts` processes (module
    docstring): `rows` trajectories of `seq_len` tokens, a host's share pickled."""
    if hosts <= 1:
        return 0
    cfg = ModelConfig.from_config(config.model)
    n = int(seq_len)
    routes = None
    if cfg.router_replay:
        routes = np.zeros((n, cfg.num_layers, cfg.experts_per_token), np.int16)
    one = Trajectory(
        tokens=np.zeros((n,), np.int32),
        roles=np.zeros((n,), np.int8),
        turn_ids=np.zeros((n,), np.int32),
        turn_starts=np.zeros((1,), np.int32),
        behaviour_logprobs=np.zeros((n,), np.float32),
        turn_verdicts=[{}],
        rewards={},
        hint_tokens={},
        group_id=0,
        policy_version=0,
        task_id="",
        routed_experts=routes,
    )
    share = -(-int(rows) // hosts)
    size = share * len(pickle.dumps(one, protocol=pickle.HIGHEST_PROTOCOL))
    return hosts * multihost.gather_buffer(size)


__all__ = [
    "compile_sampler_call",
    "eval_max_new",
    "eval_rows",
    "gather_bytes",
    "vllm_bytes",
]
