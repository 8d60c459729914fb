"""Figures on one accelerator chip (GPU or TPU): `python -m tg_jax.bench.accelerator`.

    python -m tg_jax.bench.accelerator --out acc.json          # Qwen3-0.6B shape, bf16
    python -m tg_jax.bench.accelerator --tiny                  # seconds, any backend (tests)

Sections, all on the first local device:
  peak    bf16 [n, n] @ [n, n] matmul through XLA: the measured peak every MFU here is a
          fraction of (the chip's nominal dense bf16 peak, where known, is printed beside it).
  train   the SFT step (`tg_jax.train.sft.make_sft_step`) on B x T tokens: tokens/s and MFU,
          MFU = 3 * flops_per_token(T) * B * T / seconds / peak.
  rl      the GRPO step and the TG step (every trajectory with a failed turn) and the TG step at
          a 10% share (`tg_jax.bench.rl_step`, interleaved): seconds, TG / GRPO, and MFU with
          model FLOPs = 3x the policy's forward over the batch's real tokens (+ the teacher's
          forward over its real tokens for TG, `rl_step.teacher_flops`).
  engine  the rollout engine (`tg_jax.engine.Engine`, continuous batching over a paged KV
          pool) at each `--decode_steps` (tokens a decode call draws per sequence) and the
          lock-step `Sampler`, generating N tokens for each of R prompts of P tokens:
          tokens/s, the engine's over the sampler's, and the share of the chip's memory
          bandwidth a decode step's weight reads alone would use at that rate (decode is
          bandwidth-bound at best; `--hbm_gbps` gives the chip's figure).

Model: Qwen3-0.6B's architecture (vocabulary 151,936, 28 layers, d 1024) with fp32 params and
bf16 compute, the mixed precision of a run on an accelerator; random weights (speed does not
depend on them). No figure here is a CPU figure: on CPU use `python -m tg_jax.bench`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from tg_jax import config_lib, tracing
from tg_jax.bench import rl_step, throughput
from tg_jax.bench.measure import time_calls
from tg_jax.models import ModelConfig, Transformer, init_params

# Nominal dense bf16 peaks (TFLOP/s) and memory bandwidths (GB/s) by device kind, for the
# printout only; MFU divides by the measured peak.
NOMINAL = {
    "NVIDIA H200": (989.0, 4800.0),
    "NVIDIA H100 80GB HBM3": (989.0, 3350.0),
    "TPU v5p": (459.0, 2765.0),
    "TPU v5 lite": (197.0, 819.0),
}
QWEN3_0_6B = dict(
    vocab_size=151_936,
    d_model=1024,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    mlp_dim=3072,
    tie_embeddings=True,
    rope_theta=1e6,
    max_seq_len=4096,
    param_dtype="float32",
    dtype="bfloat16",
)
TINY = dict(
    vocab_size=512,
    d_model=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    mlp_dim=128,
    tie_embeddings=True,
    max_seq_len=512,
    param_dtype="float32",
    dtype="float32",
)


def measure_peak(n: int, repeats: int = 10) -> float:
    """FLOP/s of a bf16 [n, n] @ [n, n] matmul (fp32 accumulation), median of `repeats`."""
    keys = jax.random.split(jax.random.key(0), 2)
    a, b = (jax.random.normal(k, (n, n), jnp.bfloat16) for k in keys)
    matmul = tracing.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    t = time_calls(lambda: matmul(a, b).block_until_ready(), repeats, warmup=2)
    return 2.0 * n**3 / t.median


def train_figures(model: ml_collections.ConfigDict, batch: int, seq_len: int, peak: float):
    base = ml_collections.ConfigDict()
    base.model, base.mesh = model, config_lib.mesh_config()
    base.sft = config_lib.sft_config()
    t = throughput.lm_step_timing(
        throughput.lm_step_config(base, model, batch, seq_len),
        repeats=5,
        warmup=1,
        devices=jax.devices()[:1],
    )
    flops = throughput.train_flops(ModelConfig.from_config(model), batch, seq_len)
    return {
        "batch": batch,
        "seq_len": seq_len,
        "step_s": t.median,
        "tok_s": batch * seq_len / t.median,
        "mfu": flops / t.median / peak,
    }


def rl_figures(model: ml_collections.ConfigDict, batch: int, seq_len: int, steps: int, peak):
    config = rl_step.bench_config(model)
    arms = ("grpo", "tg", "tg_10pct")
    res = rl_step.bench(config, batch_size=batch, seq_len=seq_len, steps=steps, arms=arms)
    batches, _ = rl_step.bench_batches(config, batch, seq_len, 0, 1)
    cfg = ModelConfig.from_config(model)
    real = int((np.asarray(batches["grpo"].segment_ids_BxT) > 0).sum())
    policy = 3.0 * cfg.flops_per_token(seq_len) * real
    out: dict[str, Any] = {"batch": batch, "seq_len": seq_len, "real_tokens": real}
    for arm in arms:
        flops = policy + (0.0 if arm == "grpo" else rl_step.teacher_flops(cfg, batches[arm]))
        out[f"{arm}_step_s"] = res[f"{arm}_wall_s"]
        out[f"{arm}_mfu"] = flops / res[f"{arm}_wall_s"] / peak
    out["tg_over_grpo"] = res["ratio_wall"]
    out["tg_over_grpo_10pct"] = res["tg_10pct_ratio_wall"]
    return out


def engine_figures(
    model_section,
    rows: int,
    prompt_len: int,
    new_tokens: int,
    hbm_gbps: float,
    decode_steps: Sequence[int] = (1, 8),
    log=print,
) -> dict[str, Any]:
    from tg_jax.engine import Engine, Request  # noqa: PLC0415
    from tg_jax.sampling.sampler import Sampler  # noqa: PLC0415

    cfg = ModelConfig.from_config(model_section)
    model = Transformer(cfg)
    params = init_params(model, jax.random.key(0))
    prompts = [list(map(int, p)) for p in throughput.sampler_prompts(rows, prompt_len, 256)]
    tokens = rows * new_tokens
    out: dict[str, Any] = {"rows": rows, "prompt_len": prompt_len, "new_tokens": new_tokens}
    sampler = Sampler(model, pad_id=0)

    def run_sampler() -> None:
        res = sampler.sample(params, prompts, max_new_tokens=new_tokens, rng=jax.random.key(1))
        assert all(len(t) == new_tokens for t in res.tokens)

    out["sampler_tok_s"] = tokens / time_calls(run_sampler, 3).median
    # Bytes a decode step must read at least: the weights once (in the compute dtype).
    weight_bytes = cfg.num_params() * jnp.dtype(cfg.jnp_dtype).itemsize
    for k in decode_steps:
        engine = Engine(
            model,
            params,
            max_slots=rows,
            page_size=16,
            prefill_chunk=256,
            max_pages_per_seq=-(-(prompt_len + new_tokens) // 16),
            prefill_rows=min(rows, 8),
            decode_steps=k,
        )
        calls = [0]

        def run_engine(engine=engine, calls=calls) -> None:
            calls[0] += 1
            reqs = [Request((calls[0], i), p, new_tokens, seed=i) for i, p in enumerate(prompts)]
            res = engine.generate(reqs)
            assert all(len(c.token_ids) == new_tokens for c in res), "engine stopped early"

        seconds = time_calls(run_engine, 3).median
        out[f"engine_k{k}_tok_s"] = tokens / seconds
        out[f"engine_k{k}_over_sampler"] = out[f"engine_k{k}_tok_s"] / out["sampler_tok_s"]
        if hbm_gbps:  # the share of the chip's bandwidth the weight reads alone take
            out[f"engine_k{k}_weight_read_share"] = (
                new_tokens * weight_bytes / seconds / (hbm_gbps * 1e9)
            )
        log(f"  engine decode_steps={k}: {out[f'engine_k{k}_tok_s']:.0f} tok/s")
    return out


def run(args: argparse.Namespace, log=print) -> dict[str, Any]:
    dev = jax.devices()[0]
    kind = dev.device_kind
    nominal_tflops, nominal_gbps = NOMINAL.get(kind, (0.0, 0.0))
    model = config_lib.model_config(**(TINY if args.tiny else QWEN3_0_6B))
    result: dict[str, Any] = {
        "device": kind,
        "platform": dev.platform,
        "jax": jax.__version__,
        "model": model.to_dict(),
        "sections": {},
    }
    sections = result["sections"]
    start = time.perf_counter()
    peak = measure_peak(args.peak_n)
    sections["peak"] = {"n": args.peak_n, "tflops": peak / 1e12, "nominal_tflops": nominal_tflops}
    log(f"[{time.perf_counter() - start:.0f}s] peak {peak / 1e12:.1f} TFLOP/s on {kind}")
    for name in args.sections.split(","):
        if name == "train":
            sections[name] = train_figures(model, args.train_batch, args.seq_len, peak)
        elif name == "rl":
            sections[name] = rl_figures(model, args.rl_batch, args.seq_len, args.rl_steps, peak)
        elif name == "engine":
            hbm = args.hbm_gbps or nominal_gbps
            steps = tuple(int(k) for k in args.decode_steps.split(","))
            sections[name] = engine_figures(
                model, args.rows, args.prompt_len, args.new_tokens, hbm, steps, log
            )
        else:
            raise ValueError(f"unknown section {name!r}; known: train, rl, engine")
        log(f"[{time.perf_counter() - start:.0f}s] {name}: {json.dumps(sections[name])}")
        if args.out:  # after each section: a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    return result


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON output file")
    p.add_argument("--tiny", action="store_true", help="a tiny fp32 model and small shapes")
    p.add_argument("--sections", default="train,rl,engine")
    p.add_argument("--peak_n", type=int, default=8192)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--train_batch", type=int, default=16)
    p.add_argument("--rl_batch", type=int, default=32)
    p.add_argument("--rl_steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--prompt_len", type=int, default=256)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--decode_steps", default="1,8", help="the engine's, one timing each")
    p.add_argument("--hbm_gbps", type=float, default=0.0, help="0 = the NOMINAL table's")
    args = p.parse_args(argv)
    if args.tiny:
        args.peak_n, args.seq_len, args.train_batch, args.rl_batch = 256, 128, 4, 8
        args.rl_steps, args.rows, args.prompt_len, args.new_tokens = 1, 4, 16, 8
    run(args)


if __name__ == "__main__":
    main()
