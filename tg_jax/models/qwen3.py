"""Qwen3-family decoder-only transformer (dense; MoE feed-forward plugs in per layer).

Architecture as in Hugging Face's `Qwen3ForCausalLM`: token embedding, N decoder layers
(RMSNorm -> GQA attention with per-head q/k RMSNorm and RoPE -> residual, RMSNorm ->
SwiGLU MLP (or MoE) -> residual), final RMSNorm, tied or untied unembedding.

Layers run under `nn.scan` (parameters stacked on a leading "layers" axis) with an optional
rematerialisation policy. This module is the full-sequence path (training, scoring; optional
packing by segment ids); decoding with a KV cache runs the same params through
`tg_jax.models.decode`. Shape letters: the legend in `tg_jax.models`.

Functional entry points used by the rest of the package:

    logits_BxTxV = forward(model, params, tokens_BxT, positions_BxT, segment_ids_BxT)
    hidden_BxTxD = hidden_states(model, params, tokens_BxT, positions_BxT, segment_ids_BxT)
    logits_BxCxV = unembed(model, params, hidden_BxCxD)
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tg_jax import tracing
from tg_jax.models.config import ModelConfig
from tg_jax.models.layers import MLP, Attention, RMSNorm, _param

Array = jax.Array

_REMAT = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_with_no_batch_dims": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def make_ffn(config: ModelConfig, name: str) -> nn.Module:
    """The feed-forward block of one layer: dense SwiGLU or Qwen3-MoE."""
    if config.is_moe:
        from tg_jax.models.moe import MoE  # noqa: PLC0415 (only MoE models need it)

        return MoE(config, name=name)
    return MLP(config, name=name)


class DecoderLayer(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x_BxTxD, positions_BxT, segment_ids_BxT, replay_BxTxJ=None):
        cfg = self.config
        pdt = cfg.jnp_param_dtype
        h = RMSNorm(cfg.rms_norm_eps, pdt, "embed", name="attn_norm")(x_BxTxD)
        x_BxTxD = x_BxTxD + Attention(cfg, name="attn")(h, positions_BxT, segment_ids_BxT)
        h = RMSNorm(cfg.rms_norm_eps, pdt, "embed", name="mlp_norm")(x_BxTxD)
        ffn = make_ffn(cfg, "mlp")
        x_BxTxD = x_BxTxD + (ffn(h) if replay_BxTxJ is None else ffn(h, replay_BxTxJ))
        x_BxTxD = nn.with_logical_constraint(x_BxTxD, ("batch", "length", "act_embed"))
        return x_BxTxD, None


_SCANNED: dict[tuple[str, int, int], type] = {}


def scanned_layers(remat_policy: str, num_layers: int, unroll: int) -> type:
    """The scanned (and rematerialised) DecoderLayer class, built once per (policy, layers,
    unroll) under `tracing.build_lock`: building a Flax class mutates its bases while it
    runs, so it is never done per call, nor in two threads at once (tg_jax.tracing)."""
    key = (remat_policy, int(num_layers), int(unroll))
    with tracing.build_lock:
        if key not in _SCANNED:
            layer_cls = DecoderLayer
            if remat_policy != "none":
                layer_cls = nn.remat(layer_cls, policy=_REMAT[remat_policy], prevent_cse=False)
            _SCANNED[key] = nn.scan(
                layer_cls,
                variable_axes={"params": 0, "intermediates": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast, nn.broadcast, 0),  # the replayed routing: per layer
                length=num_layers,
                unroll=unroll,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
        return _SCANNED[key]


class Transformer(nn.Module):
    """Qwen3 decoder. `__call__` returns fp32 logits [B, T, V] (or final hidden states)."""

    config: ModelConfig

    def setup(self):
        cfg = self.config
        pdt = cfg.jnp_param_dtype
        self.embed = _param(
            self, "embed", (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), dtype=pdt
        )
        if not cfg.tie_embeddings:
            self.lm_head = _param(
                self, "lm_head", (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), dtype=pdt
            )
        self.layers = scanned_layers(
            cfg.remat_policy, cfg.num_layers, min(cfg.scan_unroll, cfg.num_layers)
        )(cfg, name="layers")
        self.final_norm = RMSNorm(cfg.rms_norm_eps, pdt, "embed", name="final_norm")

    def embed_tokens(self, tokens_BxT: Array) -> Array:
        x = jnp.take(self.embed, tokens_BxT, axis=0).astype(self.config.jnp_dtype)
        return nn.with_logical_constraint(x, ("batch", "length", "act_embed"))

    def unembed(self, hidden_BxTxD: Array) -> Array:
        """Final hidden states (after the final norm) -> fp32 logits."""
        dt = self.config.jnp_dtype
        h = hidden_BxTxD.astype(dt)
        if self.config.tie_embeddings:
            logits = jnp.einsum("btd,vd->btv", h, self.embed.astype(dt))
        else:
            logits = jnp.einsum("btd,dv->btv", h, self.lm_head.astype(dt))
        logits = nn.with_logical_constraint(logits, ("batch", "length", "vocab"))
        return logits.astype(jnp.float32)

    def __call__(
        self,
        tokens_BxT: Array,
        positions_BxT: Array | None = None,
        segment_ids_BxT: Array | None = None,
        return_hidden: bool = False,
        replay_BxTxLxJ: Array | None = None,
    ) -> Array:
        """replay_BxTxLxJ: MoE router replay, per token and layer the experts to route to
        (-1: the router's own choice; `tg_jax.models.moe.replay`)."""
        if positions_BxT is None:
            positions_BxT = jnp.broadcast_to(
                jnp.arange(tokens_BxT.shape[1], dtype=jnp.int32), tokens_BxT.shape
            )
        x = self.embed_tokens(tokens_BxT)
        if replay_BxTxLxJ is not None and not self.config.is_moe:
            raise ValueError("router replay (replay_BxTxLxJ) needs a mixture-of-experts model")
        replay = None if replay_BxTxLxJ is None else jnp.moveaxis(replay_BxTxLxJ, 2, 0)
        x, _ = self.layers(x, positions_BxT, segment_ids_BxT, replay)
        x = self.final_norm(x)
        return x if return_hidden else self.unembed(x)


def forward(
    model: Transformer,
    params: Any,
    tokens_BxT,
    positions_BxT=None,
    segment_ids_BxT=None,
    replay_BxTxLxJ=None,
):
    """Full-sequence logits [B, T, V] (fp32); replay_BxTxLxJ: MoE router replay."""
    return model.apply(
        {"params": params},
        tokens_BxT,
        positions_BxT,
        segment_ids_BxT,
        replay_BxTxLxJ=replay_BxTxLxJ,
    )


def hidden_states(
    model: Transformer,
    params: Any,
    tokens_BxT,
    positions_BxT=None,
    segment_ids_BxT=None,
    replay_BxTxLxJ=None,
):
    """Final-norm hidden states [B, T, D]; pair with `unembed` to get logits chunk by chunk."""
    return model.apply(
        {"params": params},
        tokens_BxT,
        positions_BxT,
        segment_ids_BxT,
        return_hidden=True,
        replay_BxTxLxJ=replay_BxTxLxJ,
    )


def unembed(model: Transformer, params: Any, hidden_BxTxD):
    return model.apply({"params": params}, hidden_BxTxD, method=Transformer.unembed)


def init_params(model: Transformer, rng: Array, batch: int = 1, seq_len: int = 8):
    """Unsharded params with their logical-partitioning metadata boxes stripped."""
    tokens = jnp.zeros((batch, seq_len), jnp.int32)
    return nn.unbox(model.init(rng, tokens)["params"])
