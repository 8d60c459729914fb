"""Periodic exports (`rl_loop.export_every`): a run writes <run>/export/step_<N> every N steps,
each a checkpoint directory of the run's params at step N (our loader and transformers)."""

import importlib.util
import os

import jax
import numpy as np
import pytest

from tests import rl_loop_driver as driver
from tg_jax import checkpointing, config_files
from tg_jax.models import ModelConfig, Transformer, checkpoint_io, hf_dir
from tg_jax.train import rl

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _logits(cfg: ModelConfig, params, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(jax.jit(Transformer(cfg).apply)({"params": params}, tokens))


@pytest.mark.slow
def test_export_every_writes_the_step_params_loadable(tmp_path):
    config = config_files.apply_overrides(
        driver.make_config(steps=3),
        {"rl_loop.export_every": 2, "rl_loop.eval_every": 0, "rl_loop.keep_checkpoints": 3},
    )
    cfg = ModelConfig.from_config(config.model)
    result = rl.run_rl(
        config, str(tmp_path), driver.initial_params(config), arm_name="tg", seed=0,
        sources=driver.make_sources(),
        exporter=lambda params, out: hf_dir.export_model_dir(out, params, cfg),
    )  # fmt: skip
    assert result.step == 3 and result.finished
    export_root = tmp_path / "export"
    assert sorted(os.listdir(export_root)) == ["step_2"]  # every 2 steps of 3: step 2 only
    export = str(export_root / "step_2")

    # The run's params at step 2: its checkpoint of step 2 (checkpoint_every = 1).
    ckpt = checkpointing.TrainingCheckpointer(tmp_path / rl.CHECKPOINT_DIR, read_only=True)
    try:
        at_step_2 = ckpt.restore(result.state, step=2).state.params
    finally:
        ckpt.close()
    loaded, loaded_cfg = checkpoint_io.load_hf_checkpoint(export)
    assert loaded_cfg.vocab_size == cfg.vocab_size and loaded_cfg.num_layers == cfg.num_layers
    flat = driver.flat_params
    want, got, final = flat(at_step_2), flat(loaded), flat(result.state.params)
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert any(not np.array_equal(want[n], final[n]) for n in want), "step 2 = step 3 params?"

    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12))
    ours = _logits(cfg, at_step_2, tokens)
    np.testing.assert_allclose(_logits(loaded_cfg, loaded, tokens), ours, atol=1e-5, rtol=1e-5)
    if HAVE_TRANSFORMERS:
        import transformers

        from tests.hf_checkpoints import hf_logits

        model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype="float32").eval()
        np.testing.assert_allclose(hf_logits(model, tokens), ours, atol=1e-4, rtol=1e-4)
