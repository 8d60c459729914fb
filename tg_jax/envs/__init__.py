"""Environments: strings in, strings out.

base.py (Environment API, requirements, episode summary), sandbox.py (running model-written
Python), tasks.py (hidden-function tasks and splits), protocol.py (turn syntax, requirement
checkers, hint texts), coding.py (the coding environment), hints.py (imperfect feedback),
transcripts.py (synthetic expert transcripts for SFT), swe/ (the software-engineering
environment: repositories, file tools, real tests), plugins.py (a team's own requirements and
environments, named by import path).

`make_env(config.env)` (or `env_factory`) builds the environment `config.env.kind` names
("coding", "swe", or a plug-in "module:Class"); `decode_task(record)` turns a stored task
record of any kind into its task; `requirement_names(config.env)` are the names its
requirements report under.
"""

from collections.abc import Callable
from typing import Any

from tg_jax.envs.base import Environment, Requirement
from tg_jax.envs.plugins import PLUGIN_TASK_KIND, PluginError, environment_class, is_plugin

ENV_KINDS = ("coding", "swe")

__all__ = [
    "ENV_KINDS",
    "Environment",
    "PluginError",
    "Requirement",
    "decode_task",
    "env_factory",
    "env_kind",
    "make_env",
    "requirement_names",
]


def env_kind(env_config: Any) -> str:
    """`env_config.kind` ("coding" when the config predates the field): "coding", "swe", or a
    plug-in's import path (checked to load)."""
    kind = env_config.get("kind", "coding") if hasattr(env_config, "get") else "coding"
    if is_plugin(kind):
        environment_class(kind)
        return str(kind)
    if kind not in ENV_KINDS:
        raise ValueError(
            f"env.kind must be one of {ENV_KINDS} or an Environment plug-in "
            f"('module:Class', tg_jax.envs.plugins), got {kind!r}"
        )
    return kind


def env_factory(env_config: Any, tool_format: Any = None) -> Callable[[], Any]:
    """A zero-argument factory of fresh environments of `env_config.kind` (config.env is read
    and validated once, here) that read the model's tool calls in `tool_format` (a
    `tg_jax.text.tool_formats.ToolFormat`, the renderer's; None: Hermes)."""
    from tg_jax.text.tool_formats import HERMES

    fmt = tool_format or HERMES
    kind = env_kind(env_config)
    if is_plugin(kind):
        cls = environment_class(kind)
        return lambda: cls(env_config, tool_format=fmt)
    if kind == "swe":
        from tg_jax.envs.swe.env import SweEnv, swe_env_config

        swe_cfg = swe_env_config(env_config)
        return lambda: SweEnv(swe_cfg, tool_format=fmt)
    from tg_jax.envs.coding import CodingEnv, coding_env_config

    coding_cfg = coding_env_config(env_config)
    return lambda: CodingEnv(coding_cfg, tool_format=fmt)


def make_env(env_config: Any, tool_format: Any = None) -> Any:
    """A fresh environment of `env_config.kind` configured by `env_config` (config.env)."""
    return env_factory(env_config, tool_format)()


def requirement_names(env_config: Any) -> tuple[str, ...]:
    """The names of `config.env`'s requirements, in order, as rewards, metrics and the report
    name them (a plug-in's `Requirement.name`, not its import path): the environment's own."""
    specs = tuple(str(s) for s in env_config.get("requirements", ()))
    if not any(is_plugin(s) for s in specs):
        return specs
    return tuple(r.name for r in make_env(env_config).requirements)


def decode_task(record: dict) -> Any:
    """The task of a stored record: a SweTask for `"kind": "swe"` records, the record itself
    for a plug-in environment's (`"kind": "plugin"`), else a coding Task."""
    if isinstance(record, dict) and record.get("kind") == "swe":
        from tg_jax.envs.swe.task import SweTask

        return SweTask.from_record(record)
    if isinstance(record, dict) and record.get("kind") == PLUGIN_TASK_KIND:
        if "task_id" not in record:
            raise ValueError(f"a plug-in environment's task record has no 'task_id': {record}")
        return record
    from tg_jax.envs.tasks import Task

    return Task.from_record(record)
