"""Building blocks of the Qwen3 decoder: RMSNorm, rotary embeddings, attention, SwiGLU MLP.

Every parameter carries logical axis names (see `tg_jax.sharding`); activations are
constrained with logical names at layer boundaries.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tg_jax.models.config import ModelConfig

Array = jax.Array
KVCache = dict[str, Array]  # {"k": [B, S, K, Dh], "v": [B, S, K, Dh]} for one layer

_init = nn.initializers.normal(stddev=0.02)


def _param(module: nn.Module, name: str, shape, axes, init=_init, dtype=jnp.float32):
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class RMSNorm(nn.Module):
    """x / rms(x) * scale, computed in fp32 and cast back (as in Qwen3RMSNorm)."""

    eps: float
    param_dtype: Any = jnp.float32
    axis_name: str = "norm"

    @nn.compact
    def __call__(self, x: Array) -> Array:
        scale = _param(
            self, "scale", (x.shape[-1],), (self.axis_name,), nn.initializers.ones, self.param_dtype
        )
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = scale.reshape((1,) * (x.ndim - 1) + scale.shape)
        return scale.astype(x.dtype) * x32.astype(x.dtype)


def rope(x_BxTxNxH: Array, positions_BxT: Array, theta: float) -> Array:
    """Rotary embedding in the rotate-half convention (first half / second half pairs)."""
    head_dim = x_BxTxNxH.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles_BxTxH2 = positions_BxT.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
    cos = jnp.cos(angles_BxTxH2)[:, :, None, :]
    sin = jnp.sin(angles_BxTxH2)[:, :, None, :]
    x = x_BxTxNxH.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxNxH.dtype)


def attention_mask(
    q_positions_BxT: Array,
    k_positions_BxS: Array,
    q_segments_BxT: Array | None,
    k_segments_BxS: Array | None,
) -> Array:
    """Boolean [B, 1, 1, T, S] mask: causal by position and, when given, same non-zero segment."""
    mask = k_positions_BxS[:, None, :] <= q_positions_BxT[:, :, None]
    if q_segments_BxT is not None:
        same = q_segments_BxT[:, :, None] == k_segments_BxS[:, None, :]
        mask = mask & same & (k_segments_BxS[:, None, :] != 0)
    return mask[:, None, None, :, :]


def _write_cache(cache_BxSxKxH: Array, new_BxTxKxH: Array, start_B: Array) -> Array:
    """Writes T new entries per row at slots [start_b, start_b + T)."""

    def one(c, n, s):
        return jax.lax.dynamic_update_slice(c, n.astype(c.dtype), (s, 0, 0))

    return jax.vmap(one)(cache_BxSxKxH, new_BxTxKxH, start_B)


def _attend(q_BxTxKxGxH: Array, keys_BxSxKxH: Array, values_BxSxKxH: Array, mask) -> Array:
    """Softmax attention of T queries over S keys: [B, T, K, G, H] (fp32 scores)."""
    h = q_BxTxKxGxH.shape[-1]
    scores = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH, keys_BxSxKxH).astype(jnp.float32)
    scores = scores * (h**-0.5)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q_BxTxKxGxH.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs, values_BxSxKxH)


class Attention(nn.Module):
    """Grouped-query attention with per-head q/k RMSNorm (Qwen3) and an optional KV cache."""

    config: ModelConfig

    @nn.compact
    def __call__(
        self,
        x_BxTxD: Array,
        positions_BxT: Array,
        segment_ids_BxT: Array | None,
        cache: KVCache | None,
    ) -> tuple[Array, KVCache | None]:
        cfg = self.config
        dt, pdt = cfg.jnp_dtype, cfg.jnp_param_dtype
        d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        wq = _param(self, "q_proj", (d, n, h), ("embed", "heads", "head_dim"), dtype=pdt)
        wk = _param(self, "k_proj", (d, k, h), ("embed", "kv_heads", "head_dim"), dtype=pdt)
        wv = _param(self, "v_proj", (d, k, h), ("embed", "kv_heads", "head_dim"), dtype=pdt)
        wo = _param(self, "o_proj", (n, h, d), ("heads", "head_dim", "embed"), dtype=pdt)
        x = x_BxTxD.astype(dt)
        q_BxTxNxH = jnp.einsum("btd,dnh->btnh", x, wq.astype(dt))
        k_BxTxKxH = jnp.einsum("btd,dkh->btkh", x, wk.astype(dt))
        v_BxTxKxH = jnp.einsum("btd,dkh->btkh", x, wv.astype(dt))
        q_BxTxNxH = RMSNorm(cfg.rms_norm_eps, pdt, "head_dim", name="q_norm")(q_BxTxNxH)
        k_BxTxKxH = RMSNorm(cfg.rms_norm_eps, pdt, "head_dim", name="k_norm")(k_BxTxKxH)
        q_BxTxNxH = rope(q_BxTxNxH, positions_BxT, cfg.rope_theta)
        k_BxTxKxH = rope(k_BxTxKxH, positions_BxT, cfg.rope_theta)
        q_BxTxNxH = nn.with_logical_constraint(q_BxTxNxH, ("batch", "length", "heads", "head_dim"))

        if cache is None:
            keys, values, k_pos, k_seg = k_BxTxKxH, v_BxTxKxH, positions_BxT, segment_ids_BxT
            new_cache = None
        else:
            # Slot index == position: new tokens are written at their positions, and the causal
            # mask by position hides slots that hold padding or stale entries beyond the query.
            start_B = positions_BxT[:, 0]
            keys = _write_cache(cache["k"], k_BxTxKxH, start_B)
            values = _write_cache(cache["v"], v_BxTxKxH, start_B)
            new_cache = {"k": keys, "v": values}
            keys, values = keys.astype(dt), values.astype(dt)
            s = keys.shape[1]
            k_pos = jnp.broadcast_to(jnp.arange(s, dtype=positions_BxT.dtype), (keys.shape[0], s))
            k_seg = None
            segment_ids_BxT = None

        b, t = q_BxTxNxH.shape[:2]
        g = n // k
        q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, k, g, h)
        block = cfg.attn_query_block
        if cache is None and 0 < block < t:
            # Causal query blocks: block [lo, hi) scores keys [0, hi) only (see ModelConfig).
            outs = []
            for lo in range(0, t, block):
                hi = min(lo + block, t)
                seg = None if segment_ids_BxT is None else segment_ids_BxT[:, lo:hi]
                k_seg_blk = None if k_seg is None else k_seg[:, :hi]
                outs.append(
                    _attend(
                        q_BxTxKxGxH[:, lo:hi],
                        keys[:, :hi],
                        values[:, :hi],
                        attention_mask(positions_BxT[:, lo:hi], k_pos[:, :hi], seg, k_seg_blk),
                    )  # fmt: skip
                )
            out_BxTxKxGxH = jnp.concatenate(outs, axis=1)
        else:
            mask = attention_mask(positions_BxT, k_pos, segment_ids_BxT, k_seg)
            out_BxTxKxGxH = _attend(q_BxTxKxGxH, keys, values, mask)
        out_BxTxNxH = out_BxTxKxGxH.reshape(b, t, n, h)
        out_BxTxD = jnp.einsum("btnh,nhd->btd", out_BxTxNxH, wo.astype(dt))
        return out_BxTxD, new_cache


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x_BxTxD: Array) -> Array:
        cfg = self.config
        dt, pdt = cfg.jnp_dtype, cfg.jnp_param_dtype
        d, f = cfg.d_model, cfg.mlp_dim
        w_gate = _param(self, "gate_proj", (d, f), ("embed", "mlp"), dtype=pdt)
        w_up = _param(self, "up_proj", (d, f), ("embed", "mlp"), dtype=pdt)
        w_down = _param(self, "down_proj", (f, d), ("mlp", "embed"), dtype=pdt)
        x = x_BxTxD.astype(dt)
        gate = jnp.einsum("btd,df->btf", x, w_gate.astype(dt))
        up = jnp.einsum("btd,df->btf", x, w_up.astype(dt))
        hidden = nn.with_logical_constraint(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
        return jnp.einsum("btf,fd->btd", hidden, w_down.astype(dt))
