"""Errors that end a run on a fault it cannot go past: `tg_jax.main` prints them as one
`error:` line (exit status 4), with what happened and what was kept."""

from __future__ import annotations


class RunError(RuntimeError):
    """A run stopped by a fault (non-finite steps, a removed workdir, ...); the message says
    what happened and which checkpoint a rerun resumes from."""


class ConfigError(ValueError):
    """A config that cannot run, found once the data is known (e.g. `rl_loop.epochs` against
    the train tasks): `tg_jax.main` prints it as one `error: invalid config:` line (exit 2)."""
