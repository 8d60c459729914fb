"""Test-wide JAX settings: CPU, 8 simulated devices, strict rank promotion, persistent cache."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
_cache = os.environ.get(
    "TG_JAX_COMPILATION_CACHE", os.path.join(os.path.dirname(__file__), "..", ".jax_cache")
)
jax.config.update("jax_compilation_cache_dir", os.path.abspath(_cache))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
