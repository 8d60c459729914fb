"""Qwen3-MoE sparse feed-forward: top-k routed SwiGLU experts, dropless.

Semantics follow Hugging Face's `Qwen3MoeSparseMoeBlock`:

1. router logits = x @ router [D, E]; probabilities = softmax over experts in fp32;
2. the top-k experts per token (ties go to the lower index, as `torch.topk`);
3. optionally renormalise the k probabilities to sum to one (`norm_topk_prob`);
4. output = sum over the k experts of weight * down(silu(gate(x)) * up(x)).

No token is ever dropped (no capacity factor), so logits equal transformers' exactly up to
float rounding. Every layer is a MoE layer: HF's `mlp_only_layers` / `decoder_sparse_step`
(dense MLPs in some layers) are not supported, because the scanned layer stack needs one
layer type; `tg_jax.models.hf_io.model_config_from_hf` rejects such checkpoints.

Two ways to evaluate the experts, chosen statically from the number of (device-local)
tokens times local experts:

* "dense": every local expert runs on every token and a one-hot combine matrix [X, E]
  (zero for unselected experts) weights the results. E/k times the useful FLOPs, but no
  sorting, gathers or ragged shapes: the fastest choice for few tokens (decode steps, tests,
  CPU, where `ragged_dot` is itself emulated densely).
* "ragged": the X*k (token, expert) assignments are sorted by expert, the tokens gathered
  into expert-contiguous rows, and each projection is one grouped matmul
  (`jax.lax.ragged_dot`, a native grouped GEMM on TPU) over the local experts; results are
  unsorted with the inverse permutation and summed over the k slots. FLOPs are the useful
  ones only, memory is O(X*k*F) instead of O(X*E*F): the choice for training sequences.

Parallelism: expert weights [E, D, F] carry logical axes ("expert", "embed", "moe_mlp").
Under a mesh, the expert computation runs in `shard_map`: each device evaluates its own
experts (and its slice of the expert hidden size) for its batch shard, all-gathers the
"embed" (FSDP) slice of the weights, and the partial outputs are summed over the mesh
axes that split experts and hidden units. Where those axes also split the batch, tokens
are all-gathered over them first and the sum is a reduce-scatter back (expert parallelism
by all-gather, no all-to-all). A dimension that does not divide its mesh axes (6 experts
over "expert" 4) is split only over the axes `sharding.fit_spec` keeps, as the params were
placed: the weights are whole over the others, which are neither gathered nor summed over
(tokens split over such an axis stay split, each device running them through all of its
experts). The router runs outside, under the compiler's automatic partitioning; its [D, E]
weight is tiny and is replicated along E so that the softmax over experts needs no
communication.

Auxiliary load-balancing loss: each layer sows `router_aux_loss` (HF's Switch-style loss of
that layer alone) and `router_load` ([2, E]: fraction of top-k assignments and mean router
probability per expert). `load_balancing_loss` combines the sown loads of all layers exactly
as HF's `load_balancing_loss_func` does (without an attention mask: padding counts).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tg_jax import sharding
from tg_jax.models.config import ModelConfig
from tg_jax.models.layers import _param

Array = jax.Array

# "auto" dispatch runs all local experts densely while tokens * local experts is at most this
# (e.g. 128 decode rows x 128 experts): below it the extra FLOPs cost less than the sort.
DENSE_MAX_TOKEN_EXPERTS = 1 << 14
DISPATCH_MODES = ("auto", "dense", "ragged")


def route(
    x_XxD: Array, router_DxE: Array, k: int, norm_topk_prob: bool, dtype: Any
) -> tuple[Array, Array, Array]:
    """Router: returns (probs_XxE fp32, top-k weights_XxJ in `dtype`, expert ids_XxJ int32)."""
    logits_XxE = jnp.einsum(
        "nd,de->ne", x_XxD, router_DxE.astype(x_XxD.dtype), preferred_element_type=jnp.float32
    )
    probs_XxE = jax.nn.softmax(logits_XxE, axis=-1)
    top_XxJ, ids_XxJ = jax.lax.top_k(probs_XxE, k)
    return probs_XxE, _gate_weights(top_XxJ, norm_topk_prob, dtype), ids_XxJ.astype(jnp.int32)


def _gate_weights(top_XxJ: Array, norm_topk_prob: bool, dtype: Any) -> Array:
    """The chosen experts' router probabilities as their weights (renormalised over the k
    when norm_topk_prob)."""
    if norm_topk_prob:
        top_XxJ = top_XxJ / jnp.sum(top_XxJ, axis=-1, keepdims=True)
    return top_XxJ.astype(dtype)


def replay(
    probs_XxE: Array, replay_XxJ: Array, own_XxJ: Array, cfg: ModelConfig, dtype: Any
) -> tuple[Array, Array]:
    """(weights, ids) routing each token to its replayed experts (a row with any -1: its own
    top-k `own_XxJ`); the weights are the router's probabilities there, weighted as the
    router's own (`_gate_weights`: the gradient reaches the router through them)."""
    use = jnp.all(replay_XxJ >= 0, axis=-1, keepdims=True)
    ids_XxJ = jnp.where(use, replay_XxJ, own_XxJ).astype(jnp.int32)
    top_XxJ = jnp.take_along_axis(probs_XxE, ids_XxJ, axis=-1)
    return _gate_weights(top_XxJ, cfg.norm_topk_prob, dtype), ids_XxJ


def _experts_dense(x_XxD, ids_XxJ, w_XxJ, gate_ExDxF, up_ExDxF, down_ExFxD, first_expert):
    e = gate_ExDxF.shape[0]
    # one_hot of an id outside [0, e) is all zeros: experts held by other devices drop out.
    onehot_XxJxE = jax.nn.one_hot(ids_XxJ - first_expert, e, dtype=w_XxJ.dtype)
    combine_XxE = jnp.einsum("nke,nk->ne", onehot_XxJxE, w_XxJ)
    gate_XxExF = jnp.einsum("nd,edf->nef", x_XxD, gate_ExDxF)
    up_XxExF = jnp.einsum("nd,edf->nef", x_XxD, up_ExDxF)
    hidden_XxExF = jax.nn.silu(gate_XxExF) * up_XxExF * combine_XxE[:, :, None]
    return jnp.einsum("nef,efd->nd", hidden_XxExF, down_ExFxD, preferred_element_type=jnp.float32)


def _experts_ragged(x_XxD, ids_XxJ, w_XxJ, gate_ExDxF, up_ExDxF, down_ExFxD, first_expert):
    n, k = ids_XxJ.shape
    e = gate_ExDxF.shape[0]
    local_A = ids_XxJ.reshape(-1) - first_expert  # A = X * k assignments
    valid_A = (local_A >= 0) & (local_A < e)
    key_A = jnp.where(valid_A, local_A, e)  # other devices' experts sort last, outside all groups
    order_A = jnp.argsort(key_A, stable=True)
    group_sizes_E = jnp.bincount(key_A, length=e + 1)[:e].astype(jnp.int32)
    xs_AxD = x_XxD[order_A // k]
    gate_AxF = jax.lax.ragged_dot(xs_AxD, gate_ExDxF, group_sizes_E)
    up_AxF = jax.lax.ragged_dot(xs_AxD, up_ExDxF, group_sizes_E)
    out_AxD = jax.lax.ragged_dot(jax.nn.silu(gate_AxF) * up_AxF, down_ExFxD, group_sizes_E)
    weight_A = w_XxJ.reshape(-1)[order_A].astype(jnp.float32)
    # Rows past the last group are unspecified on some backends: select, never multiply, them.
    out_AxD = jnp.where(valid_A[order_A][:, None], out_AxD.astype(jnp.float32), 0.0)
    out_AxD = out_AxD * weight_A[:, None]
    unsorted_AxD = out_AxD[jnp.argsort(order_A)]
    return jnp.sum(unsorted_AxD.reshape(n, k, -1), axis=1)


def experts(
    x_XxD: Array,
    ids_XxJ: Array,
    w_XxJ: Array,
    gate_ExDxF: Array,
    up_ExDxF: Array,
    down_ExFxD: Array,
    first_expert: Array | int = 0,
    dispatch: str = "auto",
) -> Array:
    """Weighted sum of the selected SwiGLU experts held here (ids first_expert .. +E).

    Args:
      x_XxD: tokens in the compute dtype.
      ids_XxJ, w_XxJ: the router's selected expert ids (global) and their weights.
      gate_ExDxF, up_ExDxF, down_ExFxD: the local experts' weights (compute dtype).
      first_expert: global id of local expert 0 (non-zero under expert parallelism).
      dispatch: "dense" | "ragged" | "auto" (see the module docstring).
    Returns:
      [X, D] fp32: contributions of the local experts only (sum over devices outside).
    """
    if dispatch not in DISPATCH_MODES:
        raise ValueError(f"dispatch {dispatch!r} not in {DISPATCH_MODES}")
    if dispatch == "auto":
        dense = x_XxD.shape[0] * gate_ExDxF.shape[0] <= DENSE_MAX_TOKEN_EXPERTS
        dispatch = "dense" if dense else "ragged"
    fn = _experts_dense if dispatch == "dense" else _experts_ragged
    return fn(x_XxD, ids_XxJ, w_XxJ, gate_ExDxF, up_ExDxF, down_ExFxD, first_expert)


def _mesh_axes(logical: str) -> tuple[str, ...]:
    """Mesh axes that the active logical rules map `logical` to (empty when replicated)."""
    return _entry_axes(nn.logical_to_mesh_axes((logical,))[0])


def _entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _weight_axes(shape_ExDxF: tuple[int, ...], mesh: Any) -> list[tuple[str, ...]]:
    """[expert, embed, moe_mlp]: the mesh axes each dimension of the experts' [E, D, F]
    weights is split over, as the params were placed (`sharding.logical_to_shardings`): the
    axes the active rules give it, less those `sharding.fit_spec` replicates it over because
    they do not divide it (6 experts over "expert" 4). Down [E, F, D] gets the same per
    dimension (the rules are resolved in their own order, whatever the dimensions')."""
    spec = nn.logical_to_mesh_axes(("expert", "embed", "moe_mlp"))
    fitted = sharding.fit_spec(spec, shape_ExDxF, dict(mesh.shape))
    return [_entry_axes(entry) for entry in fitted]


def _sharded_experts(x_BxTxD, ids_BxTxJ, w_BxTxJ, gate, up, down, dispatch) -> Array:
    """`experts` under shard_map on the active mesh (see the module docstring). The weights'
    in_specs are their real shardings (`_weight_axes`): over a mesh axis that does not divide
    its dimension they are whole, and that axis is neither gathered nor summed over."""
    mesh = jax.sharding.get_abstract_mesh()
    batch = _mesh_axes("batch")
    if x_BxTxD.shape[0] % max(1, _size(mesh, batch)):
        batch = ()  # e.g. a single sampling row: every device takes all tokens
    expert, embed, mlp = _weight_axes(tuple(gate.shape), mesh)
    split = expert + mlp  # axes whose devices hold different slices of the expert weights
    shared = tuple(a for a in batch if a in split)  # tokens must meet every expert slice
    summed = tuple(a for a in split if a not in shared)
    tok = P(batch or None)
    w_in = P(expert or None, embed or None, mlp or None)
    w_out = P(expert or None, mlp or None, embed or None)

    def body(x, ids, w, g, u, d):
        if embed:  # FSDP: gather this slice of experts over the embed dimension
            g = jax.lax.all_gather(g, embed, axis=1, tiled=True)
            u = jax.lax.all_gather(u, embed, axis=1, tiled=True)
            d = jax.lax.all_gather(d, embed, axis=2, tiled=True)
        if shared:
            x, ids, w = (jax.lax.all_gather(a, shared, axis=0, tiled=True) for a in (x, ids, w))
        b, t, dim = x.shape
        first = jax.lax.axis_index(expert) * g.shape[0] if expert else 0
        y = experts(
            x.reshape(b * t, dim),
            ids.reshape(b * t, -1),
            w.reshape(b * t, -1),
            g,
            u,
            d,
            first,
            dispatch,
        )
        y = y.astype(x.dtype).reshape(b, t, dim)
        if summed:
            y = jax.lax.psum(y, summed)
        if shared:
            y = jax.lax.psum_scatter(y, shared, scatter_dimension=0, tiled=True)
        return y

    return jax.shard_map(body, in_specs=(tok, tok, tok, w_in, w_in, w_out), out_specs=tok)(
        x_BxTxD, ids_BxTxJ, w_BxTxJ, gate, up, down
    )


def _size(mesh, axes: tuple[str, ...]) -> int:
    out = 1
    for a in axes:
        out *= mesh.shape[a]
    return out


class MoE(nn.Module):
    """Qwen3-MoE feed-forward block: router + `num_experts` SwiGLU experts, top-k routed."""

    config: ModelConfig
    dispatch: str = "auto"  # "auto" | "dense" | "ragged": how the experts are evaluated

    @nn.compact
    def __call__(self, x_BxTxD: Array, replay_BxTxJ: Array | None = None) -> Array:
        """replay_BxTxJ: experts to route each token to (router replay: the rollout engine's
        routing), -1 = the router's own choice for that token; the weights are the router's
        probabilities of the replayed experts (normalised as the router's own)."""
        cfg = self.config
        dt, pdt = cfg.jnp_dtype, cfg.jnp_param_dtype
        d, e, f, k = cfg.d_model, cfg.num_experts, cfg.moe_mlp_dim, cfg.experts_per_token
        router = _param(self, "router", (d, e), ("embed", None), dtype=pdt)
        gate = _param(self, "gate_proj", (e, d, f), ("expert", "embed", "moe_mlp"), dtype=pdt)
        up = _param(self, "up_proj", (e, d, f), ("expert", "embed", "moe_mlp"), dtype=pdt)
        down = _param(self, "down_proj", (e, f, d), ("expert", "moe_mlp", "embed"), dtype=pdt)
        b, t, _ = x_BxTxD.shape
        x = x_BxTxD.astype(dt)
        probs_XxE, w_XxJ, ids_XxJ = route(x.reshape(b * t, d), router, k, cfg.norm_topk_prob, dt)
        if replay_BxTxJ is not None:
            w_XxJ, ids_XxJ = replay(probs_XxE, replay_BxTxJ.reshape(b * t, k), ids_XxJ, cfg, dt)
        self._sow_load(probs_XxE, ids_XxJ)
        self.sow("intermediates", "router_ids", ids_XxJ.reshape(b, t, k))  # only when captured

        gate, up, down = gate.astype(dt), up.astype(dt), down.astype(dt)
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or mesh.size == 1 or not nn.get_logical_axis_rules():
            y = experts(x.reshape(b * t, d), ids_XxJ, w_XxJ, gate, up, down, 0, self.dispatch)
            return y.astype(dt).reshape(b, t, d)
        ids_BxTxJ, w_BxTxJ = ids_XxJ.reshape(b, t, k), w_XxJ.reshape(b, t, k)
        return _sharded_experts(x, ids_BxTxJ, w_BxTxJ, gate, up, down, self.dispatch)

    def _sow_load(self, probs_XxE: Array, ids_XxJ: Array) -> None:
        """Sows this layer's expert load and its HF load-balancing loss (no-op unless captured)."""
        e = self.config.num_experts
        frac_E = jnp.sum(jax.nn.one_hot(ids_XxJ, e, dtype=jnp.float32), axis=(0, 1))
        frac_E = frac_E / ids_XxJ.shape[0]  # sums to k, as HF's normalisation by rows
        prob_E = jnp.mean(probs_XxE, axis=0)
        self.sow("intermediates", "router_load", jnp.stack([frac_E, prob_E]))
        self.sow("intermediates", "router_aux_loss", e * jnp.sum(frac_E * prob_E))


def load_balancing_loss(intermediates: Any, config: ModelConfig) -> Array:
    """`router_aux_loss_coef` * HF's `load_balancing_loss_func` from sown `router_load`s.

    HF averages the per-expert assignment fractions and router probabilities over all layers
    and tokens first and multiplies the averages (not a mean of per-layer losses); every layer
    sees the same tokens, so averaging the per-layer means is the same thing.

    Args:
      intermediates: the "intermediates" collection of `model.apply(..., mutable=...)`.
      config: the model config (for `num_experts` and `router_aux_loss_coef`).
    Returns:
      A scalar fp32 loss (0 for a dense model or when nothing was sown).
    """
    loads = [
        leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(intermediates)
        if any(getattr(p, "key", None) == "router_load" for p in path)
    ]
    if not config.is_moe or not loads:
        return jnp.zeros((), jnp.float32)
    load_Lx2xE = jnp.concatenate([x.reshape(-1, 2, config.num_experts) for x in loads])
    mean_2xE = jnp.mean(load_Lx2xE.astype(jnp.float32), axis=0)
    aux = config.num_experts * jnp.sum(mean_2xE[0] * mean_2xE[1])
    return config.router_aux_loss_coef * aux
