"""Models: the Qwen3-family transformer, its configuration and its decode path.

qwen3.py is the full-sequence model (`forward`, `hidden_states`, `unembed`); decode.py is its
one KV-cache path (`prefill`, then `decode_one` per token), which the sampler drives;
fused_layers.py is the per-layer math on fused weights that it and the engine's paged calls
share.

Shape suffixes (`logits_BxTxV`: dimensions joined by "x"), one meaning per letter:

  B  batch rows                       T  tokens of a sequence or block (queries)
  S  key / cache slots a query sees   P  prompt block of the sampler (right-padded)
  R  generated-token slots (response) W  stop ids per row (sampler)
  C  positions of a logits chunk      L  layers
  D  model width (d_model)            V  vocabulary
  F  dense (or one expert's) MLP hidden width
  N  query heads                      K  key/value heads
  G  query heads per kv head (N / K)  H  head dim
  Q  fused q/k/v width, (N + 2K) * H  E  experts (MoE)
  J  experts per token (top-k, MoE)   X  tokens flattened over rows (B * T, MoE)
  A  routed (token, expert) assignments (X * J, MoE)
  digits: literal sizes ([2, E] router load); H2 = H / 2, T1 = T - 1
"""

from tg_jax.models import decode
from tg_jax.models.config import ModelConfig
from tg_jax.models.decode import DecodeCache, DecodeWeights, decode_one, decode_weights, prefill
from tg_jax.models.qwen3 import (
    Transformer,
    forward,
    hidden_states,
    init_params,
    unembed,
)

__all__ = [
    "DecodeCache",
    "DecodeWeights",
    "ModelConfig",
    "Transformer",
    "decode",
    "decode_one",
    "decode_weights",
    "forward",
    "hidden_states",
    "init_params",
    "prefill",
    "unembed",
]
