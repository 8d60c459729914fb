"""Reading configs: a config file's `get_config`, and dotted-key overrides with clear errors.

The one reader of config files and overrides for the command line (tg_jax/main.py), the
pipeline's stage configs, notebooks and tests; it imports no package of tg_jax, so any of them
may use it (the config sections and their builders: tg_jax/config_lib.py).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from typing import Any

import ml_collections


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


def unknown_field(cfg: ml_collections.ConfigDict, key: str) -> str | None:
    """Why dotted `key` names no field of `cfg` (one line, with close matches), or None."""
    parts = key.split(".")
    node: Any = cfg
    for i, part in enumerate(parts):
        if not isinstance(node, ml_collections.ConfigDict):
            return f"unknown config field {key} ({'.'.join(parts[:i])} is not a section)"
        if part not in node:
            where = ".".join(parts[:i]) or "config"
            known = sorted(node.keys())
            close = difflib.get_close_matches(part, known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            return f"unknown config field {key} ({where} has: {', '.join(known)}{hint})"
        node = node[part]
    return None


def parse_error(cfg: ml_collections.ConfigDict, key: str, text: str) -> str | None:
    """Why the command-line text `text` is not a value of field `key`, or None.

    Checks the scalar types absl's `--config.a.b=v` parses (float, int, bool); other fields
    are left to ml_collections' own parser.
    """
    node: Any = cfg
    for part in key.split("."):
        node = node[part]
    kind = type(node)
    if kind is bool:
        ok = text.lower() in ("true", "false", "1", "0")
    elif kind in (int, float):
        try:
            kind(text)
            ok = True
        except ValueError:
            ok = False
    else:
        return None
    return None if ok else f"expected {kind.__name__}, got {text!r}"


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: dict[str, Any]):
    """Returns a copy with dotted-key overrides applied; unknown keys / wrong types raise.

    For notebooks and tests; on the command line absl's `--config.a.b=v` does the same.
    """
    new = ml_collections.ConfigDict(cfg.to_dict(), type_safe=True)
    new.lock()
    for key, value in overrides.items():
        if (why := unknown_field(new, key)) is not None:
            raise KeyError(why)
        *path, leaf = key.split(".")
        node = new
        for part in path:
            node = node[part]
        try:
            node[leaf] = value
        except TypeError as e:
            raise TypeError(f"Config key {key!r}: {e}") from None
    return new
