"""Hugging Face safetensors checkpoints <-> tg_jax params (dense Qwen3 and Qwen3-MoE).

Import reads straight into sharded params without a full copy anywhere: every param is
created by `jax.make_array_from_callback` with its target `NamedSharding`, and the callback
reads, for the device that asks, only that device's slice of the safetensors tensors
(`safe_open(...).get_slice(name)[rows, cols]` reads just those bytes from the memory map).
Host memory peaks at this host's distinct slices of one param (a slice that several local
devices share is read once). Without a mesh, params are plain host arrays (`jax.device_put`
them, or pass a one-device mesh).

Name and layout mapping (HF torch Linear weights are [out, in]; ours are [in, ...] with
per-head axes split and layers stacked on a leading axis):

    model.embed_tokens.weight [V, D]          embed [V, D]
    lm_head.weight [V, D] (untied only)       lm_head [D, V]
    model.norm.weight [D]                     final_norm.scale [D]
    model.layers.{i}.
      input_layernorm.weight [D]              layers.attn_norm.scale [L, D]
      post_attention_layernorm.weight [D]     layers.mlp_norm.scale [L, D]
      self_attn.{q,k,v}_proj.weight [N*H, D]  layers.attn.{q,k,v}_proj [L, D, N, H]
      self_attn.o_proj.weight [D, N*H]        layers.attn.o_proj [L, N, H, D]
      self_attn.{q,k}_norm.weight [H]         layers.attn.{q,k}_norm.scale [L, H]
      mlp.{gate,up,down}_proj.weight          layers.mlp.{gate,up,down}_proj [L, D, F] / [L, F, D]
      mlp.gate.weight [E, D]                  layers.mlp.router [L, D, E]           (MoE)
      mlp.experts.{j}.{gate,up}_proj.weight   layers.mlp.{gate,up}_proj [L, E, D, F] (MoE)
      mlp.experts.{j}.down_proj.weight        layers.mlp.down_proj [L, E, F, D]      (MoE)

MoE expert format: hub checkpoints (e.g. Qwen3-Coder-30B-A3B) and transformers 5.24's
`save_pretrained` store one 2-D tensor per expert, as above; transformers 5 fuses them into
`mlp.experts.gate_up_proj` [E, 2F, D] and `mlp.experts.down_proj` [E, D, F] only in memory.
Import accepts both (fused tensors are sliced on read); export writes per-expert tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from tg_jax import sharding as sharding_lib
from tg_jax import tracing
from tg_jax.models.config import ModelConfig
from tg_jax.models.hf_io import model_config_from_hf, model_config_to_hf
from tg_jax.models.qwen3 import Transformer

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One of our param leaves and the HF tensor(s) it comes from.

    kind: "plain" (same layout), "T" (2-D transpose), "in_heads" ([N*H, D] -> [D, N, H]),
    "out_heads" ([D, N*H] -> [N, H, D]), "experts" (per-expert 2-D tensors, transposed, ->
    [E, a, b]) or "fused" (one [E, rows, a] tensor, rows offset..offset+b -> [E, a, b]).
    """

    path: tuple[str, ...]
    hf: str  # name, or suffix after "model.layers.{i}." for per-layer entries
    kind: str
    per_layer: bool = True
    offset: int = 0  # row offset inside a fused tensor


def _entries(cfg: ModelConfig, fused_experts: bool = False) -> list[_Entry]:
    out = [
        _Entry(("embed",), "model.embed_tokens.weight", "plain", per_layer=False),
        _Entry(("final_norm", "scale"), "model.norm.weight", "plain", per_layer=False),
        _Entry(("layers", "attn", "q_proj"), "self_attn.q_proj.weight", "in_heads"),
        _Entry(("layers", "attn", "k_proj"), "self_attn.k_proj.weight", "in_heads"),
        _Entry(("layers", "attn", "v_proj"), "self_attn.v_proj.weight", "in_heads"),
        _Entry(("layers", "attn", "o_proj"), "self_attn.o_proj.weight", "out_heads"),
        _Entry(("layers", "attn", "q_norm", "scale"), "self_attn.q_norm.weight", "plain"),
        _Entry(("layers", "attn", "k_norm", "scale"), "self_attn.k_norm.weight", "plain"),
        _Entry(("layers", "attn_norm", "scale"), "input_layernorm.weight", "plain"),
        _Entry(("layers", "mlp_norm", "scale"), "post_attention_layernorm.weight", "plain"),
    ]
    if not cfg.tie_embeddings:
        out.append(_Entry(("lm_head",), "lm_head.weight", "T", per_layer=False))
    mlp = ("layers", "mlp")
    if not cfg.is_moe:
        out += [_Entry(mlp + (p,), f"mlp.{p}.weight", "T") for p in ("gate_proj", "up_proj")]
        out.append(_Entry(mlp + ("down_proj",), "mlp.down_proj.weight", "T"))
        return out
    out.append(_Entry(mlp + ("router",), "mlp.gate.weight", "T"))
    if fused_experts:
        f = cfg.moe_mlp_dim
        out += [
            _Entry(mlp + ("gate_proj",), "mlp.experts.gate_up_proj", "fused", offset=0),
            _Entry(mlp + ("up_proj",), "mlp.experts.gate_up_proj", "fused", offset=f),
            _Entry(mlp + ("down_proj",), "mlp.experts.down_proj", "fused", offset=0),
        ]
    else:
        out += [
            _Entry(mlp + (p,), "mlp.experts.{j}." + p + ".weight", "experts")
            for p in ("gate_proj", "up_proj", "down_proj")
        ]
    return out


def _hf_name(entry: _Entry, layer: int, expert: int | None = None) -> str:
    name = f"model.layers.{layer}.{entry.hf}" if entry.per_layer else entry.hf
    return name.replace("{j}", str(expert)) if expert is not None else name


def _hf_shape(entry: _Entry, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of one HF tensor given our per-layer shape (per expert for "experts")."""
    if entry.kind == "plain":
        return shape
    if entry.kind == "T":
        return shape[::-1]
    if entry.kind == "in_heads":
        return (shape[1] * shape[2], shape[0])
    if entry.kind == "out_heads":
        return (shape[2], shape[0] * shape[1])
    if entry.kind == "experts":
        return (shape[2], shape[1])
    raise ValueError(entry.kind)


# ----------------------------------------------------------------------------- reading


class HFCheckpoint(contextlib.AbstractContextManager):
    """Lazily opened safetensors checkpoint directory (single file or sharded index)."""

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, INDEX_FILE)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.exists(os.path.join(path, SINGLE_FILE)):
            weight_map = None
        else:
            raise FileNotFoundError(f"No {SINGLE_FILE} or {INDEX_FILE} in {path}")
        self._stack = contextlib.ExitStack()
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
        handles = {
            f: self._stack.enter_context(safe_open(os.path.join(path, f), "np")) for f in files
        }
        if weight_map is None:
            weight_map = {name: SINGLE_FILE for name in handles[SINGLE_FILE].keys()}
        self._handle = {name: handles[f] for name, f in weight_map.items()}

    def __exit__(self, *exc):
        self._stack.close()

    def names(self) -> set[str]:
        return set(self._handle)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle[name].get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """The tensor, or only `index` of it (just those bytes are read)."""
        if name not in self._handle:
            raise KeyError(f"{name!r} not in checkpoint {self.path}")
        tensor = self._handle[name].get_slice(name)
        return np.asarray(tensor[index] if index is not None else tensor[:])

    def config(self) -> dict[str, Any]:
        with open(os.path.join(self.path, "config.json")) as f:
            return json.load(f)


class _Tensors:
    """HF-named tensors in memory ({name: array}, e.g. a transformers `state_dict`), read
    through `HFCheckpoint`'s interface."""

    def __init__(self, tensors: Mapping[str, Any]):
        self.path, self._tensors = "<tensors in memory>", tensors

    def names(self) -> set[str]:
        return set(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(np.shape(self._tensors[name]))

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        x = np.asarray(self._tensors[name])
        return x[index] if index is not None else x


def _range(s: slice, n: int) -> slice:
    start, stop, step = s.indices(n)
    if step != 1:
        raise ValueError("Strided param shards are not supported")
    return slice(start, stop)


def _read_layer(ckpt: HFCheckpoint, e: _Entry, layer: int, idx: tuple[slice, ...], shape):
    """Our [per-layer] param's slice `idx` (over `shape`) from the HF tensor(s) of `layer`."""
    name = _hf_name(e, layer)
    if e.kind == "plain":
        return ckpt.read(name, idx)
    if e.kind == "T":
        return ckpt.read(name, idx[::-1]).T
    if e.kind in ("in_heads", "out_heads"):
        head_dim = shape[2] if e.kind == "in_heads" else shape[1]
        heads = idx[1] if e.kind == "in_heads" else idx[0]
        rows = slice(heads.start * head_dim, heads.stop * head_dim)
        if e.kind == "in_heads":
            x = ckpt.read(name, (rows, idx[0])).T  # [d, n*h]
            return x.reshape(x.shape[0], -1, head_dim)[:, :, idx[2]]
        x = ckpt.read(name, (idx[2], rows)).T  # [n*h, d]
        return x.reshape(-1, head_dim, x.shape[1])[:, idx[1], :]
    experts = range(idx[0].start, idx[0].stop)
    if e.kind == "experts":
        return np.stack([ckpt.read(_hf_name(e, layer, j), idx[:0:-1]).T for j in experts])
    rows = slice(e.offset + idx[2].start, e.offset + idx[2].stop)  # "fused"
    return ckpt.read(name, (idx[0], rows, idx[1])).transpose(0, 2, 1)


def _reader(ckpt: HFCheckpoint, e: _Entry, shape, dtype) -> Callable[[tuple], np.ndarray]:
    def read(index: tuple) -> np.ndarray:
        idx = tuple(_range(s, n) for s, n in zip(index, shape, strict=True))
        if not e.per_layer:
            return _read_layer(ckpt, e, 0, idx, shape).astype(dtype)
        layers = range(idx[0].start, idx[0].stop)
        parts = [_read_layer(ckpt, e, i, idx[1:], shape[1:]) for i in layers]
        return np.stack(parts).astype(dtype)

    return read


def _check_names(ckpt: HFCheckpoint, entries: list[_Entry], cfg: ModelConfig, shapes) -> None:
    """Fails before reading anything if names or shapes differ from what `cfg` expects."""
    expected: dict[str, tuple[int, ...]] = {}
    for e in entries:
        shape = tuple(_get(shapes, e.path).shape)
        layers = range(cfg.num_layers) if e.per_layer else [0]
        per = shape[1:] if e.per_layer else shape
        for i in layers:
            if e.kind == "experts":
                for j in range(cfg.num_experts):
                    expected[_hf_name(e, i, j)] = _hf_shape(e, per)
            elif e.kind == "fused":
                expected.setdefault(_hf_name(e, i), ())  # checked below by row count
            else:
                expected[_hf_name(e, i)] = _hf_shape(e, per)
    names = ckpt.names()
    missing = sorted(set(expected) - names)
    unused = sorted(n for n in names - set(expected) if not n.endswith(_IGNORED_SUFFIXES))
    if cfg.tie_embeddings:
        unused = [n for n in unused if n != "lm_head.weight"]  # tied copy, when saved
    wrong = [
        f"{n}: {ckpt.shape(n)} != {s}"
        for n, s in expected.items()
        if n in names and s and ckpt.shape(n) != s
    ]
    if missing or unused or wrong:
        raise ValueError(
            f"Checkpoint {ckpt.path} does not match the model config: missing {missing[:8]} "
            f"({len(missing)}), unexpected {unused[:8]} ({len(unused)}), wrong shapes {wrong[:8]}"
        )


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def load_hf_checkpoint(
    path: str,
    config: ModelConfig | None = None,
    *,
    mesh: Mesh | None = None,
    rules: sharding_lib.Rules | None = None,
    **config_overrides: Any,
) -> tuple[dict[str, Any], ModelConfig]:
    """Imports a Hugging Face Qwen3 / Qwen3-MoE safetensors checkpoint directory.

    Args:
      path: directory with `config.json` and `model.safetensors` or a sharded index.
      config: the model config; by default built from `config.json` (+ `config_overrides`,
        e.g. `param_dtype="bfloat16", dtype="bfloat16", remat_policy="full"`).
      mesh, rules: when given, params are created with the shardings these rules give each
        param's logical axes, each device reading only its own slice.
    Returns:
      (params, config): params in `config.param_dtype`, as the tree `Transformer` uses.
    """
    with HFCheckpoint(path) as ckpt:
        if config is None:
            config = model_config_from_hf(ckpt.config(), **config_overrides)
        return _load(ckpt, config, mesh, rules), config


def params_from_tensors(tensors: Mapping[str, Any], config: ModelConfig) -> dict[str, Any]:
    """The params (host arrays in `config.param_dtype`) of HF-named tensors in memory, e.g. a
    transformers model's `state_dict()` as numpy: the import of `load_hf_checkpoint` (dense or
    MoE, per-expert or fused expert tensors), the inverse of `params_to_hf`."""
    return _load(_Tensors(tensors), config, None, None)


def _load(ckpt: Any, config: ModelConfig, mesh: Mesh | None, rules: Any) -> dict[str, Any]:
    """The params read from `ckpt` (an `HFCheckpoint` or `_Tensors`); see load_hf_checkpoint."""
    fused = config.is_moe and "model.layers.0.mlp.experts.gate_up_proj" in ckpt.names()
    entries = _entries(config, fused_experts=fused)
    model = Transformer(config)
    boxed = tracing.eval_shape(
        lambda key: model.init(key, jnp.zeros((1, 1), jnp.int32))["params"], jax.random.key(0)
    )
    shapes = jax.tree.map(
        lambda x: x.value if hasattr(x, "value") else x,
        boxed,
        is_leaf=lambda x: hasattr(x, "value"),
    )
    shardings = None
    if mesh is not None:
        if rules is None:
            raise ValueError("Pass the logical axis rules together with the mesh")
        shardings = sharding_lib.logical_to_shardings(boxed, mesh, rules)
    _check_names(ckpt, entries, config, shapes)
    params: dict[str, Any] = {}
    for e in entries:
        leaf = _get(shapes, e.path)
        read = _reader(ckpt, e, tuple(leaf.shape), np.dtype(leaf.dtype))
        if shardings is None:
            value = read(tuple(slice(None) for _ in leaf.shape))
        else:
            value = jax.make_array_from_callback(  # dtype: for a process with no device of it
                leaf.shape, _get(shardings, e.path), _cached(read), dtype=np.dtype(leaf.dtype)
            )
        _set(params, e.path, value)
    return params


def _cached(read: Callable[[tuple], np.ndarray]) -> Callable[[tuple], np.ndarray]:
    """Replicated slices are read once, not once per device holding them."""
    cache: dict[tuple, np.ndarray] = {}

    def fn(index: tuple) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in cache:
            cache[key] = read(index)
        return cache[key]

    return fn


# ----------------------------------------------------------------------------- writing


def _to_host(x: Any) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils  # noqa: PLC0415 (multi-host only)

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def hf_tensors(
    params: Mapping[str, Any], config: ModelConfig, dtype: Any = None
) -> Iterator[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]:
    """Yields (HF name, shape, thunk -> numpy array) in checkpoint order, lazily.

    A thunk materialises one HF tensor from one layer of the stacked params (the layer is
    fetched to host once and reused by the following thunks of that param). Call the thunks
    in order, on every process when params span hosts.
    """
    last: dict[str, Any] = {"key": None, "value": None}

    def layer(e: _Entry, i: int | None) -> np.ndarray:
        if last["key"] != (e.path, i):
            leaf = _get(params, e.path)
            value = _to_host(leaf[i] if i is not None else leaf)
            last.update(key=(e.path, i), value=value.astype(dtype or value.dtype))
        return last["value"]

    def convert(e: _Entry, x: np.ndarray) -> np.ndarray:
        if e.kind == "plain":
            return x
        if e.kind == "T":
            return x.T
        if e.kind == "in_heads":
            return x.reshape(x.shape[0], -1).T
        return x.reshape(-1, x.shape[-1]).T  # out_heads

    entries = _entries(config)
    for e in (e for e in entries if not e.per_layer and e.path != ("final_norm", "scale")):
        shape = _hf_shape(e, tuple(_get(params, e.path).shape))
        yield e.hf, shape, lambda e=e: np.ascontiguousarray(convert(e, layer(e, None)))
    for i in range(config.num_layers):
        for e in (e for e in entries if e.per_layer):
            per = tuple(_get(params, e.path).shape[1:])
            if e.kind == "experts":
                for j in range(per[0]):
                    yield (
                        _hf_name(e, i, j),
                        _hf_shape(e, per),
                        lambda e=e, i=i, j=j: np.ascontiguousarray(layer(e, i)[j].T),
                    )
            else:
                yield (
                    _hf_name(e, i),
                    _hf_shape(e, per),
                    lambda e=e, i=i: np.ascontiguousarray(convert(e, layer(e, i))),
                )
    e = next(e for e in entries if e.path == ("final_norm", "scale"))
    yield e.hf, tuple(_get(params, e.path).shape), lambda: layer(e, None)


def params_to_hf(params: Mapping[str, Any], config: ModelConfig) -> dict[str, np.ndarray]:
    """{HF name: numpy array} of `params` (dense or MoE; `hf_tensors` materialised): the
    inverse of `params_from_tensors`."""
    return {name: get() for name, _, get in hf_tensors(params, config)}


def save_hf_checkpoint(
    path: str,
    params: Mapping[str, Any],
    config: ModelConfig,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
    base_hf_config: Mapping[str, Any] | None = None,
) -> list[str]:
    """Exports params as a Hugging Face checkpoint directory (safetensors + config.json).

    Writes `model.safetensors` when everything fits in `max_shard_bytes`, else
    `model-0000i-of-0000n.safetensors` shards plus `model.safetensors.index.json`. Only one
    shard is in host memory at a time. Every process must call this (params may span
    hosts); only process 0 writes.

    Args:
      path: output directory (created).
      params, config: the model.
      dtype: numpy dtype name to store (e.g. "bfloat16"); default = the params' dtype.
      max_shard_bytes: size limit of one safetensors file.
      base_hf_config: a `config.json` dict whose non-architecture keys are kept.
    Returns:
      The written file names.
    """
    np_dtype = np.dtype(jnp.dtype(dtype)) if dtype else None
    tensors = list(hf_tensors(params, config, np_dtype))
    leaf_dtype = np.dtype(jax.tree.leaves(params)[0].dtype)
    itemsize = (np_dtype or leaf_dtype).itemsize
    shards: list[list[tuple[str, tuple[int, ...], Callable]]] = [[]]
    size = 0
    for t in tensors:
        nbytes = int(np.prod(t[1])) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    writer = jax.process_index() == 0
    if writer:
        os.makedirs(path, exist_ok=True)
    files = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map, total = {}, 0
    for fname, shard in zip(files, shards, strict=True):
        arrays = {name: thunk() for name, _, thunk in shard}
        for name, a in arrays.items():
            weight_map[name] = fname
            total += a.nbytes
        if writer:
            save_file(arrays, os.path.join(path, fname), metadata={"format": "pt"})
        del arrays
    if writer:
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            with open(os.path.join(path, INDEX_FILE), "w") as f:
                json.dump(index, f, indent=2)
        hf_config = model_config_to_hf(config, base_hf_config)
        if dtype:
            hf_config["dtype"] = dtype
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
    return files + ([INDEX_FILE] if len(shards) > 1 else []) + ["config.json"]
