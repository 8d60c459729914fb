"""Building blocks of the Qwen3 decoder: RMSNorm, rotary embeddings, attention, SwiGLU MLP.

Every parameter carries logical axis names (see `tg_jax.sharding`); activations are
constrained with logical names at layer boundaries.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tg_jax.models.attention import attend
from tg_jax.models.config import ModelConfig

Array = jax.Array

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


def rope_tables(positions_BxT: Array, head_dim: int, theta: float) -> tuple[Array, Array]:
    """RoPE cos, sin [B, T, 1, H / 2] (fp32) of the given positions."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles_BxTxH2 = positions_BxT.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
    return jnp.cos(angles_BxTxH2)[:, :, None, :], jnp.sin(angles_BxTxH2)[:, :, None, :]


def rope(x_BxTxNxH: Array, positions_BxT: Array, theta: float) -> Array:
    """Rotary embedding in the rotate-half convention (first half / second half pairs)."""
    cos, sin = rope_tables(positions_BxT, x_BxTxNxH.shape[-1], theta)
    x = x_BxTxNxH.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxNxH.dtype)


def apply_rope(x_BxTxNxH: Array, cos: Array, sin: Array) -> Array:
    """`rope` with precomputed `rope_tables` (the decode path's form; the same arithmetic).

    Written as x * [cos, cos] + [x2, x1] * [-sin, sin], one elementwise pass over x and its
    halves swapped (x1 * cos + x2 * (-sin) rounds like x1 * cos - x2 * sin; compiled, XLA may
    fuse the products differently, a float-rounding difference). XLA:CPU ran the split / two
    products / concatenate form as several kernels per decode step.
    """
    x = x_BxTxNxH.astype(jnp.float32)
    half = x.shape[-1] // 2
    swapped = jnp.concatenate([x[..., half:], x[..., :half]], axis=-1)
    out = x * jnp.concatenate([cos, cos], axis=-1) + swapped * jnp.concatenate([-sin, sin], axis=-1)
    return out.astype(x_BxTxNxH.dtype)


def attention_mask(
    q_positions_BxT: Array,
    k_positions_BxS: Array,
    q_segments_BxT: Array | None,
    k_segments_BxS: Array | None,
) -> Array:
    """Boolean [B, T, S] mask: causal by position and, when given, same non-zero segment."""
    mask = k_positions_BxS[:, None, :] <= q_positions_BxT[:, :, None]
    if q_segments_BxT is not None:
        same = q_segments_BxT[:, :, None] == k_segments_BxS[:, None, :]
        mask = mask & same & (k_segments_BxS[:, None, :] != 0)
    return mask


class Attention(nn.Module):
    """Grouped-query attention with per-head q/k RMSNorm (Qwen3) over a full sequence.

    No KV cache: decoding runs the same params through `tg_jax.models.decode`.
    """

    config: ModelConfig

    @nn.compact
    def __call__(
        self, x_BxTxD: Array, positions_BxT: Array, segment_ids_BxT: Array | None
    ) -> Array:
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

        def visible(lo: int, hi: int, s: int) -> Array:  # queries [lo, hi), keys [0, s)
            seg = segment_ids_BxT
            return attention_mask(
                positions_BxT[:, lo:hi],
                positions_BxT[:, :s],
                None if seg is None else seg[:, lo:hi],
                None if seg is None else seg[:, :s],
            )

        # Causal query blocks (cfg.attn_query_block): block [lo, hi) scores keys [0, hi) only.
        out_BxTxNxH = attend(
            q_BxTxNxH,
            k_BxTxKxH,
            v_BxTxKxH,
            visible,
            dtype=dt,
            query_block=cfg.attn_query_block,
            causal_keys=0,
        )
        return jnp.einsum("btnh,nhd->btd", out_BxTxNxH, wo.astype(dt))


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
