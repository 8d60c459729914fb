"""A team's own requirements and environments, named by import path: no edit inside tg_jax.

A plug-in is named `"package.module:attribute"` wherever a built-in name goes:

    --config.env.requirements='("my_rules:report_in_markdown", "tool_json")'
    --config.env.kind=my_envs:TicketEnv

A requirement plug-in's attribute is a `tg_jax.envs.Requirement`, or a factory called with
the environment's config (the object the environment holds: `CodingEnvConfig`, `SweEnvConfig`
or, for a plug-in environment, `config.env`) that returns one:

    from tg_jax.envs import Requirement

    report_in_markdown = Requirement(
        "report_in_markdown",
        check=lambda turn: turn.lstrip().startswith("#"),
        hint="Reminder: write your answer as a Markdown report with a heading.",
    )

Its `name` (not the import path) is the reward key and the name in metrics and the report.
`env.requirement_weight` replaces its `weight`. A plug-in's checker is not trusted: a
checker that raises, or runs past `Requirement.timeout_s` (default `CHECK_TIMEOUT_S`), leaves
that turn *unjudged* for that requirement (verdict None: neither met nor failed, no hint, no
TG gate), counted per episode in `EpisodeSummary.unjudged` and logged once per requirement;
the rollout metric is `rollout/unjudged/<name>` and the held-out one `unjudged/<name>`. A
`breaks_at` that raises locates nothing. A checker past its timeout keeps running in its
worker thread (Python cannot stop a thread); `_POOL_SIZE` stuck checkers leave every later
check of the process unjudged, each one after its timeout.

An environment plug-in's attribute is a subclass of `tg_jax.envs.Environment`, built as
`cls(config.env, tool_format=fmt)` (fmt: the model's `tg_jax.text.tool_formats.ToolFormat`).
It says what a valid action is by overriding `Environment.valid_action(turn_text)` (default
True: every turn): a requirement met on a turn that is not one earns no reward and counts as
failed (`Environment.begin_turn`), so that the format around junk is never paid.
Its tasks come from a user's task file (`tasks.train_source` / `heldout_source`, fields mapped
by `tasks.fields`: `tg_jax.data.task_files`) or from the class: `cls.generate_tasks(split,
num, seed)` yields JSON-able task records (dicts with a "task_id"); each record is given to
`reset` as the dict. See docs/design.md,
"How to add a requirement, an environment, a task source".

Bad input is a `PluginError` (a `ConfigError`: `tg_jax.main` prints it as one `error:` line
before anything runs) naming the spec and what is wrong: no such module, an import error
inside it, no such attribute, or the wrong type.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from tg_jax.envs.base import Environment, Requirement, Unjudged
from tg_jax.errors import ConfigError

CHECK_TIMEOUT_S = 5.0  # a plug-in checker's time per call when its Requirement sets none
_POOL_SIZE = 8  # worker threads for plug-in checks, shared by the process
PLUGIN_TASK_KIND = "plugin"  # the "kind" of a plug-in environment's task records


class PluginError(ConfigError):
    """A plug-in spec that cannot be loaded or has the wrong type; the message names it."""


def is_plugin(spec: Any) -> bool:
    """Whether a requirement or environment name is an import path ("module:attribute")."""
    return isinstance(spec, str) and ":" in spec


def load_object(spec: str, what: str) -> Any:
    """The attribute `spec` ("package.module:attribute", dots allowed after the colon) names.

    Args:
      spec: the import path.
      what: what the spec is for, for messages (e.g. "env.requirements entry").

    Raises:
      PluginError: a malformed spec, no such module, an error importing it, no such attribute.
    """
    module_name, _, attr = str(spec).partition(":")
    if not module_name or not attr:
        raise PluginError(f"{what} {spec!r}: expected 'package.module:attribute'")
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name or module_name.startswith(f"{e.name}."):
            raise PluginError(
                f"{what} {spec!r}: no module named {e.name!r} (is it installed, or on PYTHONPATH?)"
            ) from e
        raise PluginError(f"{what} {spec!r}: importing {module_name!r} failed: {e}") from e
    except Exception as e:
        raise PluginError(
            f"{what} {spec!r}: importing {module_name!r} raised {type(e).__name__}: {e}"
        ) from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def plugin_requirement(spec: str, env_config: Any, weight: float) -> Requirement:
    """The requirement plug-in `spec` for an environment with config `env_config`, its weight
    set to `weight` and its checkers guarded (see the module docstring)."""
    obj = load_object(spec, "env.requirements entry")
    req = obj
    if not isinstance(obj, Requirement):
        if not callable(obj):
            raise PluginError(
                f"env.requirements entry {spec!r} is a {type(obj).__name__}: expected a "
                "tg_jax.envs.Requirement or a factory taking the environment's config"
            )
        try:
            req = obj(env_config)
        except Exception as e:
            raise PluginError(
                f"env.requirements entry {spec!r}: the factory raised {type(e).__name__}: {e}"
            ) from e
        if not isinstance(req, Requirement):
            raise PluginError(
                f"env.requirements entry {spec!r}: the factory returned a "
                f"{type(req).__name__}, expected a tg_jax.envs.Requirement"
            )
    if not isinstance(req.name, str) or not req.name or ":" in req.name:
        raise PluginError(
            f"env.requirements entry {spec!r}: its name must be a non-empty str without ':', "
            f"got {req.name!r}"
        )
    return guarded(dataclasses.replace(req, weight=float(weight)))


def requirements(
    specs: Any, weight: float, env_config: Any, builtin: Callable[[list[str]], tuple]
) -> tuple[Requirement, ...]:
    """The environment's requirements, in the order of `specs`: built-in names through
    `builtin` (called once with all of them), plug-ins through `plugin_requirement`.

    Raises:
      PluginError: a bad plug-in, or two requirements with one name.
    """
    specs = [str(s) for s in specs]
    built = iter(builtin([s for s in specs if not is_plugin(s)]))
    out = tuple(
        plugin_requirement(s, env_config, weight) if is_plugin(s) else next(built) for s in specs
    )
    names = [r.name for r in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise PluginError(f"env.requirements names requirement(s) {dup} twice: {specs}")
    return out


def builtin_names(specs: Any) -> tuple[str, ...]:
    """The entries of `specs` that are not plug-ins (checked against an environment's own)."""
    return tuple(str(s) for s in specs if not is_plugin(s))


_pool_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_warned: set[str] = set()


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(_POOL_SIZE, "tg_plugin_check")
        return _pool


def _warn_once(name: str, message: str) -> None:
    with _pool_lock:
        first = name not in _warned
        _warned.add(name)
    if first:
        logging.warning("requirement %r: %s (such turns are counted unjudged)", name, message)


def _call(name: str, what: str, fn: Callable[[str], Any], text: str, timeout_s: float) -> Any:
    """fn(text) in a worker thread; raises Unjudged when it raises or runs past timeout_s."""
    future = _executor().submit(fn, text)
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        _warn_once(name, f"its {what} ran past {timeout_s:g} s")
        raise Unjudged(f"{name}: {what} timed out after {timeout_s:g} s") from None
    except Exception as e:  # noqa: BLE001 (a user's checker may raise anything)
        _warn_once(name, f"its {what} raised {type(e).__name__}: {e}")
        raise Unjudged(f"{name}: {what} raised {type(e).__name__}: {e}") from e


def guarded(req: Requirement) -> Requirement:
    """`req` with its check and applies run by `_call` (raise Unjudged on an error or a
    timeout) and its breaks_at locating nothing when it raises."""
    name, timeout_s = req.name, float(req.timeout_s or CHECK_TIMEOUT_S)
    check, applies, breaks_at = req.check, req.applies, req.breaks_at

    def guarded_breaks_at(text: str) -> int | None:
        try:
            off = breaks_at(text)
        except Exception as e:  # noqa: BLE001
            _warn_once(name, f"its breaks_at raised {type(e).__name__}: {e}")
            return None
        return off if isinstance(off, int) and 0 <= off <= len(text) else None

    return dataclasses.replace(
        req,
        check=lambda text: bool(_call(name, "check", check, text, timeout_s)),
        applies=lambda text: bool(_call(name, "applies", applies, text, timeout_s)),
        breaks_at=None if breaks_at is None else guarded_breaks_at,
        timeout_s=timeout_s,
    )


def environment_class(spec: str) -> type[Environment]:
    """The Environment subclass an `env.kind` plug-in names.

    Raises:
      PluginError: not loadable, or not an Environment subclass.
    """
    cls = load_object(spec, "env.kind")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise PluginError(
            f"env.kind {spec!r} is a {type(cls).__name__}: expected a subclass of "
            "tg_jax.envs.Environment"
        )
    return cls
