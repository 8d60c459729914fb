"""A built-in rollout engine: continuous batching of generation requests over a paged KV pool.

  requests.py  `Request` / `Completion` (what goes in and out) and the per-sequence record
  pages.py     host-side page allocator (free list + refcounts) and the prefix index
  paged.py     the jitted device side: paged prefill chunks and decode steps, page copies
  engine.py    `Engine`: admission, chunked prefill, decode, preemption, prefix sharing
  batches.py   the arrays of the engine's calls from its sequences, the drawn tokens taken back
  vllm_engine.py  `VllmEngine`: the same request API on vLLM in this process (config
               `rl_loop.rollout_engine = "vllm"`), weight sync from the trainer's params

    engine = Engine(model, params, max_slots=8, page_size=16, max_pages_per_seq=64)
    completions = engine.generate([Request("a", prompt, max_new_tokens=64, temperature=1.0)])

The layer math is the decode path's (`tg_jax.models.fused_layers`: the same fused weights and
building blocks); only the cache is paged. Greedy draws equal `tg_jax.sampling.sampler.Sampler`'s,
and sampled draws equal its draws with `row_ids` = the requests' seeds (float rounding aside).
"""

from tg_jax.engine.engine import Engine
from tg_jax.engine.requests import Completion, Request
from tg_jax.engine.vllm_engine import VllmEngine, VllmRunner  # vllm itself: imported on use

__all__ = ["Completion", "Engine", "Request", "VllmEngine", "VllmRunner"]
