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
    c.max_seq_len = 512  # longest sequence the model is used with
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
