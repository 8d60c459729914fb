"""Every config file loads; overrides of unknown keys or wrong types fail clearly."""

import glob
import os

import pytest

from tg_jax import config_lib
from tg_jax.models import ModelConfig

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "configs")
CONFIG_FILES = sorted(glob.glob(os.path.join(CONFIG_DIR, "*.py")))


def test_there_are_configs():
    assert len(CONFIG_FILES) >= 2


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_config_loads_and_model_builds(path):
    cfg = config_lib.load_config_file(path)
    assert cfg.is_locked
    ModelConfig.from_config(cfg.model)  # validates the architecture fields
    with open(path) as f:
        source = f.read()
    assert "python -m tg_jax.main" in source or "launch/" in source  # docstring has the command
    assert "stage" in cfg


def test_overrides_unknown_key_and_wrong_type():
    cfg = config_lib.load_config_file(os.path.join(CONFIG_DIR, "tiny.py"))
    new = config_lib.apply_overrides(cfg, {"model.num_layers": 3})
    assert new.model.num_layers == 3 and cfg.model.num_layers == 2  # the original is untouched
    with pytest.raises(KeyError, match="num_layerz"):
        config_lib.apply_overrides(cfg, {"model.num_layerz": 3})
    with pytest.raises(KeyError, match="modell"):
        config_lib.apply_overrides(cfg, {"modell.num_layers": 3})
    with pytest.raises(TypeError, match="model.num_layers"):
        config_lib.apply_overrides(cfg, {"model.num_layers": "three"})


def test_missing_config_file():
    with pytest.raises(FileNotFoundError, match="nope.py"):
        config_lib.load_config_file("configs/nope.py")
