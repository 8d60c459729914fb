"""Environments: strings in, strings out.

base.py (Environment API, requirements, episode summary), sandbox.py (running model-written
Python), tasks.py (hidden-function tasks and splits), protocol.py (turn syntax, requirement
checkers, hint texts), coding.py (the coding environment), hints.py (imperfect feedback),
transcripts.py (synthetic expert transcripts for SFT), swe/ (the software-engineering
environment: repositories, file tools, real tests).

`make_env(config.env)` (or `env_factory`) builds the environment `config.env.kind` names
("coding" or "swe"); `decode_task(record)` turns a stored task record of either kind into its
task.
"""

from collections.abc import Callable
from typing import Any

ENV_KINDS = ("coding", "swe")


def env_kind(env_config: Any) -> str:
    """`env_config.kind` ("coding" when the config predates the field)."""
    kind = env_config.get("kind", "coding") if hasattr(env_config, "get") else "coding"
    if kind not in ENV_KINDS:
        raise ValueError(f"env.kind must be one of {ENV_KINDS}, got {kind!r}")
    return kind


def env_factory(env_config: Any, tool_format: Any = None) -> Callable[[], Any]:
    """A zero-argument factory of fresh environments of `env_config.kind` (config.env is read
    and validated once, here) that read the model's tool calls in `tool_format` (a
    `tg_jax.text.tool_formats.ToolFormat`, the renderer's; None: Hermes)."""
    from tg_jax.text.tool_formats import HERMES

    fmt = tool_format or HERMES
    if env_kind(env_config) == "swe":
        from tg_jax.envs.swe.env import SweEnv, swe_env_config

        swe_cfg = swe_env_config(env_config)
        return lambda: SweEnv(swe_cfg, tool_format=fmt)
    from tg_jax.envs.coding import CodingEnv, coding_env_config

    coding_cfg = coding_env_config(env_config)
    return lambda: CodingEnv(coding_cfg, tool_format=fmt)


def make_env(env_config: Any, tool_format: Any = None) -> Any:
    """A fresh environment of `env_config.kind` configured by `env_config` (config.env)."""
    return env_factory(env_config, tool_format)()


def decode_task(record: dict) -> Any:
    """The task of a stored record: a SweTask for `"kind": "swe"` records, else a coding Task."""
    if isinstance(record, dict) and record.get("kind") == "swe":
        from tg_jax.envs.swe.task import SweTask

        return SweTask.from_record(record)
    from tg_jax.envs.tasks import Task

    return Task.from_record(record)
