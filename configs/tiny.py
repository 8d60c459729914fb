"""Tiny model config for tests and quick smoke runs (compiles in about a second on CPU).

Run its forward pass:
    python -m tg_jax.main --config=configs/tiny.py --workdir=/tmp/tg_tiny --config.stage=forward
"""

import ml_collections

from tg_jax import config_lib


def get_config(arg=None):
    del arg
    c = ml_collections.ConfigDict()
    c.stage = "forward"  # which stage tg_jax.main runs
    c.seed = 0  # global seed
    c.model = config_lib.tiny_model_config()  # the Qwen3 architecture
    c.mesh = config_lib.mesh_config()  # device mesh and logical axis rules
    return c
