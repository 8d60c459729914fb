"""Our side of the throughput figures: sampler tokens/s and train-step MFU.

Sampler: `Sampler.sample` (jitted prefill + `lax.while_loop` decode): temperature-1 sampling
from random prompts of P tokens, exactly N new tokens per row (no stop ids), throughput = B
* N / seconds (prefill included). Its achieved FLOP/s counts model FLOPs only
(`decode_flops`): the prefill of B * P tokens plus B * N one-token decode steps at an
average context of P + N / 2.

Train step: the SFT step (`tg_jax.train.sft.make_sft_step`: forward to fp32 logits,
cross-entropy, backward, global-norm clipping, AdamW, donated state) on B rows of T tokens.
MFU = 3 * flops_per_token(T) * B * T / seconds / peak, with 3x the forward FLOPs for forward +
backward and the peak from `suites.measure_peak` (XLA or torch matmul) in the same run.

Data-parallel sampler: a process's XLA CPU device count is fixed when its backend starts, so
`sampler_timing_devices` times the sampler over D host devices (one per core) in a child
process: `python -m tg_jax.bench.throughput` reads a JSON job line on stdin, prints one JSON
line. `sampler_worker` keeps such a process to time calls paired with the reference's
(`measure.paired_timings`).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from tg_jax import config_files, sharding
from tg_jax.bench.measure import CallWorker, Timing, serve_calls, time_calls
from tg_jax.models import ModelConfig, Transformer, init_params
from tg_jax.sampling.loop import data_parallel_mesh
from tg_jax.sampling.sampler import Sampler
from tg_jax.tpu import distributed


def decode_flops(cfg: ModelConfig, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Model FLOPs of sampling `new_tokens` after a `prompt_len` prompt, for `batch` rows.

    `flops_per_token(S)` charges attention for S / 2 keys (a causal average); a decode step at
    context c attends to c keys, and the average context over the N steps is P + N / 2, hence
    S = 2P + N for the decode tokens.
    """
    prefill = batch * prompt_len * cfg.flops_per_token(prompt_len)
    decode = batch * new_tokens * cfg.flops_per_token(2 * prompt_len + new_tokens)
    return float(prefill + decode)


def sampler_prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> np.ndarray:
    """[B, P] random prompt ids in [1, min(256, V)) (bytes of the byte tokenizer)."""
    return np.random.default_rng(seed).integers(1, min(256, vocab), (batch, prompt_len))


def sampler_runner(
    cfg: ModelConfig, prompts: np.ndarray, new_tokens: int, seed: int = 0, devices: int = 1
) -> Callable[[], None]:
    """One `Sampler.sample` call generating `new_tokens` for every prompt row, as a callable
    (params from `seed`; the reference uses the same).

    devices > 1: the batch is split over the first `devices` local devices (a data mesh, params
    replicated). On CPU, `--xla_force_host_platform_device_count` makes one device per core, and
    each device runs its share of the decode loop on its own thread.
    """
    model = Transformer(cfg)
    params = init_params(model, jax.random.key(seed))
    if devices > 1:
        mesh, rules = data_parallel_mesh(jax.local_devices()[:devices])
        params = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.P()))
        sampler = Sampler(model, pad_id=0, mesh=mesh, rules=rules, batch_divisor=devices)
    else:
        sampler = Sampler(model, pad_id=0)
    rows = [list(p) for p in prompts]

    def run() -> None:
        out = sampler.sample(params, rows, max_new_tokens=new_tokens, rng=jax.random.key(1))
        assert all(len(t) == new_tokens for t in out.tokens)

    return run


def sampler_timing(
    cfg: ModelConfig,
    prompts: np.ndarray,
    new_tokens: int,
    repeats: int,
    seed: int = 0,
    devices: int = 1,
) -> Timing:
    """Seconds per `Sampler.sample` call (`sampler_runner`), timed in this process."""
    return time_calls(sampler_runner(cfg, prompts, new_tokens, seed, devices), repeats)


def _job(cfg: ModelConfig, prompts: np.ndarray, new_tokens: int, devices: int) -> dict[str, Any]:
    return {
        "model": dataclasses.asdict(cfg),
        "prompts": np.asarray(prompts).tolist(),
        "new_tokens": new_tokens,
        "devices": devices,
    }


def _worker_env(devices: int) -> dict[str, str]:
    """This process's environment with `devices` XLA CPU host devices."""
    return dict(distributed.cpu_devices_env(devices), JAX_PLATFORMS="cpu")


def sampler_timing_devices(
    cfg: ModelConfig, prompts: np.ndarray, new_tokens: int, repeats: int, devices: int
) -> Timing:
    """`sampler_timing(..., devices=devices)`, here when this process has that many local
    devices, else in a child process started with `devices` XLA CPU host devices."""
    if jax.local_device_count() >= devices:
        return sampler_timing(cfg, prompts, new_tokens, repeats, devices=devices)
    job = _job(cfg, prompts, new_tokens, devices) | {"repeats": repeats}
    proc = subprocess.run(
        [sys.executable, "-m", "tg_jax.bench.throughput"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=_worker_env(devices),
        timeout=3600,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"sampler worker ({devices} devices) failed:\n{proc.stderr[-4000:]}")
    fields = json.loads(proc.stdout.strip().splitlines()[-1])
    return Timing(**{**fields, "times": tuple(fields["times"])})


def sampler_worker(
    cfg: ModelConfig, prompts: np.ndarray, new_tokens: int, devices: int
) -> CallWorker:
    """A `CallWorker` serving `sampler_runner` calls from a process with `devices` XLA CPU host
    devices (for `measure.paired_timings` against the reference)."""
    job = _job(cfg, prompts, new_tokens, devices) | {"serve": True}
    return CallWorker(
        [sys.executable, "-m", "tg_jax.bench.throughput"],
        job,
        env=_worker_env(devices),
        name=f"tg_jax sampler ({devices} devices)",
    )


def lm_step_config(
    base: ml_collections.ConfigDict, model: ml_collections.ConfigDict, batch: int, seq_len: int
) -> ml_collections.ConfigDict:
    """`base` (model, mesh, sft sections) with `model` and SFT batches of `batch` x `seq_len`."""
    overrides = {f"model.{k}": v for k, v in model.to_dict().items()}
    overrides.update({"sft.batch_size": batch, "sft.seq_len": seq_len})
    return config_files.apply_overrides(base, overrides)


def lm_batch(batch: int, seq_len: int, vocab: int, seed: int = 0) -> dict[str, jax.Array]:
    """An SFT batch (keys of `sft_data.PackedRows`): one random sequence per row."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, seq_len + 1)).astype(np.int32)
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch, seq_len))
    return {
        "inputs": jnp.asarray(tokens[:, :-1]),
        "targets": jnp.asarray(tokens[:, 1:]),
        "positions": jnp.asarray(positions),
        "segment_ids": jnp.ones((batch, seq_len), jnp.int32),
        "loss_mask": jnp.ones((batch, seq_len), jnp.float32),
    }


def lm_step_timing(config: Any, repeats: int, warmup: int = 1, devices: Any = None) -> Timing:
    """Seconds per SFT train step of `config` (model, mesh, sft sections) on `devices`
    (default: all); see module doc."""
    from tg_jax.rl.train_state import create_train_state  # noqa: PLC0415
    from tg_jax.train.sft import make_sft_step  # noqa: PLC0415

    model = Transformer(ModelConfig.from_config(config.model))
    mesh = sharding.make_mesh(config.mesh, devices=devices)
    rules = sharding.logical_rules(config.mesh)
    optimizer, step = make_sft_step(config, model, mesh, rules)
    state = create_train_state(model, optimizer, mesh, rules, jax.random.key(0))
    batch = lm_batch(int(config.sft.batch_size), int(config.sft.seq_len), model.config.vocab_size)
    batch = jax.device_put(batch, sharding.data_sharding(mesh, rules, ndim=1))
    box = [state]

    def run() -> None:
        box[0], metrics = step(box[0], batch)
        jax.block_until_ready((box[0].params, metrics))

    return time_calls(run, repeats, warmup)


def train_flops(cfg: ModelConfig, batch: int, seq_len: int) -> float:
    """Model FLOPs of one forward + backward over batch x seq_len tokens (3x the forward)."""
    return 3.0 * cfg.flops_per_token(seq_len) * batch * seq_len


def main() -> None:
    """Worker of `sampler_timing_devices` (one JSON job line on stdin, one JSON Timing line
    out) and of `sampler_worker` (jobs with "serve": `measure.serve_calls`)."""
    job = json.loads(sys.stdin.readline())
    run = sampler_runner(
        ModelConfig(**job["model"]),
        np.asarray(job["prompts"]),
        int(job["new_tokens"]),
        devices=int(job["devices"]),
    )
    if job.get("serve"):
        serve_calls(run)
        return
    t = time_calls(run, int(job["repeats"]))
    print(json.dumps(dataclasses.asdict(t)), flush=True)


if __name__ == "__main__":
    main()
