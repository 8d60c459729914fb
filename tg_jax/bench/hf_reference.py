"""The reference side of the benchmarks: Hugging Face transformers (torch, fp32, CPU).

Three jobs, each timed under every candidate torch thread count:

  generate  `Qwen3ForCausalLM.generate` with OUR weights: temperature-1 sampling (no top-k / top-p),
            exactly `new_tokens` new tokens per row, the same prompts, KV cache on;
  train     one optimizer step of `Qwen3ForCausalLM` (random torch init, same architecture):
            forward with labels (fp32 logits, cross-entropy), backward, global-norm clipping,
            AdamW, zero_grad. The same work as the SFT step it is compared with;
  matmul    an fp32 [n, n] @ [n, n] torch matmul: torch's side of the machine's peak (the MFU
            denominator is the faster of it and XLA's matmul).

`run_reference` runs the jobs in one fresh subprocess per OpenMP wait policy (the policy is
read when torch loads its OpenMP runtime, so it cannot change inside a process), sweeps the
thread counts inside it, and keeps, per job, the fastest setting: the reference gets its best
thread settings, measured on this machine and load, not assumed. The subprocess also keeps
torch's thread pools away from the JAX process that is timed before and after it.

Worker protocol: `python -m tg_jax.bench.hf_reference` reads a JSON spec line from stdin and
prints one JSON line (see `run_jobs`); `generate_worker` starts one that serves timed
`generate` calls under the best setting, paired with tg_jax's calls (`measure.paired_timings`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tg_jax.bench.measure import CallWorker, Timing, serve_calls, time_calls

_POLICY_ENV = "OMP_WAIT_POLICY"


def _timing_dict(t: Timing) -> dict[str, Any]:
    return {
        "median": t.median,
        "best": t.best,
        "times": list(t.times),
        "cpu": t.cpu,
        "load": t.load,
    }


def _generate_runner(job: dict[str, Any]) -> Callable[[], None]:
    """One `generate` call of the job's model, prompts and settings, as a callable."""
    import jax  # noqa: PLC0415 (the worker builds our params only for generate jobs)
    import torch  # noqa: PLC0415 (reference only)
    import transformers  # noqa: PLC0415

    from tg_jax.models import ModelConfig, Transformer, init_params  # noqa: PLC0415
    from tg_jax.models.checkpoint_io import params_to_hf  # noqa: PLC0415
    from tg_jax.models.hf_io import model_config_to_hf  # noqa: PLC0415

    cfg = ModelConfig(**job["model"])
    params = jax.device_get(init_params(Transformer(cfg), jax.random.key(int(job["seed"]))))
    hf_cfg = transformers.Qwen3Config(**model_config_to_hf(cfg))
    model = transformers.Qwen3ForCausalLM(hf_cfg).eval().to(torch.float32)
    state = {k: torch.from_numpy(np.array(v)) for k, v in params_to_hf(params, cfg).items()}
    model.load_state_dict(state, strict=False)
    ids = torch.from_numpy(np.asarray(job["prompts"], np.int64))
    n = int(job["new_tokens"])

    def run() -> None:
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
            )
        assert out.shape == (ids.shape[0], ids.shape[1] + n)

    return run


def _generate_timing(job: dict[str, Any]) -> dict[str, Any]:
    return _timing_dict(time_calls(_generate_runner(job), int(job["repeats"])))


def _train_timing(job: dict[str, Any]) -> dict[str, Any]:
    import torch  # noqa: PLC0415 (reference only)
    import transformers  # noqa: PLC0415

    from tg_jax.models import ModelConfig  # noqa: PLC0415
    from tg_jax.models.hf_io import model_config_to_hf  # noqa: PLC0415

    cfg = ModelConfig(**job["model"])
    torch.manual_seed(int(job["seed"]))
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**model_config_to_hf(cfg)))
    model = model.to(torch.float32).train()
    try:  # the fused CPU kernel where this torch has it: the fastest AdamW it offers
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    ids = torch.randint(0, cfg.vocab_size, (int(job["batch"]), int(job["seq_len"])))

    def step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _timing_dict(time_calls(step, int(job["repeats"])))


def _matmul_timing(job: dict[str, Any]) -> dict[str, Any]:
    import torch  # noqa: PLC0415 (reference only)

    n = int(job["n"])
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    torch.matmul(a, b)  # the first call allocates and picks kernels: not timed
    return _timing_dict(time_calls(lambda: torch.matmul(a, b), int(job["repeats"]), warmup=1))


def run_jobs(spec: dict[str, Any]) -> dict[str, Any]:
    """Times every job of `spec` under every thread count, in this process.

    Args:
      spec: {"threads": [int, ...], "jobs": [job, ...]}; a job is {"kind": "generate" |
        "train", "model": ModelConfig fields, "seed", "repeats", ...}: generate jobs add
        "prompts" ([B, P] ids) and "new_tokens"; train jobs add "batch" and "seq_len";
        {"kind": "matmul", "n", "repeats"} times an [n, n] @ [n, n] fp32 matmul.

    Returns:
      {"policy": OMP_WAIT_POLICY or "default", "results": per job {str(threads): {"median",
      ...}}}.
    """
    import torch  # noqa: PLC0415

    results = []
    for job in spec["jobs"]:
        by_threads = {}
        for threads in spec["threads"]:
            torch.set_num_threads(int(threads))
            if job["kind"] == "generate":
                by_threads[str(threads)] = _generate_timing(job)
            elif job["kind"] == "train":
                by_threads[str(threads)] = _train_timing(job)
            elif job["kind"] == "matmul":
                by_threads[str(threads)] = _matmul_timing(job)
            else:
                raise ValueError(f"unknown reference job kind {job['kind']!r}")
        results.append(by_threads)
    return {"policy": os.environ.get(_POLICY_ENV, "default"), "results": results}


def run_reference(
    jobs: Sequence[dict[str, Any]],
    *,
    threads: Sequence[int],
    policies: Sequence[str | None],
    in_process: bool = False,
    timeout_s: float = 3600.0,
) -> list[dict[str, Any]]:
    """Runs the reference jobs under every (wait policy, thread count); keeps the best per job.

    Args:
      jobs: see `run_jobs`.
      threads: torch intra-op thread counts to try.
      policies: OMP_WAIT_POLICY values to try (None = leave it unset, OpenMP's default).
      in_process: run here instead (tests: no second interpreter; only the policy of this
        process is seen, so `policies` is ignored).
      timeout_s: per subprocess.

    Returns:
      Per job {"seconds": best median, "cpu": its CPU seconds, "setting": "threads=N
      OMP_WAIT_POLICY=P", "threads": N, "policy": P ("default" = unset), "load",
      "all": {setting: median}}.
    """
    spec = {"threads": [int(t) for t in threads], "jobs": list(jobs)}
    runs = []
    if in_process:
        runs.append(run_jobs(spec))
    else:
        for policy in policies:
            env = dict(os.environ)
            env.pop(_POLICY_ENV, None)
            if policy:
                env[_POLICY_ENV] = policy
            env.setdefault("JAX_PLATFORMS", "cpu")
            proc = subprocess.run(
                [sys.executable, "-m", "tg_jax.bench.hf_reference"],
                input=json.dumps(spec),
                capture_output=True,
                text=True,
                env=env,
                timeout=timeout_s,
                check=False,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"reference worker failed ({policy=}):\n{proc.stderr[-4000:]}")
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    out = []
    for i in range(len(jobs)):
        candidates = {}  # (threads, policy) -> timing
        for run in runs:
            for t, timing in run["results"][i].items():
                candidates[(int(t), run["policy"])] = timing
        threads, policy = min(candidates, key=lambda k: candidates[k]["median"])
        best = candidates[(threads, policy)]
        out.append(
            {
                "threads": threads,
                "policy": policy,
                "seconds": best["median"],
                "cpu": best["cpu"],
                "setting": _setting(threads, policy),
                "load": best["load"],
                "all": {_setting(*k): v["median"] for k, v in candidates.items()},
            }
        )
    return out


def _setting(threads: int, policy: str) -> str:
    return f"threads={threads} {_POLICY_ENV}={policy}"


def generate_worker(job: dict[str, Any], *, threads: int, policy: str) -> CallWorker:
    """A `CallWorker` serving `generate` calls of a generate job under one setting (torch
    threads, OMP_WAIT_POLICY; "default" leaves it unset), for `measure.paired_timings`."""
    env = dict(os.environ)
    env.pop(_POLICY_ENV, None)
    if policy != "default":
        env[_POLICY_ENV] = policy
    env.setdefault("JAX_PLATFORMS", "cpu")
    return CallWorker(
        [sys.executable, "-m", "tg_jax.bench.hf_reference"],
        {"serve": job, "threads": int(threads)},
        env=env,
        name=f"transformers generate ({_setting(threads, policy)})",
    )


def main() -> None:
    """One JSON spec line on stdin: `run_jobs` (one JSON line out), or {"serve": generate job,
    "threads": N}: `measure.serve_calls` of that job (`generate_worker`)."""
    spec = json.loads(sys.stdin.readline())
    if "serve" in spec:
        import torch  # noqa: PLC0415

        torch.set_num_threads(int(spec["threads"]))
        serve_calls(_generate_runner(spec["serve"]))
        return
    print(json.dumps(run_jobs(spec)), flush=True)


if __name__ == "__main__":
    main()
