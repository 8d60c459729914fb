"""Config sections declared once: a frozen dataclass per section is the only declaration.

Each field of a section is written once, in its dataclass, with its default, a docstring and
the section's checks (`__post_init__`). The command line's `ml_collections.ConfigDict` of the
section is generated from it (`Section.config_dict`, what `tg_jax.config_lib` builds configs
from) and read back into it (`Section.from_config`, once, at the boundary: jitted code reads
plain Python values). Two field kinds differ between the two forms:

  * `off(...)`: an optional number whose "off" is None in the dataclass and 0 (or another
    plain value) on the command line (`--config.rl.tis_cap=0`);
  * `pairs(...)`: (name, value) pairs in the dataclass (hashable, frozen), a nested
    ConfigDict on the command line (`--config.rl.reward_weights.task=1.0`).

A nested dataclass field is a nested ConfigDict; anything else is the same value in both.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar

import ml_collections

_OFF, _PAIRS = "tg_jax.off", "tg_jax.pairs"


def off(default: Any = None, value: Any = 0) -> Any:
    """A field that is None when off, written `value` (0, of the field's type) in the
    ConfigDict."""
    return dataclasses.field(default=default, metadata={_OFF: value})


def pairs(default: tuple[tuple[str, Any], ...]) -> Any:
    """(name, value) pairs, a nested ConfigDict {name: value} on the command line."""
    return dataclasses.field(default=default, metadata={_PAIRS: True})


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _base(tp: Any) -> Any:
    """`float | None` -> float; other types as they are."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def _optional(f: dataclasses.Field, hints: dict[str, Any]) -> bool:
    """Whether None is a value of field `f` (an `off` field, or a `... | None` type)."""
    tp = hints[f.name]
    if _OFF in f.metadata:
        return True
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in (
        typing.get_args(tp)
    )


def _cast(tp: Any, value: Any, where: str) -> Any:
    tp = _base(tp)
    origin = typing.get_origin(tp) or tp
    try:
        if origin is bool:
            if not isinstance(value, (bool, int)):
                raise TypeError(f"not a bool: {value!r}")
            return bool(value)
        if origin in (int, float, str):
            return origin(value)
        if origin is tuple:
            return tuple(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    return value


def config_dict(section: Any, **overrides: Any) -> ml_collections.ConfigDict:
    """The ConfigDict of a section's dataclass instance, then `overrides` (ConfigDict.update)."""
    c = ml_collections.ConfigDict()
    hints = _hints(type(section))
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            value = config_dict(value)
        elif _OFF in f.metadata and value is None:  # of the field's type (0.0 for a float)
            value = _cast(hints[f.name], f.metadata[_OFF], f.name)
        elif f.metadata.get(_PAIRS):
            value = ml_collections.ConfigDict(dict(value))
        setattr(c, f.name, value)
    c.update(overrides)
    return c


def from_config(cls: type, section: Any, name: str, *, strict: bool = True) -> Any:
    """A `cls` instance from a ConfigDict (or mapping) section named `name`; missing fields
    take the dataclass defaults; with `strict` a key `cls` does not declare is an error."""
    if isinstance(section, cls):
        return section
    values = dict(section.items()) if hasattr(section, "items") else dict(section)
    hints = _hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    extra = sorted(set(values) - set(known) - set(getattr(cls, "ignored", ())))
    if strict and extra:
        raise ValueError(f"{name} has unknown fields {extra} ({cls.__name__} has {sorted(known)})")
    unset = [k for k, f in known.items() if values.get(k, 0) is None and not _optional(f, hints)]
    if unset:
        hint = getattr(cls, "unset_hint", "")
        raise ValueError(f"{name} config fields {unset} are unset" + (f": {hint}" if hint else ""))
    kwargs = {}
    for key, f in known.items():
        if key not in values:
            continue
        value, where, tp = values[key], f"{name}.{key}", hints[key]
        if dataclasses.is_dataclass(_base(tp)):
            sub = _base(tp)
            value = from_config(sub, value, getattr(sub, "section", "") or where)
        elif _OFF in f.metadata and (value is None or value == f.metadata[_OFF]):
            value = None
        elif f.metadata.get(_PAIRS):
            if not isinstance(value, Mapping) and not hasattr(value, "items"):
                value = dict(value)
            (_, value_tp) = typing.get_args(typing.get_args(tp)[0])
            value = tuple((str(k), _cast(value_tp, v, f"{where}.{k}")) for k, v in value.items())
        elif value is not None:
            value = _cast(tp, value, where)
        kwargs[key] = value
    return cls(**kwargs)


class Section:
    """Mixin of a config section's frozen dataclass: `from_config` and `config_dict`.

    Attributes:
      section: the section's name in the run config (for messages: "rl", "tg.schedule").
      strict: whether a key the dataclass does not declare is an error.
      ignored: keys of the section that are not the dataclass's (read elsewhere).
      unset_hint: what an error about unset (None) fields adds: where their values come from.
    """

    section: ClassVar[str] = ""
    strict: ClassVar[bool] = True
    ignored: ClassVar[tuple[str, ...]] = ()
    unset_hint: ClassVar[str] = ""

    @classmethod
    def from_config(cls, cfg: Any) -> Any:
        """From the section's ConfigDict (an instance passes through)."""
        return from_config(cls, cfg, cls.section or cls.__name__, strict=cls.strict)

    @classmethod
    def config_dict(cls, **overrides: Any) -> ml_collections.ConfigDict:
        """The section's ConfigDict with the defaults, then `overrides`."""
        return config_dict(cls(), **overrides)


__all__ = ["Section", "config_dict", "from_config", "off", "pairs"]
