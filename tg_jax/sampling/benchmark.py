"""Sampler throughput on CPU, and Hugging Face `generate` on the same weights for reference.

    python -m tg_jax.sampling.benchmark --batch 8 64 --prompt_len 64 --new_tokens 128 --hf

On a busy shared machine add `--hf_threads 1`: torch's default OpenMP threads spin-wait and
collapse when the cores are oversubscribed (seen: 20-90x slower), which would flatter tg_jax.

Both sample at temperature 1 (no top-k / top-p) from random prompts of `prompt_len` tokens and
generate exactly `new_tokens` tokens per row (no stop ids), so both produce batch * new_tokens
tokens. Times are wall-clock medians of `repeats` calls after one warm-up call (compilation
excluded), the two implementations' calls interleaved so that both see the same machine load;
throughput = generated tokens / wall second, prefill included; process CPU seconds are printed
too (on a shared machine they vary less than wall time).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax
import numpy as np

from tg_jax import config_lib
from tg_jax.models import ModelConfig, Transformer, init_params
from tg_jax.sampling.sampler import Sampler


def tg_jax_runner(cfg: ModelConfig, params, prompts: np.ndarray, new_tokens: int):
    """A callable: one `Sampler.sample` call generating new_tokens for every prompt row."""
    sampler = Sampler(Transformer(cfg), pad_id=0)
    rows = [list(p) for p in prompts]

    def run():
        out = sampler.sample(params, rows, max_new_tokens=new_tokens, rng=jax.random.key(1))
        assert all(len(t) == new_tokens for t in out.tokens)

    return run


def hf_runner(cfg: ModelConfig, params, prompts: np.ndarray, new_tokens: int):
    """A callable: one Hugging Face `generate` call with the same weights and settings."""
    import torch  # noqa: PLC0415 (reference only)
    import transformers  # noqa: PLC0415

    from tg_jax.models.hf_io import model_config_to_hf, params_to_hf  # noqa: PLC0415

    hf_cfg = transformers.Qwen3Config(**model_config_to_hf(cfg))
    model = transformers.Qwen3ForCausalLM(hf_cfg).eval().to(torch.float32)
    hf_params = params_to_hf(jax.device_get(params), cfg)
    state = {k: torch.from_numpy(np.array(v)) for k, v in hf_params.items()}
    model.load_state_dict(state, strict=False)
    ids = torch.from_numpy(prompts.astype(np.int64))

    def run():
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                pad_token_id=0,
            )  # fmt: skip
        assert out.shape == (len(prompts), prompts.shape[1] + new_tokens)

    return run


def median_seconds(
    runners: dict[str, Callable[[], None]], repeats: int
) -> dict[str, tuple[float, float]]:
    """(median wall seconds, median process CPU seconds) per call of each runner.

    One warm-up call each, then the runners' calls interleaved. CPU seconds (all threads) are
    less sensitive than wall time to other processes on a shared machine.
    """
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    for run in runners.values():
        run()  # warm-up: compilation, allocator
    for _ in range(repeats):
        for name, run in runners.items():
            start, cpu = time.perf_counter(), time.process_time()
            run()
            times[name].append((time.perf_counter() - start, time.process_time() - cpu))
    return {
        name: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t))
        for name, t in times.items()
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--prompt_len", type=int, default=64)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf", action="store_true", help="also time Hugging Face generate")
    parser.add_argument("--hf_threads", type=int, default=0, help="torch threads (0 = default)")
    args = parser.parse_args(argv)

    if args.hf and args.hf_threads:
        import torch  # noqa: PLC0415

        torch.set_num_threads(args.hf_threads)
    from tg_jax.bench.suites import DEFAULT_CONFIG  # noqa: PLC0415

    cfg = ModelConfig.from_config(config_lib.load_config_file(DEFAULT_CONFIG).model)
    params = init_params(Transformer(cfg), jax.random.key(0))
    rng = np.random.default_rng(0)
    print(f"model: {cfg.num_params():,} params, {jax.devices()[0].platform}")
    for b in args.batch:
        prompts = rng.integers(1, 256, (b, args.prompt_len))
        runners = {"tg_jax": tg_jax_runner(cfg, params, prompts, args.new_tokens)}
        if args.hf:
            runners["hf"] = hf_runner(cfg, params, prompts, args.new_tokens)
        secs = median_seconds(runners, args.repeats)
        n = b * args.new_tokens
        line = f"batch {b:4d}:"
        for name, (wall, cpu) in secs.items():
            line += f" | {name} {n / wall:7.0f} tok/s ({wall:.3f} s, {cpu:.3f} cpu-s)"
        if args.hf:
            line += f" | speed-up {secs['hf'][0] / secs['tg_jax'][0]:.1f}x wall"
            line += f", {secs['hf'][1] / secs['tg_jax'][1]:.1f}x cpu"
        print(line, flush=True)


if __name__ == "__main__":
    main()
