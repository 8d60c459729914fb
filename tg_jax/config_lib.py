"""Shared config pieces and loading/validation of `configs/*.py` files.

Config files (`configs/NAME.py`) define `get_config(arg=None)` returning a locked
`ml_collections.ConfigDict`. Locking makes an override of an unknown key fail with the
key's name, and ConfigDict's type safety makes an override of the wrong type fail.
Code never mutates a config: derived values are computed where they are needed.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import ml_collections

# Logical axis -> mesh axes. Params: embed/vocab/heads/kv_heads/mlp/expert/head_dim/layers/
# norm. Activations: batch/length/act_embed plus heads/mlp/vocab.
DEFAULT_RULES = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("act_embed", None),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("expert", "expert"),
    ("moe_mlp", "tensor"),
    ("head_dim", None),
    ("layers", None),
    ("norm", None),
)


def mesh_config(shape=(1, -1, 1, 1)) -> ml_collections.ConfigDict:
    """Mesh axes, sizes (one may be -1 = the rest of the devices) and logical rules."""
    c = ml_collections.ConfigDict()
    c.axes = ("data", "fsdp", "tensor", "expert")  # mesh axis names
    c.shape = tuple(shape)  # size per axis; one -1 takes the remaining devices
    c.rules = DEFAULT_RULES  # logical axis name -> mesh axis (or tuple of axes, or None)
    return c


def model_config(**overrides: Any) -> ml_collections.ConfigDict:
    """The Qwen3 architecture fields (see tg_jax.models.ModelConfig); defaults = CPU model."""
    c = ml_collections.ConfigDict()
    c.vocab_size = 272  # byte tokenizer: 256 bytes + special tokens, padded to a multiple of 8
    c.d_model = 128  # hidden size
    c.num_layers = 4  # decoder layers (run under nn.scan)
    c.num_heads = 4  # query heads
    c.num_kv_heads = 2  # key/value heads (GQA ratio num_heads / num_kv_heads)
    c.head_dim = 32  # per-head dim, independent of d_model / num_heads
    c.mlp_dim = 384  # SwiGLU intermediate size
    c.rope_theta = 10_000.0  # RoPE base frequency
    c.rms_norm_eps = 1e-6  # RMSNorm epsilon
    c.tie_embeddings = True  # share the input embedding with the output projection
    c.param_dtype = "float32"  # storage dtype of params
    c.dtype = "float32"  # compute dtype (fp32 on CPU: bf16 matmuls are slower there)
    c.remat_policy = "none"  # none | full | dots | dots_with_no_batch_dims
    c.scan_unroll = 1  # layers per layer-loop iteration; num_layers = unrolled (faster on CPU)
    c.max_seq_len = 512  # longest sequence the model is used with
    # Full-sequence attention in causal query blocks of this size (0 = one block): skips the
    # masked upper triangle; exact for every input of this codebase (see ModelConfig). Each
    # block is its own op, so keep T / block small (e.g. 128 for T <= 1024 on CPU).
    c.attn_query_block = 0
    c.num_experts = 0  # 0 = dense MLP; > 0 = Qwen3-MoE feed-forward
    c.experts_per_token = 0  # top-k experts per token (MoE only)
    c.moe_mlp_dim = 0  # per-expert intermediate size (MoE only)
    c.norm_topk_prob = True  # renormalise top-k router probabilities (MoE only)
    c.router_aux_loss_coef = 0.0  # load-balancing loss weight (MoE only)
    c.update(overrides)
    return c


def tiny_model_config() -> ml_collections.ConfigDict:
    """A model that compiles and runs in well under a second on CPU, for tests."""
    return model_config(
        vocab_size=272, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        mlp_dim=64, max_seq_len=128,
    )  # fmt: skip


def rl_config(**overrides: Any) -> ml_collections.ConfigDict:
    """GRPO: advantages, clipped surrogate, aggregation, reference KL, staleness, micro-batches."""
    c = ml_collections.ConfigDict()
    c.advantage_mode = "grpo"  # grpo (divide by the group std) | dr_grpo (do not)
    c.adv_eps = 1e-6  # added to the group std before dividing
    c.reward_weights = ml_collections.ConfigDict({"task": 1.0})  # reward component -> weight
    c.clip_low = 0.2  # ratio clipped below at 1 - clip_low
    c.clip_high = 0.28  # ratio clipped above at 1 + clip_high (clip-higher)
    c.dual_clip = 0.0  # dual-clip constant c > 1 for negative advantages; 0 = off
    c.tis_cap = 0.0  # truncated IS cap on pi_trainer / pi_sampler (proximal = trainer); 0 = off
    c.agg_mode = "token_mean"  # token_mean | seq_mean_token_mean | seq_mean_token_sum_norm
    c.norm_length = 0  # L of seq_mean_token_sum_norm (max generation length); 0 = padded T
    c.kl_coef = 0.0  # weight of the KL to a frozen reference policy; 0 = no reference forward
    c.kl_estimator = "k3"  # k1 | k2 | k3 per-token estimator of KL(pi_theta || pi_ref)
    c.temperature = 1.0  # sampling temperature: trainer logits are divided by it
    c.max_staleness = 1  # rollouts more than this many policy versions old are refused
    c.micro_batches = 1  # gradient accumulation steps inside one train step
    c.update(overrides)
    return c


def tg_config(**overrides: Any) -> ml_collections.ConfigDict:
    """Targeted guidance: divergence, estimator, gating, lambda schedule, teacher context."""
    c = ml_collections.ConfigDict()
    c.enabled = True  # False = the GRPO arm: no teacher forward, no TG term
    c.kind = "reverse"  # reverse | forward | jsd (KL direction, student first)
    c.beta = 0.5  # teacher weight of the JSD mixture
    c.estimator = "full"  # full (whole vocabulary) | sampled (produced token only)
    c.top_k = 0  # full estimator over the student's top-k tokens + a tail bucket; 0 = full vocab
    c.gate = "failed_turns"  # failed_turns | all_turns: which turns get hints and distillation
    c.include_thinking = False  # also distil the <think> tokens of the selected turns
    c.teacher_mode = "per_trajectory"  # per_trajectory (hints before every failed turn) | per_turn
    c.max_teacher_rows = 64  # per_turn: teacher rows per batch (static), extra turns dropped
    c.chunk_size = 256  # positions per chunk of the full-vocabulary logits / KL
    c.schedule = ml_collections.ConfigDict()
    c.schedule.kind = "constant"  # lambda_tg schedule: constant | linear_warmup | cosine
    c.schedule.value = 1.0  # peak lambda_tg
    c.schedule.warmup_steps = 0  # linear ramp 0 -> value over these steps
    c.schedule.decay_steps = 1000  # cosine: steps after warmup to decay to final_value
    c.schedule.final_value = 0.0  # cosine: value after the decay
    c.update(overrides)
    return c


def optim_config(**overrides: Any) -> ml_collections.ConfigDict:
    """AdamW with global-norm clipping and a learning-rate schedule."""
    c = ml_collections.ConfigDict()
    c.lr = 1e-5  # peak learning rate
    c.b1 = 0.9  # Adam beta1
    c.b2 = 0.999  # Adam beta2
    c.eps = 1e-8  # Adam epsilon
    c.weight_decay = 0.0  # decoupled weight decay (not applied to norm scales)
    c.grad_clip_norm = 1.0  # clip gradients to this global norm; 0 = off
    c.schedule = "constant"  # constant | warmup_cosine
    c.warmup_steps = 0  # linear warmup 0 -> lr (both schedules)
    c.total_steps = 1000  # warmup_cosine: warmup + cosine decay steps
    c.end_lr_fraction = 0.1  # warmup_cosine: final lr = lr * end_lr_fraction
    c.update(overrides)
    return c


def load_config_file(path: str, arg: str | None = None) -> ml_collections.ConfigDict:
    """Imports `configs/NAME.py` and returns its locked `get_config(arg)`."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"Config file not found: {path}")
    spec = importlib.util.spec_from_file_location(
        f"tg_jax_config_{os.path.basename(path)[:-3]}", path
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"{path} defines no get_config()")
    cfg = module.get_config(arg) if arg is not None else module.get_config()
    if not isinstance(cfg, ml_collections.ConfigDict):
        raise TypeError(f"{path}: get_config() must return a ConfigDict, got {type(cfg)}")
    cfg.lock()
    return cfg


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: dict[str, Any]):
    """Returns a copy with dotted-key overrides applied; unknown keys / wrong types raise.

    For notebooks and tests; on the command line absl's `--config.a.b=v` does the same.
    """
    new = ml_collections.ConfigDict(cfg.to_dict(), type_safe=True)
    new.lock()
    for key, value in overrides.items():
        parts = key.split(".")
        node = new
        for i, part in enumerate(parts[:-1]):
            if part not in node:
                raise KeyError(f"Unknown config key {'.'.join(parts[: i + 1])!r} in {key!r}")
            node = node[part]
        if parts[-1] not in node:
            raise KeyError(
                f"Unknown config key {key!r}; known at this level: {sorted(node.keys())}"
            )
        try:
            node[parts[-1]] = value
        except TypeError as e:
            raise TypeError(f"Config key {key!r}: {e}") from None
    return new
