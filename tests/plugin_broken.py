"""A plug-in module whose import fails inside it (tests of tg_jax.envs.plugins)."""

import a_module_that_is_not_installed_xyz  # noqa: F401
