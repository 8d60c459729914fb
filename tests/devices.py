"""The CPU devices of a command a test runs in a subprocess.

The test processes have 8 simulated CPU devices (tests/conftest.py sets them in JAX's config);
a subprocess gets one, as a user's CPU run does, unless its test asks for more here.
"""

import os


def cpu_devices_env(devices: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of `env` (os.environ by default) whose XLA_FLAGS ask for `devices` simulated CPU
    devices, any other XLA flag kept."""
    out = dict(os.environ if env is None else env)
    flags = [f for f in out.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count=")]  # fmt: skip
    out["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    out.pop("JAX_NUM_CPU_DEVICES", None)
    return out
