"""A Hugging Face checkpoint directory as tg_jax's model, in and out.

    md = open_model_dir("gs://bucket/Qwen3-1.7B")      # or a local directory
    config = resolve_config(config, md)                 # architecture fields from config.json
    params = md.load_params(ModelConfig.from_config(config.model), mesh=mesh, rules=rules)
    ... train ...
    export_model_dir(out_dir, params, model_cfg, md)    # loadable by transformers

Files of a directory (as transformers' `save_pretrained` writes them):

    config.json                 architecture (Qwen3 / Qwen3-MoE; `hf_io.model_config_from_hf`)
    model.safetensors           weights, or model-*.safetensors + model.safetensors.index.json
    tokenizer.json              the tokenizer (HF `tokenizers`)
    tokenizer_config.json       eos / pad tokens; `chat_template` when there is no .jinja file
    chat_template.jinja         the chat template (preferred over tokenizer_config's)
    generation_config.json      optional: `eos_token_id` (int or list), checked against the
                                chat format's end-of-turn ids

The directory's chat template renders every conversation of a run (`tg_jax.text.ChatRenderer`,
append-only token-in/token-out), its tool-call format is detected from what it writes (or named
by `model.tool_format`), and generation_config's eos ids end sampled turns. A template that
cannot serve a rollout (it fails, is not append-only where a rollout appends, or writes tool
calls no registered format reads) is refused at start-up with the conversation and the first
difference (`tg_jax.text.check_chat_template`). A missing or inconsistent file raises
`ModelDirError` naming the file and field.

Remote directories (`gs://...`) are staged once to a local cache (`TG_JAX_HF_CACHE`, default
~/.cache/tg_jax/hf) because safetensors reads each device's slice from a local memory map.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from etils import epath

from tg_jax.models import checkpoint_io
from tg_jax.models.config import ModelConfig
from tg_jax.models.hf_io import model_config_from_hf

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
# Copied next to exported weights (when the source has them).
TOKENIZER_FILES = (
    TOKENIZER_FILE,
    TOKENIZER_CONFIG_FILE,
    TEMPLATE_FILE,
    GENERATION_CONFIG_FILE,
    "special_tokens_map.json",
)
# ModelConfig fields that come from config.json; the rest (dtypes, remat, context length,
# attention blocking, router loss weight) are run settings taken from the tg_jax config.
ARCHITECTURE_FIELDS = (
    "vocab_size",
    "d_model",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "mlp_dim",
    "rope_theta",
    "rms_norm_eps",
    "tie_embeddings",
    "num_experts",
    "experts_per_token",
    "moe_mlp_dim",
    "norm_topk_prob",
)


class ModelDirError(ValueError):
    """A checkpoint directory that cannot be used (missing file, bad field, mismatch)."""


def _is_url(path: str) -> bool:
    return "://" in str(path)


def stage_locally(path: str) -> str:
    """A local directory with the files of `path` (itself when already local)."""
    if not _is_url(path):
        return os.path.abspath(path)
    root = epath.Path(os.environ.get("TG_JAX_HF_CACHE", "~/.cache/tg_jax/hf")).expanduser()
    local = root / hashlib.sha256(str(path).encode()).hexdigest()[:16]
    done = local / ".staged"
    if not done.exists():
        local.mkdir(parents=True, exist_ok=True)
        for f in epath.Path(path).iterdir():
            if f.is_file():
                f.copy(local / f.name, overwrite=True)
        done.write_text(str(path))
    return os.fspath(local)


def _read_json(directory: str, name: str, *, required: bool) -> dict[str, Any] | None:
    p = os.path.join(directory, name)
    if not os.path.exists(p):
        if required:
            raise ModelDirError(f"{p}: missing (a Hugging Face checkpoint directory has {name})")
        return None
    try:
        with open(p, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ModelDirError(f"{p}: not valid JSON ({e})") from e


def _eos_ids(gen: Mapping[str, Any] | None) -> tuple[int, ...]:
    if not gen or gen.get("eos_token_id") is None:
        return ()
    eos = gen["eos_token_id"]
    return tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]))


@dataclasses.dataclass(frozen=True)
class ModelDir:
    """An opened checkpoint directory.

    Attributes:
      path: as given (may be a URL); local_path: where the files are read from.
      hf_config: config.json.
      architecture: the ModelConfig of config.json (run settings at their defaults).
      tokenizer: `tg_jax.text.HFTokenizer` of tokenizer.json (vocab_size = config.json's).
      renderer: the `ChatRenderer` of that tokenizer and chat template.
      chat_template: the template text.
      stop_ids: generation_config.json's eos ids ((), when the file has none).
    """

    path: str
    local_path: str
    hf_config: dict[str, Any]
    architecture: ModelConfig
    tokenizer: Any
    renderer: Any
    chat_template: str
    stop_ids: tuple[int, ...]

    def load_params(self, cfg: ModelConfig, *, mesh=None, rules=None) -> Any:
        """The weights as `cfg`'s params, each device reading only its own slice."""
        params, _ = checkpoint_io.load_hf_checkpoint(self.local_path, cfg, mesh=mesh, rules=rules)
        return params


def open_model_dir(
    path: str, *, hint_role: str = "user", tool_format: str = "", check_template: bool = True
) -> ModelDir:
    """Opens a checkpoint directory; raises `ModelDirError` on any unusable file (see module).

    Args:
      path: the directory (local or a URL).
      hint_role: the chat role hints are rendered as.
      tool_format: a registered tool-call format; "" detects it from the template.
      check_template: replay the rollout shapes through the template (`check_chat_template`).
    """
    from tg_jax.text import (  # noqa: PLC0415
        ChatRenderer,
        HFTokenizer,
        TemplateError,
        check_chat_template,  # noqa: PLC0415 (text imports models)
    )

    local = stage_locally(str(path))
    if not os.path.isdir(local):
        raise ModelDirError(f"model.hf_checkpoint {path}: not a directory")
    hf = _read_json(local, CONFIG_FILE, required=True)
    try:
        arch = model_config_from_hf(hf)
    except KeyError as e:
        raise ModelDirError(f"{local}/{CONFIG_FILE}: missing field {e}") from e
    except (NotImplementedError, ValueError) as e:
        raise ModelDirError(f"{local}/{CONFIG_FILE}: {e}") from e
    if not os.path.exists(os.path.join(local, TOKENIZER_FILE)):
        raise ModelDirError(f"{local}/{TOKENIZER_FILE}: missing (the tokenizer)")
    _read_json(local, TOKENIZER_CONFIG_FILE, required=False)  # valid JSON, when present
    try:
        tokenizer = HFTokenizer.from_dir(local, vocab_size=arch.vocab_size)
    except (KeyError, ValueError) as e:
        raise ModelDirError(f"{local}/{TOKENIZER_FILE} / {TOKENIZER_CONFIG_FILE}: {e}") from e
    template = tokenizer.chat_template
    where = (
        TEMPLATE_FILE
        if os.path.exists(os.path.join(local, TEMPLATE_FILE))
        else (f"{TOKENIZER_CONFIG_FILE}:chat_template")
    )
    if not template:
        raise ModelDirError(
            f"{local}: no chat template ({TEMPLATE_FILE}, or `chat_template` in "
            f"{TOKENIZER_CONFIG_FILE})"
        )
    stop_ids = _eos_ids(_read_json(local, GENERATION_CONFIG_FILE, required=False))
    unknown = [i for i in stop_ids if not 0 <= i < arch.vocab_size]
    if unknown:
        raise ModelDirError(
            f"{local}/{GENERATION_CONFIG_FILE}: eos_token_id {unknown} outside the vocabulary "
            f"({arch.vocab_size} ids)"
        )
    try:
        renderer = ChatRenderer(
            tokenizer,
            template,
            hint_role=hint_role,
            tool_format=tool_format or None,
            stop_ids=stop_ids,
        )
        if check_template:
            check_chat_template(renderer)
    except TemplateError as e:
        raise ModelDirError(f"{local}/{where}: {e}") from e
    except ValueError as e:  # an unknown model.tool_format
        raise ModelDirError(f"model.tool_format: {e}") from e
    return ModelDir(str(path), local, hf, arch, tokenizer, renderer, template, stop_ids)


def fingerprint(path: str) -> str:
    """ "sha256:..." of a checkpoint directory's contents: its small files (config, tokenizer,
    template, index) whole, each weight file by name, size and safetensors header (tensor
    names, dtypes, shapes, offsets). The same model wherever its copy lies."""
    local = stage_locally(str(path))
    h = hashlib.sha256()
    for name in sorted(os.listdir(local)):
        p = os.path.join(local, name)
        if not os.path.isfile(p) or name.startswith("."):
            continue
        h.update(name.encode() + b"\0")
        with open(p, "rb") as f:
            if name.endswith(".safetensors"):
                head = f.read(8)
                header = f.read(int.from_bytes(head, "little")) if len(head) == 8 else b""
                h.update(str(os.path.getsize(p)).encode() + head + header)
            else:
                h.update(f.read())
    return "sha256:" + h.hexdigest()


def resolve_model_section(model: Any, md: ModelDir) -> dict[str, Any]:
    """config.model's fields with the architecture of `md` filled in, as a plain dict.

    An architecture field the config sets (not None) must equal config.json's; the context
    length (`max_seq_len`) may not exceed config.json's `max_position_embeddings`, and defaults
    to it.
    """
    fields = dict(model.to_dict() if hasattr(model, "to_dict") else model)
    arch = dataclasses.asdict(md.architecture)
    for name in ARCHITECTURE_FIELDS:
        given = fields.get(name)
        if given is not None and given != arch[name]:
            raise ModelDirError(
                f"model.{name} = {given!r}, but {md.path}/{CONFIG_FILE} says {arch[name]!r}: "
                f"drop the override or use a matching checkpoint"
            )
        fields[name] = arch[name]
    limit = arch["max_seq_len"]
    if fields.get("max_seq_len") is None:
        fields["max_seq_len"] = limit
    elif int(fields["max_seq_len"]) > limit:
        raise ModelDirError(
            f"model.max_seq_len {fields['max_seq_len']} > {md.path}/{CONFIG_FILE} "
            f"max_position_embeddings {limit}"
        )
    if fields.get("router_aux_loss_coef") is None:
        fields["router_aux_loss_coef"] = arch["router_aux_loss_coef"]
    return fields


def resolve_config(config: Any, md: ModelDir) -> Any:
    """A copy of `config` whose model section has `md`'s architecture (see
    `resolve_model_section`) and `model.hf_checkpoint` = md.path."""
    from tg_jax import config_files  # noqa: PLC0415 (config_lib imports envs)

    fields = resolve_model_section(config.model, md)
    fields["hf_checkpoint"] = md.path
    return config_files.apply_overrides(config, {f"model.{k}": v for k, v in fields.items()})


def copy_dir(src: str, dst: str) -> None:
    """Copies the files of local directory `src` to `dst` (local or URL), config.json last:
    a directory with a config.json is complete."""
    target = epath.Path(dst)
    target.mkdir(parents=True, exist_ok=True)
    names = sorted(os.listdir(src), key=lambda n: n == CONFIG_FILE)
    for name in names:
        epath.Path(os.path.join(src, name)).copy(target / name, overwrite=True)


def export_model_dir(
    out_dir: str,
    params: Any,
    cfg: ModelConfig,
    source: ModelDir | None = None,
    *,
    dtype: str | None = None,
) -> None:
    """Writes `params` as a checkpoint directory at `out_dir` (local or URL), with the
    tokenizer, template and generation files of `source` copied; config.json is written last
    (its presence marks a complete export). Every process calls it (params may span hosts);
    process 0 writes."""
    import jax  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="tg_export_") as tmp:
        if source is not None and jax.process_index() == 0:
            for name in TOKENIZER_FILES:
                src = os.path.join(source.local_path, name)
                if os.path.exists(src):
                    epath.Path(src).copy(epath.Path(tmp) / name, overwrite=True)
        checkpoint_io.save_hf_checkpoint(
            tmp, params, cfg, dtype=dtype, base_hf_config=source.hf_config if source else None
        )
        if jax.process_index() == 0:
            copy_dir(tmp, out_dir)
