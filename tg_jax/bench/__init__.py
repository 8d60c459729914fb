"""Benchmarks of tg_jax against references timed in the same run: `python -m tg_jax.bench`.

Sections (each a module or a thin wrapper in `suites`):
  peak     fp32 [n, n] @ [n, n] matmul, the faster of XLA's and torch's: the measured peak
           every MFU is a fraction of (`suites.measure_peak`).
  sampler  `Sampler` tokens/s vs transformers `generate` on the same weights and prompts, and
           the decode's achieved FLOP/s (`throughput`, `hf_reference`).
  train    SFT-step tokens/s and MFU on the default and a mid-size Qwen3 config vs the same
           step of transformers' Qwen3ForCausalLM (`throughput`, `hf_reference`).
  rl       TG step / GRPO step on one batch (`tg_jax.bench.rl_step`).
  kl       chunked / naive compiled memory of the full-vocabulary KL (`tg_jax.bench.kl_memory`).
  overlap  async RL step vs sampling + training one after the other (`overlap`).
  e2e      the main job's wall time, read from a finished workdir (`e2e`).

The reference (torch) runs in its own subprocesses with the best thread settings measured in
the run. Timings are medians after warm-up; the load average is recorded next to each. The
sampler's speed-up is paired: both sides in worker processes, their calls alternating round
by round (`measure.paired_timings`), the median of the rounds' ratios. Rates
and ratios use wall time; the `*_cpu` figures use the process's CPU time instead, which other
processes on a shared machine inflate much less (MFU_cpu = model FLOP per CPU-second over the
matmul's FLOP per CPU-second).
"""
