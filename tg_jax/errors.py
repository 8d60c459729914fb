"""What ends a command with one `error:` line (`tg_jax.cli.exit_on_error`, the one place that
prints them): a usage error (exit status 2), an invalid config (2), a failed self-test before
an RL run's first step (2), a run stopped by a fault it cannot go past (4, with what happened
and what was kept)."""

from __future__ import annotations


class UsageError(ValueError):
    """A command line that cannot run (a workdir that is a file, an unknown stage): printed as
    `error: ` and the message, exit status 2, before any compute."""

    prefix = ""


class ConfigError(UsageError):
    """A config that cannot run, found at start-up (`tg_jax.config_lib.check`) or once the data
    is known (e.g. `rl_loop.epochs` against the train tasks): printed as one `error: invalid
    config:` line (exit 2)."""

    prefix = "invalid config: "


class SelfTestError(UsageError):
    """A self-test before an RL run's first step (`tg_jax.train.self_tests`, on with
    `rl_loop.self_tests`) found the trainer's log-probs off beyond tolerance: one `error:
    self-test failed:` line naming the check, its figures and the field that turns the
    self-tests off (exit 2), before any step is trained."""

    prefix = "self-test failed: "


class RunError(RuntimeError):
    """A run stopped by a fault (non-finite steps, a removed workdir, ...); the message says
    what happened and which checkpoint a rerun resumes from."""
