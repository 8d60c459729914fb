"""Models: the Qwen3-family transformer and its configuration."""

from tg_jax.models.config import ModelConfig
from tg_jax.models.qwen3 import (
    Transformer,
    decode,
    forward,
    hidden_states,
    init_cache,
    init_params,
    unembed,
)

__all__ = [
    "ModelConfig",
    "Transformer",
    "decode",
    "forward",
    "hidden_states",
    "init_cache",
    "init_params",
    "unembed",
]
