"""Typed model configuration built from the `config.model` ConfigDict."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from tg_jax.config_schema import Section

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
REMAT_POLICIES = ("none", "full", "dots", "dots_with_no_batch_dims")


@dataclasses.dataclass(frozen=True)
class ModelConfig(Section):
    """Architecture of a Qwen3-family decoder (dense or mixture-of-experts).

    Field names follow Hugging Face's `Qwen3Config` where one exists, so that
    `ModelConfig.from_hf(hf_config_dict)` is a rename, not a translation.
    """

    section: ClassVar[str] = "model"
    # The section's run settings, read by tg_jax.models.hf_dir and tg_jax.text.
    ignored: ClassVar[tuple[str, ...]] = ("hf_checkpoint", "tool_format")
    unset_hint: ClassVar[str] = (
        "they come from model.hf_checkpoint's config.json (tg_jax.models.hf_dir.resolve_config "
        "fills them)"
    )

    vocab_size: int
    """Vocabulary size (embedding rows)."""
    d_model: int
    """Hidden size (hidden_size)."""
    num_layers: int
    """Decoder layers (num_hidden_layers), run under nn.scan."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA ratio num_heads / num_kv_heads)."""
    head_dim: int
    """Per-head dim, independent of d_model / num_heads, as in Qwen3."""
    mlp_dim: int
    """Intermediate size of the dense SwiGLU MLP (intermediate_size)."""
    rope_theta: float = 1_000_000.0
    """RoPE base frequency."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the input embedding with the output projection."""
    param_dtype: str = "float32"
    """Storage dtype of the params."""
    dtype: str = "float32"
    """Compute dtype of activations and matmuls (fp32 on CPU: bf16 matmuls are slower there)."""
    remat_policy: str = "none"
    """none | full | dots | dots_with_no_batch_dims."""
    scan_unroll: int = 1
    """Layers per iteration of the scanned layer loop (lax.scan `unroll`); num_layers unrolls
    it fully. Params stay stacked either way. On CPU a fully unrolled stack trains ~15-25%
    faster (XLA drops the loop's per-layer slicing and stacking of activations)."""
    max_seq_len: int = 4096
    """Longest sequence the model is used with."""
    attn_query_block: int = 0
    """Full-sequence attention (no KV cache) in query blocks of this many tokens; block i only
    computes scores against keys up to its own end, which skips the masked upper triangle
    (0 = one block). Exact when no query attends to a later index of the sequence, which
    holds for causal positions that never decrease within a segment (plain and packed rows,
    all of this codebase's inputs). Faster on CPU, where attention over T tokens otherwise
    computes all T^2 scores (keep T / block small, e.g. 128 for T <= 1024). Exact up to float
    rounding: a chaotic training recipe can still end elsewhere."""
    num_experts: int = 0
    """Mixture of experts (Qwen3-MoE): 0 = a dense MLP in every layer."""
    experts_per_token: int = 0
    """Top-k experts per token (MoE only)."""
    moe_mlp_dim: int = 0
    """Per-expert intermediate size (MoE only)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k router probabilities (MoE only)."""
    router_aux_loss_coef: float = 0.0
    """Load-balancing loss weight (MoE only)."""
    router_replay: bool = False
    """Routing replay (R3, MoE only): the rollout sampler or engine records the experts each
    token was routed to and the trainer's student and teacher forwards route by them (hint
    tokens, which the rollout never saw, by the router); not with rl_loop.rollout_engine
    "vllm"."""

    def __post_init__(self):
        def need(cond, msg):
            if not cond:
                raise ValueError(f"Invalid model config: {msg}")

        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads"):
            need(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        need(
            self.head_dim > 0 and self.head_dim % 2 == 0,
            f"head_dim must be even, got {self.head_dim}",
        )
        need(
            self.num_heads % self.num_kv_heads == 0,
            f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}",
        )
        need(
            self.param_dtype in _DTYPES, f"param_dtype {self.param_dtype!r} not in {list(_DTYPES)}"
        )
        need(self.dtype in _DTYPES, f"dtype {self.dtype!r} not in {list(_DTYPES)}")
        need(
            self.remat_policy in REMAT_POLICIES,
            f"remat_policy {self.remat_policy!r} not in {REMAT_POLICIES}",
        )
        need(self.scan_unroll >= 1, f"scan_unroll must be >= 1, got {self.scan_unroll}")
        need(
            self.attn_query_block >= 0,
            f"attn_query_block must be >= 0, got {self.attn_query_block}",
        )
        if self.num_experts:
            need(
                0 < self.experts_per_token <= self.num_experts,
                "experts_per_token must be in [1, num_experts]",
            )
            need(self.moe_mlp_dim > 0, "moe_mlp_dim must be > 0 for a MoE model")
        else:
            need(self.mlp_dim > 0, "mlp_dim must be > 0 for a dense model")
            need(not self.router_replay, "router_replay needs a mixture-of-experts model")

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def jnp_param_dtype(self):
        return _DTYPES[self.param_dtype]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def num_params(self, include_embeddings: bool = True) -> int:
        """Parameter count (all experts counted)."""
        d, h, kv, hd = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim
        attn = d * h * hd + 2 * d * kv * hd + h * hd * d + 2 * hd
        if self.is_moe:
            mlp = self.num_experts * 3 * d * self.moe_mlp_dim + d * self.num_experts
        else:
            mlp = 3 * d * self.mlp_dim
        per_layer = attn + mlp + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + d + (emb if include_embeddings else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Forward matmul FLOPs per token (2 * active params + attention), the MFU convention."""
        d, h, kv, hd = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim
        attn_proj = 2 * (d * h * hd + 2 * d * kv * hd + h * hd * d)
        attn_scores = 2 * 2 * h * hd * seq_len / 2  # causal: half the keys on average
        if self.is_moe:
            mlp = 2 * self.experts_per_token * 3 * d * self.moe_mlp_dim + 2 * d * self.num_experts
        else:
            mlp = 2 * 3 * d * self.mlp_dim
        return self.num_layers * (attn_proj + attn_scores + mlp) + 2 * d * self.vocab_size
