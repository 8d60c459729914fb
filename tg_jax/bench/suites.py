"""Benchmark suites (sizes and repeats) and the sections that produce the figures.

quick  a few minutes on a 2-core CPU: batch 64 sampler, one timed step per train config
       (the mid-size config at 2 x 512), 2 steps per RL arm on 32 x 384, 3 timed RL steps
       per overlap mode and layout.
full   the sizes of the issue: sampler batches 8 / 64 / 256, mid-size at 8 x 512, 3 repeats,
       a full thread sweep of the reference, RL arms on 64 x 384 (9 interleaved steps), 3 timed
       overlap steps.
micro  seconds, tiny shapes (tests/test_bench.py): every figure exists and is finite.

Every section returns a dict of figures (float, or str for settings); `run_suite` collects
them under "sections" and flattens the numbers into "figures" (the table).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import ml_collections

from tg_jax import config_files, config_lib
from tg_jax.bench import agentic, e2e, hf_reference, measure, overlap, throughput
from tg_jax.bench import sandbox as sandbox_bench
from tg_jax.models import ModelConfig

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "default.py")


def mid_model(**overrides: Any) -> ml_collections.ConfigDict:
    """The mid-size Qwen3 shape of the MFU goal (~0.17B params, 32k vocabulary).

    Its layer loop is fully unrolled (`scan_unroll`), the fastest setting on CPU.
    """
    fields = dict(
        vocab_size=32_000,
        d_model=1024,
        num_layers=8,
        num_heads=16,
        num_kv_heads=8,
        head_dim=64,
        mlp_dim=3072,
        max_seq_len=512,
        tie_embeddings=False,
        rope_theta=1e6,
        scan_unroll=8,
    )
    return config_lib.model_config(**{**fields, **overrides})


class Peak(NamedTuple):
    """The measured fp32 matmul peak: FLOP/s (wall) and FLOP per CPU-second."""

    flops: float
    flops_per_cpu_s: float


@dataclasses.dataclass(frozen=True)
class Suite:
    """Sizes and repeats of one benchmark run (see the module docstring)."""

    name: str
    peak_n: int = 2048  # the fp32 peak matmul is [n, n] @ [n, n]
    peak_repeats: int = 5
    sampler_batches: tuple[int, ...] = (64,)
    prompt_len: int = 64
    new_tokens: int = 128
    sampler_repeats: int = 2
    sampler_devices: int = 0  # also time the sampler data-parallel over D devices; 0 = CPU count
    # Rounds of paired calls (tg_jax, reference) in worker processes for the sampler speed-up
    # (`measure.paired_timings`); 0 = the unpaired ratio only.
    sampler_paired_rounds: int = 4
    default_batch: int = 0  # rows of the default-config train step; 0 = its sft.batch_size
    mid_batch: int = 2  # rows of the mid-size train step (x mid_seq_len tokens)
    mid_seq_len: int = 512
    train_repeats: int = 1
    loop_ab: tuple[str, ...] = ("default",)  # train configs also timed with the other layer loop
    hf: str = "subprocess"  # subprocess | in_process
    hf_threads: tuple[int, ...] = ()  # torch threads to try; () = the CPU count only
    hf_policies: tuple[str | None, ...] = ("PASSIVE",)  # OMP_WAIT_POLICY values to try
    rl_batch: int = 32
    rl_seq_len: int = 384
    rl_steps: int = 2
    kl_length: int = 8192
    kl_d_model: int = 2048
    kl_vocab: int = 151_936  # the Qwen3 vocabulary
    kl_chunk: int = 512
    overlap_steps: int = 3
    overlap_warmup: int = 1
    overlap_groups: int = 0  # 0 = rl_loop.groups_per_step
    overlap_rollouts: int = 0  # 0 = rl_loop.rollouts_per_group
    overlap_new_tokens: int = 0  # 0 = rl_loop.max_new_tokens
    tiny_models: bool = False  # micro: tiny default and mid-size models


SUITES = {
    "quick": Suite("quick"),
    "full": Suite(
        "full",
        peak_n=4096,
        sampler_batches=(8, 64, 256),
        sampler_repeats=3,
        sampler_paired_rounds=8,
        mid_batch=8,
        train_repeats=3,
        hf_threads=(1, 2),
        hf_policies=(None, "PASSIVE"),
        loop_ab=("default", "mid"),
        rl_batch=64,
        rl_steps=9,  # interleaved steps per arm (the ratios are of medians)
        overlap_steps=3,
    ),
    "micro": Suite(
        "micro",
        peak_n=256,
        peak_repeats=2,
        sampler_batches=(8,),
        prompt_len=8,
        new_tokens=8,
        sampler_repeats=1,
        sampler_devices=2,
        sampler_paired_rounds=1,
        default_batch=8,
        mid_batch=8,
        mid_seq_len=32,
        hf="in_process",
        hf_threads=(1,),
        rl_batch=8,
        rl_seq_len=64,
        rl_steps=1,
        kl_length=64,
        kl_d_model=16,
        kl_vocab=512,
        kl_chunk=16,
        overlap_steps=1,
        overlap_warmup=0,
        overlap_groups=1,
        overlap_rollouts=8,
        overlap_new_tokens=8,
        tiny_models=True,
    ),
}


def run_config(suite: Suite, path: str = DEFAULT_CONFIG) -> ml_collections.ConfigDict:
    """The run config the benchmarks use: configs/default.py (tiny model for micro)."""
    config = config_files.load_config_file(path)
    if suite.tiny_models:
        tiny = config_lib.tiny_model_config().to_dict()
        # One-turn episodes: a prompt and one short turn fit with the hints in 384 tokens.
        tiny["max_seq_len"] = 384
        overrides = {f"model.{k}": v for k, v in tiny.items()}
        config = config_files.apply_overrides(
            config, overrides | {"sft.seq_len": 64, "env.max_turns": 1}
        )
    return config


def _hf_kwargs(suite: Suite) -> dict[str, Any]:
    threads = suite.hf_threads or (measure.cpu_count(),)
    in_process = suite.hf == "in_process"
    return {"threads": threads, "policies": suite.hf_policies, "in_process": in_process}


def _generate_job(cfg: ModelConfig, prompts: Any, new_tokens: int, repeats: int) -> dict[str, Any]:
    """The reference's job for one sampler batch: HF generate with the same weights (seed 0)
    and prompts ([B, P] ids, `throughput.sampler_prompts`; `hf_reference.run_reference`)."""
    return {
        "kind": "generate",
        "model": dataclasses.asdict(cfg),
        "seed": 0,
        "prompts": prompts.tolist(),
        "new_tokens": new_tokens,
        "repeats": repeats,
    }


def sampler_section(suite: Suite, config: Any, peak: Peak) -> dict[str, Any]:
    """Sampler tokens/s vs HF generate (same weights and prompts) and decode FLOP/s.

    Ours is timed on one device and data-parallel over D devices (`suite.sampler_devices`; on
    CPU one host device per core, `throughput.sampler_timing_devices`); the faster of the two
    is ours, and both are reported. transformers gets the best of its thread settings (a
    sweep), so both sides may use every core. Then, with `suite.sampler_paired_rounds`, ours
    (its faster device count) and the reference (its best setting) are timed again in paired
    rounds (`measure.paired_timings`): `speedup` is the median of the rounds' ratios,
    `speedup_min` / `speedup_max` their range, and the tokens/s are the paired medians;
    `speedup_unpaired` is the ratio of the first timings, taken minutes apart
    (`tg_jax_unpaired_tok_s`, `hf_sweep_tok_s`).
    """
    cfg = ModelConfig.from_config(config.model)
    n, p = suite.new_tokens, suite.prompt_len
    ndev = suite.sampler_devices or measure.cpu_count()
    out: dict[str, Any] = {"prompt_len": p, "new_tokens": n}
    jobs, ours, ours_1dev, prompts = [], {}, {}, {}
    for b in suite.sampler_batches:
        prompts[b] = throughput.sampler_prompts(b, p, cfg.vocab_size)
        ours_1dev[b] = throughput.sampler_timing(cfg, prompts[b], n, suite.sampler_repeats)
        ours[b] = (1, ours_1dev[b])
        if ndev > 1 and b % ndev == 0:
            t = throughput.sampler_timing_devices(cfg, prompts[b], n, suite.sampler_repeats, ndev)
            ours[b] = min(ours[b], (ndev, t), key=lambda dt: dt[1].median)
        jobs.append(_generate_job(cfg, prompts[b], n, suite.sampler_repeats))
    refs = hf_reference.run_reference(jobs, **_hf_kwargs(suite))
    for b, ref, job in zip(suite.sampler_batches, refs, jobs, strict=True):
        devices, t = ours[b]
        ref_s, ref_cpu, ref_load = ref["seconds"], ref["cpu"], ref["load"]
        fig: dict[str, Any] = {
            "speedup_unpaired": ref_s / t.median,
            "tg_jax_unpaired_tok_s": b * n / t.median,
            "hf_sweep_tok_s": b * n / ref_s,
        }
        if suite.sampler_paired_rounds:
            with (
                throughput.sampler_worker(cfg, prompts[b], n, devices) as mine,
                hf_reference.generate_worker(
                    job, threads=ref["threads"], policy=ref["policy"]
                ) as theirs,
            ):
                paired = measure.paired_timings(
                    {"tg_jax": mine, "hf": theirs}, suite.sampler_paired_rounds
                )
            t, ref_t = paired["tg_jax"], paired["hf"]
            ref_s, ref_cpu, ref_load = ref_t.median, ref_t.cpu, ref_t.load
            ratios = measure.round_ratios(ref_t, t)
            fig.update(
                {
                    "speedup": statistics.median(ratios),
                    "speedup_min": min(ratios),
                    "speedup_max": max(ratios),
                    "rounds": len(ratios),
                }
            )
        else:
            fig["speedup"] = fig["speedup_unpaired"]
        flops = throughput.decode_flops(cfg, b, p, n)
        out[f"b{b}"] = {
            "tg_jax_tok_s": b * n / t.median,
            "tg_jax_1dev_tok_s": b * n / ours_1dev[b].median,
            "devices": devices,
            "hf_tok_s": b * n / ref_s,
            **fig,
            "speedup_cpu": ref_cpu / t.cpu,
            "decode_gflop_s": flops / t.median / 1e9,
            "decode_frac_of_peak": flops / t.median / peak.flops,
            "load": t.load,
            "hf_setting": ref["setting"],
            "hf_load": ref_load,
        }
    return out


def train_section(suite: Suite, config: Any, peak: Peak) -> dict[str, Any]:
    """SFT-step tokens/s and MFU (default and mid-size configs) vs the HF step."""
    mid = mid_model(max_seq_len=suite.mid_seq_len)
    if suite.tiny_models:
        mid = config_lib.tiny_model_config()
        mid.max_seq_len = suite.mid_seq_len
    shapes = {
        "default": (
            config.model,
            suite.default_batch or int(config.sft.batch_size),
            int(config.sft.seq_len),
        ),
        "mid": (mid, suite.mid_batch, suite.mid_seq_len),
    }
    ours, other_loop, jobs = {}, {}, []
    for name, (model, batch, seq_len) in shapes.items():
        step_cfg = throughput.lm_step_config(config, model, batch, seq_len)
        ours[name] = throughput.lm_step_timing(step_cfg, suite.train_repeats)
        cfg = ModelConfig.from_config(model)
        if name in suite.loop_ab:
            # The same step with the layer loop scanned (unroll 1) or fully unrolled, whichever
            # the config does not use: what `scan_unroll` buys on this machine.
            unrolled = cfg.scan_unroll >= cfg.num_layers
            flip = {"model.scan_unroll": 1 if unrolled else cfg.num_layers}
            t = throughput.lm_step_timing(
                config_files.apply_overrides(step_cfg, flip), suite.train_repeats
            )
            scanned_s, unrolled_s = (t.median, ours[name].median)[:: 1 if unrolled else -1]
            other_loop[name] = {
                "scanned_step_s": scanned_s,
                "unrolled_step_s": unrolled_s,
                "unroll_speedup": scanned_s / unrolled_s,
            }
        jobs.append(
            {
                "kind": "train",
                "model": dataclasses.asdict(cfg),
                "seed": 0,
                "batch": batch,
                "seq_len": seq_len,
                "repeats": suite.train_repeats,
            }
        )
    refs = hf_reference.run_reference(jobs, **_hf_kwargs(suite))
    out: dict[str, Any] = {}
    for (name, (model, batch, seq_len)), ref in zip(shapes.items(), refs, strict=True):
        cfg = ModelConfig.from_config(model)
        flops = throughput.train_flops(cfg, batch, seq_len)
        t = ours[name]
        out[name] = {
            "batch": batch,
            "seq_len": seq_len,
            "params_m": cfg.num_params() / 1e6,
            "tg_jax_tok_s": batch * seq_len / t.median,
            "mfu": flops / t.median / peak.flops,
            "mfu_cpu": flops / t.cpu / peak.flops_per_cpu_s,
            "hf_tok_s": batch * seq_len / ref["seconds"],
            "hf_mfu": flops / ref["seconds"] / peak.flops,
            "hf_mfu_cpu": flops / ref["cpu"] / peak.flops_per_cpu_s,
            "speedup": ref["seconds"] / t.median,
            "speedup_cpu": ref["cpu"] / t.cpu,
            "step_s": t.median,
            "hf_step_s": ref["seconds"],
            "load": t.load,
            "hf_setting": ref["setting"],
            "hf_load": ref["load"],
            "scan_unroll": cfg.scan_unroll,
            **other_loop.get(name, {}),
        }
    return out


def rl_section(suite: Suite, config: Any) -> dict[str, Any]:
    """TG step / GRPO step on one batch of the default model (`tg_jax.bench.rl_step`)."""
    from tg_jax.bench import rl_step as bench_step  # noqa: PLC0415

    r = bench_step.bench(
        bench_step.bench_config(model=config.model),
        batch_size=suite.rl_batch,
        seq_len=suite.rl_seq_len,
        steps=suite.rl_steps,
    )
    tokens = suite.rl_batch * suite.rl_seq_len
    grpo, tg = r["grpo_wall_s"], r["tg_wall_s"]
    return {
        "batch": suite.rl_batch,
        "seq_len": suite.rl_seq_len,
        "grpo_step_s": grpo,
        "tg_step_s": tg,
        "tg_over_grpo": tg / grpo,
        "tg_over_grpo_cpu": r["tg_cpu_s"] / r["grpo_cpu_s"],
        **bench_step.share_figures(r),
        "grpo_tok_s": tokens / grpo,
        "tg_tok_s": tokens / tg,
        "load": measure.load_average(),
    }


def kl_section(suite: Suite) -> dict[str, Any]:
    """Compiled temp memory of the chunked vs naive full-vocabulary KL (`bench.kl_memory`)."""
    from tg_jax.bench.kl_memory import kl_memory_report  # noqa: PLC0415

    r = kl_memory_report(
        length=suite.kl_length,
        d_model=suite.kl_d_model,
        vocab=suite.kl_vocab,
        chunk_size=suite.kl_chunk,
    )
    return {
        "length": suite.kl_length,
        "d_model": suite.kl_d_model,
        "vocab": suite.kl_vocab,
        "chunk": suite.kl_chunk,
        "chunked_mib": r.chunked_temp_bytes / 2**20,
        "naive_mib": r.naive_temp_bytes / 2**20,
        "chunked_over_naive": r.ratio,
    }


def overlap_section(suite: Suite, config: Any) -> dict[str, Any]:
    """Async RL step vs sampling and training one after the other, with the sampler on its
    own devices and colocated (`bench.overlap`)."""
    return overlap.overlap_bench(
        config,
        steps=suite.overlap_steps,
        warmup=suite.overlap_warmup,
        groups=suite.overlap_groups or None,
        rollouts=suite.overlap_rollouts or None,
        max_new_tokens=suite.overlap_new_tokens or None,
    )


def measure_peak(suite: Suite) -> tuple[Peak, dict[str, Any]]:
    """The machine's fp32 peak: the faster of XLA's and torch's [n, n] @ [n, n] matmul.

    Every MFU divides by it. XLA's matmul alone would flatter our MFU wherever torch's kernels
    are faster (on the 2-core VM torch's training step reached 112% of XLA's matmul speed);
    torch gets the best of its thread settings, as in every other reference.
    """
    n = suite.peak_n
    xla_flops, xla_t = measure.matmul_peak(n, suite.peak_repeats)
    job = {"kind": "matmul", "n": n, "repeats": suite.peak_repeats}
    ref = hf_reference.run_reference([job], **_hf_kwargs(suite))[0]
    torch_flops = 2.0 * n**3 / ref["seconds"]
    if torch_flops > xla_flops:
        peak = Peak(torch_flops, 2.0 * n**3 / ref["cpu"])
    else:
        peak = Peak(xla_flops, 2.0 * n**3 / xla_t.cpu)
    figures = {
        "gflop_s": peak.flops / 1e9,
        "gflop_per_cpu_s": peak.flops_per_cpu_s / 1e9,
        "xla_gflop_s": xla_flops / 1e9,
        "torch_gflop_s": torch_flops / 1e9,
        "n": n,
        "load": xla_t.load,
        "hf_setting": ref["setting"],
    }
    return peak, figures


def run_suite(
    suite: Suite,
    *,
    config_path: str = DEFAULT_CONFIG,
    workdir: str | None = None,
    sections: tuple[str, ...] | None = None,
    log: Callable[[str], None] = print,
    engines: tuple[str, ...] = ("builtin",),
    engine_min_bucket: int = 0,
) -> dict[str, Any]:
    """Runs the suite's sections; returns {"suite", "machine", "sections", "figures"}.
    engines: the agentic section's engines beside the lock-step sampler ("builtin", "vllm");
    engine_min_bucket: its engine's smallest bucket (0: the engine's MIN_BUCKET)."""
    if set(engines) - {"builtin", "vllm"} or "builtin" not in engines:
        raise ValueError(f"--engines: builtin or builtin,vllm, got {','.join(engines)!r}")
    if engine_min_bucket < 0:
        raise ValueError(f"--engine_min_bucket must be >= 0, got {engine_min_bucket}")
    config = run_config(suite, config_path)
    wanted = sections or ("peak", "sampler", "train", "rl", "kl", "overlap", "sandbox", "e2e")
    machine = {
        "cpus": measure.cpu_count(),
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
        "load_start": measure.load_average(),
    }
    peak, peak_figures = measure_peak(suite)
    results: dict[str, Any] = {"peak": peak_figures}
    log(
        f"peak fp32 matmul {peak.flops / 1e9:.1f} GFLOP/s (XLA "
        f"{peak_figures['xla_gflop_s']:.1f}, torch {peak_figures['torch_gflop_s']:.1f}; "
        f"n={suite.peak_n}, load {peak_figures['load']:.1f})"
    )
    runners = {
        "sampler": lambda: sampler_section(suite, config, peak),
        "train": lambda: train_section(suite, config, peak),
        "rl": lambda: rl_section(suite, config),
        "kl": lambda: kl_section(suite),
        "overlap": lambda: overlap_section(suite, config),
        "sandbox": lambda: sandbox_bench.sandbox_bench(
            **({"n": 6, "n_pytest": 3} if suite.tiny_models else {})
        ),
        "e2e": lambda: e2e.read_workdir(workdir) or {"status": "not measured"},
        # Asked for by name (--sections agentic): the lock-step sampler against the engine's
        # agent loops on one multi-turn workload at equal KV bytes (tg_jax.bench.agentic);
        # --engines=builtin,vllm adds vLLM as a third arm.
        "agentic": lambda: agentic.agentic_section(
            vllm="vllm" in engines,
            engine_options={"min_bucket": engine_min_bucket} if engine_min_bucket else None,
            **(
                {"episodes": 4, "max_turns": 2, "max_tokens": 64}
                if suite.tiny_models  # an RL step's shape: 64 episodes in 16 rows' KV bytes
                else {"step_episodes": 64, "step_rows": 16, "swe_runner": "namespace"}
            ),
        ),
    }
    seconds = {}
    for name, run in runners.items():
        if name in wanted:
            log(f"running {name} ...")
            start = time.perf_counter()
            results[name] = run()
            seconds[name] = time.perf_counter() - start
            log(f"  {name}: {seconds[name]:.0f} s (load {measure.load_average():.1f})")
    machine["section_seconds"] = seconds
    machine["load_end"] = measure.load_average()
    return {
        "suite": dataclasses.asdict(suite),
        "machine": machine,
        "sections": results,
        "figures": flatten(results),
    }


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of nested dicts as {"a/b/c": value} (strings are left out)."""
    out: dict[str, float] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[key] = float(v)
    return out
