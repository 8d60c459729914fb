"""Agentic rollouts: lock-step batches with the `Sampler` against the engine's agent loops.

The workload (`make_workload`, seeded): E episodes of 2..T turns. Turn k of episode e
generates exactly n_ek tokens (no stop ids; n lognormal, coefficient of variation >= 1,
clipped), then a tool call takes t_ek seconds (90% lognormal around the median, 10% 10-20x
the median: a heavy tail) and appends `obs_tokens` tokens. Both arms sample the same
tokens counts at temperature 1 from the same model.

  lock-step  (a) one `Sampler.sample` call per turn index with every live episode (a
             `TurnCache` keeps their keys and values between turns, so a call prefills only
             the appended tokens), then the turn's tool calls in threads, waiting for the
             slowest; a call runs until its longest row is done.
  engine     (b) one thread per episode submits its next turn (`continue_from` its last turn)
             as soon as its tool call returns; the main thread alone drives `Engine.step`
             (nothing traces in two threads).
  vllm       (c, `--engines=builtin,vllm`) arm (b)'s threads on vLLM in this process
             (`VllmEngine`, the model exported to a temporary checkpoint): agentic/vllm_tok_s
             and agentic/builtin_over_vllm ((b)'s timed run over it), its start-up and one
             weight sync (seconds).

Both arms run the workload once untimed with zero tool latency (compiles every shape they
use), then once timed. KV memory is equal: the engine's page pool has the bytes of the
largest decode cache the lock-step arm allocated (B x (P + R) slots of its biggest call).

Figures: agentic/tok_s and agentic/lockstep_tok_s (generated tokens per wall second, tool
time included), agentic/speedup (their ratio), agentic/kv_bytes_per_live_token (bytes of the
pages in use per token whose keys and values they hold, averaged over the engine's steps;
the lock-step figure: cache bytes per live token of its calls), agentic/slot_occupancy (mean
fraction of engine slots holding a sequence per step). agentic/speedup_tool_bound: the
lock-step wall over the slowest episode's own tool seconds, which no engine's wall can go
below (the most any engine could gain on this workload).

Two more shapes (`agentic_section`'s arguments): agentic/step_* (an RL step: more episodes
than the KV memory holds rows, as `sampler_mesh.max_rows` plays a step's 1024 rollouts 256 at
a time in configs/qwen3_1p7b_tg.py: arm (a) plays them in chunks, one after the other; the
engine, at the same bytes, admits whatever its pages hold) and agentic/swe_* (the workload's
turns with real tools: each call runs its SWE task's tests in the environment's sandbox,
`swe_tool`; agentic/swe_tool_s_median is their measured seconds). Limits: a random-init
model (the figures are about scheduling, not quality); the tools' CPU competes with the
model's on a CPU machine, not on an accelerator; wall-clock figures on a shared CPU are noisy.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from tg_jax.engine import Engine, Request
from tg_jax.engine import paged as engine_paged
from tg_jax.models import ModelConfig, Transformer, init_params
from tg_jax.sampling.rows import batch_bucket, length_bucket
from tg_jax.sampling.sampler import Sampler
from tg_jax.sampling.turn_cache import TurnCache

SMALL_MODEL = dict(
    vocab_size=2048,
    d_model=256,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    head_dim=32,
    mlp_dim=768,
    max_seq_len=2048,
    rope_theta=10_000.0,
)


@dataclasses.dataclass
class Workload:
    """Per episode: prompt ids, per turn the tokens to generate, the tool's seconds and the
    observation ids it appends."""

    prompts: list[list[int]]
    turn_tokens: list[list[int]]
    tool_s: list[list[float]]
    observations: list[list[list[int]]]
    # A real tool instead of sleeping tool_s: tool(e, k) runs episode e's call k (`swe_tool`).
    tool: Callable[[int, int], None] | None = None

    def call_tool(self, e: int, k: int, sleep: bool) -> None:
        """Episode e's tool call after turn k: the real tool, else `tool_s` seconds of sleep
        (none when not `sleep`: the untimed runs)."""
        if not sleep:
            return
        if self.tool is not None:
            self.tool(e, k)
        else:
            time.sleep(self.tool_s[e][k])

    def max_context(self) -> int:
        return max(
            len(p) + sum(n) + sum(map(len, o))
            for p, n, o in zip(self.prompts, self.turn_tokens, self.observations, strict=True)
        )


def make_workload(
    episodes: int = 16,
    max_turns: int = 4,
    *,
    median_tokens: int = 16,
    max_tokens: int = 256,
    median_tool_s: float = 0.1,
    prompt_tokens: int = 32,
    obs_tokens: int = 12,
    vocab: int = 256,
    seed: int = 0,
) -> Workload:
    """A seeded synthetic workload (module docstring)."""
    rng = np.random.default_rng(seed)
    turns = rng.integers(2, max_turns + 1, episodes)
    # lognormal sigma 1.2: coefficient of variation sqrt(exp(1.44) - 1) = 1.8 before clipping
    lengths = [
        np.clip(np.rint(median_tokens * rng.lognormal(0, 1.2, t)), 2, max_tokens) for t in turns
    ]
    # Tool seconds: lognormal around the median; exactly 10% of the calls (at least one)
    # 12-20x the median (>= 10x the median of all calls).
    calls = int(turns.sum())
    tools = median_tool_s * rng.lognormal(0, 0.25, calls)
    heavy = rng.choice(calls, max(1, round(0.1 * calls)), replace=False)
    tools[heavy] = median_tool_s * rng.uniform(12, 20, heavy.size)
    tools = np.split(tools, np.cumsum(turns)[:-1])
    return Workload(
        prompts=[rng.integers(1, vocab, prompt_tokens).tolist() for _ in range(episodes)],
        turn_tokens=[x.astype(int).tolist() for x in lengths],
        tool_s=[t.tolist() for t in tools],
        observations=[
            [rng.integers(1, vocab, obs_tokens).tolist() for _ in range(t)] for t in turns
        ],
    )


def swe_tool(
    episodes: int, runner: str = "namespace", seed: int = 0, timeout_s: float = 10.0
) -> tuple[Callable[[int, int], None], list[float]]:
    """A real tool for a workload (`Workload.tool`): episode e's every call runs the tests of
    SWE task e (`tg_jax.envs.swe`, generated held-out repositories) in a fresh copy under the
    environment's test runner ("namespace": pytest in the kernel-enforced sandbox, as
    `run_tests` runs them). Returns (the tool, the list its calls append their seconds to)."""
    from tg_jax.envs.swe.env import run_in_copy  # noqa: PLC0415 (the SWE figures only)
    from tg_jax.envs.swe.generator import generate_swe_tasks  # noqa: PLC0415
    from tg_jax.envs.swe.runner import make_runner  # noqa: PLC0415

    tasks = generate_swe_tasks("heldout", episodes, seed=seed)
    run = make_runner(runner, cpu_s=5, memory_mb=512)
    seconds: list[float] = []
    lock = threading.Lock()

    def tool(e: int, k: int) -> None:
        del k
        t0 = time.perf_counter()
        run_in_copy(run, tasks[e].files, tasks[e].test_command, timeout_s)
        with lock:
            seconds.append(time.perf_counter() - t0)

    return tool, seconds


def run_lockstep(
    sampler: Sampler, params: Any, w: Workload, *, sleep: bool, rows: int = 0
) -> dict[str, float]:
    """Arm (a): one sample call per turn index with every live episode, then its tools; with
    `rows` > 0 the episodes are played `rows` at a time, one chunk after the other (what
    `sampler_mesh.max_rows` does to a step's rollouts when the KV cache holds only so many)."""
    n = len(w.prompts)
    chunks = (
        [list(range(i, min(i + rows, n))) for i in range(0, n, rows)] if rows else [list(range(n))]
    )
    contexts = [list(p) for p in w.prompts]
    tokens, kv_slots, live_tokens = 0, [], []
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(chunks[0])) as pool:
        for chunk in chunks:
            cache = TurnCache()
            for k in range(max(len(w.turn_tokens[e]) for e in chunk)):
                live = [e for e in chunk if k < len(w.turn_tokens[e])]
                max_new = [w.turn_tokens[e][k] for e in live]
                out = sampler.sample(
                    params,
                    [contexts[e] for e in live],
                    max_new_tokens=max_new,
                    temperature=1.0,
                    rng=jax.random.key(k),
                    row_ids=live,
                    cache=cache,
                    keys=live,
                )
                b = batch_bucket(len(live))
                p = length_bucket(max(len(contexts[e]) for e in live), sampler.length_multiple)
                kv_slots.append(b * (p + length_bucket(max(max_new), sampler.length_multiple)))
                live_tokens.append(
                    sum(len(contexts[e]) + m for e, m in zip(live, max_new, strict=True))
                )
                for e, toks in zip(live, out.tokens, strict=True):
                    contexts[e] += [int(t) for t in toks] + w.observations[e][k]
                    tokens += len(toks)
                list(pool.map(lambda e, k=k: w.call_tool(e, k, sleep), live))
    wall = time.perf_counter() - start
    return {
        "tokens": tokens,
        "wall_s": wall,
        "kv_slots": max(kv_slots),
        "slots_per_live_token": float(np.mean(np.divide(kv_slots, live_tokens))),
    }


def _episode(engine: Engine, w: Workload, e: int, sleep: bool, out: list[int]) -> None:
    """Arm (b)'s agent loop of one episode (runs in its own thread)."""
    previous = None
    for k, n in enumerate(w.turn_tokens[e]):
        rid = (e, k)
        prompt = w.prompts[e] if previous is None else w.observations[e][k - 1]
        engine.submit(
            Request(rid, prompt, n, temperature=1.0, continue_from=previous, seed=e * 64 + k)
        )
        done = engine.result(rid)
        if done.finish_reason == "error":
            raise RuntimeError(f"episode {e} turn {k}: {done.message}")
        out[e] += len(done.token_ids)
        w.call_tool(e, k, sleep)
        previous = rid
    engine.release(previous)


def _play_threads(engine: Any, w: Workload, sleep: bool, on_step=None) -> tuple[int, float]:
    """Per-episode threads submit their turns; this thread alone steps the engine (calling
    `on_step(seconds)` after each step). Returns (generated tokens, wall seconds)."""
    counts = [0] * len(w.prompts)
    threads = [
        threading.Thread(target=_episode, args=(engine, w, e, sleep, counts), daemon=True)
        for e in range(len(w.prompts))
    ]
    start = time.perf_counter()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        if engine.has_work():
            t0 = time.perf_counter()
            engine.step()
            if on_step is not None:
                on_step(time.perf_counter() - t0)
        else:
            time.sleep(0.0005)
    wall = time.perf_counter() - start
    for t in threads:
        t.join()
    if sum(counts) != sum(map(sum, w.turn_tokens)):
        raise RuntimeError(f"{type(engine).__name__} lost tokens (an episode failed)")
    return sum(counts), wall


def run_engine(engine: Engine, w: Workload, *, sleep: bool) -> dict[str, float]:
    """Arm (b): per-episode threads submit turns; this thread drives the engine's steps."""
    used, live, stepping = [], [], [0.0]

    def on_step(seconds: float) -> None:
        stepping[0] += seconds
        used.append(engine.allocator.num_used)
        live.append(engine.cached_tokens())

    tokens, wall = _play_threads(engine, w, sleep, on_step)
    slots_per_token = engine.page_size * float(np.sum(used)) / max(float(np.sum(live)), 1.0)
    return {
        "tokens": tokens,
        "wall_s": wall,
        "slots_per_live_token": slots_per_token,
        "step_s": stepping[0],
        "steps": len(used),
    }


def run_vllm(engine: Any, w: Workload, *, sleep: bool) -> dict[str, float]:
    """Arm (c): arm (b)'s agent loops on a `tg_jax.engine.VllmEngine` (vLLM schedules)."""
    tokens, wall = _play_threads(engine, w, sleep)
    return {"tokens": tokens, "wall_s": wall}


def vllm_figures(
    model: Transformer, params: Any, w: Workload, episodes: int, builtin: dict[str, float]
) -> dict[str, float]:
    """The workload on vLLM in this process (the model exported to a temporary checkpoint),
    after one untimed run; tok/s against the built-in engine's timed run (`builtin`)."""
    import tempfile  # noqa: PLC0415

    from tg_jax.engine.vllm_engine import VllmEngine  # noqa: PLC0415 (optional: .[vllm])
    from tg_jax.models.checkpoint_io import save_hf_checkpoint  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="tg_bench_vllm_") as ckpt:
        save_hf_checkpoint(ckpt, params, model.config)
        engine = VllmEngine(
            ckpt, model.config, max_slots=episodes, max_model_len=w.max_context() + 8
        )
        try:
            run_vllm(engine, w, sleep=False)
            t0 = time.perf_counter()
            engine.update_weights(params, 1)
            sync_s = time.perf_counter() - t0
            out = run_vllm(engine, w, sleep=True)
        finally:
            engine.close()
    tok_s = out["tokens"] / out["wall_s"]
    return {
        "agentic/vllm_tok_s": tok_s,
        "agentic/builtin_over_vllm": builtin["tok_s"] / tok_s,
        "agentic/vllm_start_s": engine.start_s,
        "agentic/vllm_weight_sync_s": sync_s,
    }


def compare(
    model: Transformer,
    params: Any,
    w: Workload,
    *,
    rows: int = 0,
    page_size: int = 16,
    prefill_chunk: int = 64,
    seed: int = 0,
    warmup: bool = True,
    engine_options: dict[str, Any] | None = None,
) -> tuple[dict[str, float], dict[str, float], Engine, dict[str, float]]:
    """Arms (a) and (b) on `w`, each once untimed (compiles) and once timed, at equal KV bytes
    (the engine's page pool has the bytes of the largest decode cache arm (a) allocated; with
    `rows`, arm (a) plays the episodes that many at a time, while the engine takes every
    episode its pages hold). Returns (arm a, arm b, the engine, its stats before the timed run)."""
    episodes = len(w.prompts)
    sampler = Sampler(model, pad_id=0, length_multiple=64)
    run_lockstep(sampler, params, w, sleep=False, rows=rows)  # compiles every bucket
    lock_traces = sampler.num_traces
    lock = run_lockstep(sampler, params, w, sleep=True, rows=rows)
    lock["compiles"] = float(sampler.num_traces - lock_traces)
    max_pages = -(-w.max_context() // page_size)
    num_pages = max(lock["kv_slots"] // page_size, max_pages + 1)
    engine = Engine(
        model,
        params,
        max_slots=episodes,
        page_size=page_size,
        max_pages_per_seq=max_pages,
        num_pages=num_pages,
        prefill_chunk=prefill_chunk,
        prefill_rows=2,
        rng=jax.random.key(seed),
        max_kept=4 * episodes,
        **(engine_options or {}),
    )
    run_engine(engine, w, sleep=False)  # compiles what it meets
    if warmup:
        engine.warmup()
    before = dict(engine.stats, traces=engine.num_traces)
    return lock, run_engine(engine, w, sleep=True), engine, before


def _figures(lock, eng, engine: Engine, before, model: Transformer) -> dict[str, float]:
    """The section's figures of one `compare` (module docstring)."""
    stats = engine.stats
    steps = stats["steps"] - before["steps"]
    busy = stats["slot_occupancy"] * stats["steps"]
    occupancy = (busy - before["slot_occupancy"] * before["steps"]) / max(steps, 1)
    slot_bytes = engine_paged.pool_bytes(model, 1, 1)
    return {
        "agentic/tok_s": eng["tokens"] / eng["wall_s"],
        "agentic/lockstep_tok_s": lock["tokens"] / lock["wall_s"],
        "agentic/speedup": lock["wall_s"] / eng["wall_s"],
        "agentic/kv_bytes_per_live_token": slot_bytes * eng["slots_per_live_token"],
        "agentic/lockstep_kv_bytes_per_live_token": slot_bytes * lock["slots_per_live_token"],
        "agentic/slot_occupancy": occupancy,
        "agentic/kv_bytes": float(engine.pool.nbytes()),
        "agentic/lockstep_kv_bytes": float(slot_bytes * lock["kv_slots"]),
        "agentic/tokens": float(eng["tokens"]),
        "agentic/preemptions": stats["preemptions"] - before["preemptions"],
        "agentic/compiles_timed": float(engine.num_traces - before["traces"]),
        "agentic/lockstep_compiles_timed": lock["compiles"],
        "agentic/engine_ms_per_step": 1000 * eng["step_s"] / max(eng["steps"], 1),
        "agentic/engine_busy_share": eng["step_s"] / eng["wall_s"],
    }


def agentic_section(
    *,
    episodes: int = 16,
    max_turns: int = 4,
    median_tokens: int = 16,
    max_tokens: int = 256,
    median_tool_s: float = 0.1,
    page_size: int = 16,
    prefill_chunk: int = 64,
    model_fields: dict[str, Any] | None = None,
    seed: int = 0,
    warmup: bool = True,
    engine_options: dict[str, Any] | None = None,
    vllm: bool = False,
    step_episodes: int = 0,
    step_rows: int = 0,
    swe_runner: str = "",
) -> dict[str, float]:
    """Runs both arms on one workload (module docstring) and returns the figures; with
    `vllm`, also arm (c) (`vllm_figures`: the `.[vllm]` extra).

    warmup: `Engine.warmup` before the timed run (compiles every bucket: without it, a batch
    composition the untimed run did not meet compiles inside the timed run).
    engine_options: more `Engine` arguments (e.g. bucket_slots=False).
    step_episodes, step_rows: also an RL step's shape, `agentic/step_*`: step_episodes
      episodes (the same distributions) at the KV bytes of step_rows rows (0: not run).
    swe_runner: also `agentic/swe_*`: the workload's turns with real SWE test runs as the
      tools (`swe_tool` with this runner; "": not run).
    """
    cfg = ModelConfig(**{**SMALL_MODEL, **(model_fields or {})})
    model = Transformer(cfg)
    params = init_params(model, jax.random.key(seed))
    shape = dict(
        median_tokens=median_tokens,
        max_tokens=max_tokens,
        seed=seed,
        median_tool_s=median_tool_s,
        vocab=min(cfg.vocab_size, 256),
    )
    w = make_workload(episodes, max_turns, **shape)
    kw = dict(
        page_size=page_size,
        prefill_chunk=prefill_chunk,
        seed=seed,
        warmup=warmup,
        engine_options=engine_options,
    )
    lock, eng, engine, before = compare(model, params, w, **kw)
    lengths = np.concatenate([np.asarray(n, float) for n in w.turn_tokens])
    tools = np.concatenate([np.asarray(t) for t in w.tool_s])
    out = _figures(lock, eng, engine, before, model) | {
        "agentic/turn_tokens_cv": float(lengths.std() / lengths.mean()),
        "agentic/heavy_tool_share": float(np.mean(tools >= 10 * np.median(tools))),
        "agentic/tool_s_median": float(np.median(tools)),
        # No engine's wall is below its slowest episode's tool seconds: the most any could gain.
        "agentic/speedup_tool_bound": lock["wall_s"] / max(sum(t) for t in w.tool_s),
    }
    if step_episodes:
        ws = make_workload(step_episodes, max_turns, **shape)
        figures = _figures(*compare(model, params, ws, rows=step_rows, **kw), model)
        out |= {k.replace("agentic/", "agentic/step_"): v for k, v in figures.items()}
    if swe_runner:
        tool, seconds = swe_tool(episodes, swe_runner, seed)
        figures = _figures(*compare(model, params, dataclasses.replace(w, tool=tool), **kw), model)
        names = ("tok_s", "lockstep_tok_s", "speedup", "slot_occupancy", "engine_busy_share")
        out |= {f"agentic/swe_{n}": figures[f"agentic/{n}"] for n in names}
        out["agentic/swe_tool_s_median"] = float(np.median(seconds))
    if vllm:
        out |= vllm_figures(model, params, w, episodes, {"tok_s": out["agentic/tok_s"]})
    return out


__all__ = [
    "Workload",
    "agentic_section",
    "compare",
    "make_workload",
    "run_engine",
    "run_lockstep",
    "run_vllm",
    "swe_tool",
    "vllm_figures",
]
