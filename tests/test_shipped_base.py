"""The shipped base models (tg_jax.train.shipped_base): the file is the recorded one and the
config's architecture, the main job starts RL from it with the gates on its recorded figures,
and a missing, changed or mismatched base is one `error:` line before any stage."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tg_jax import config_files
from tg_jax.errors import ConfigError
from tg_jax.models import ModelConfig, hf_dir
from tg_jax.train import sft_gates, shipped_base

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _default():
    return config_files.load_config_file(os.path.join(REPO, "configs", "default.py"))


def test_the_default_s_shipped_base_is_the_recorded_file_and_architecture():
    config = _default()
    assert shipped_base.source(config) == "shipped"
    directory, prov = shipped_base.check(config)
    assert directory == os.path.join(shipped_base.BASES_DIR, "default")
    assert shipped_base.sha256(os.path.join(directory, "model.safetensors")) == prov["sha256"]
    assert prov["commit"] and prov["machine"]["cpu_model"] and prov["command"]
    assert not sft_gates.check_base_model(config, prov["sft_eval"])  # it passed its gates
    md = hf_dir.open_model_dir(directory)
    want = ModelConfig.from_config(config.model)
    params = md.load_params(want)
    assert md.architecture.num_layers == want.num_layers == 2
    n = sum(int(np.prod(x.shape)) for x in __import__("jax").tree.leaves(params))
    assert n == want.num_params() == prov["sft_eval"]["num_params"]


def test_a_changed_or_mismatched_base_is_refused(tmp_path):
    config = _default()
    copy = tmp_path / "base"
    shutil.copytree(os.path.join(shipped_base.BASES_DIR, "default"), copy)
    ok = config_files.apply_overrides(config, {"sft.base": str(copy)})
    shipped_base.check(ok)
    with pytest.raises(ConfigError, match=r"does not fit the config: model.num_layers = 3, but"):
        shipped_base.check(config_files.apply_overrides(ok, {"model.num_layers": 3}))
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="has sha256 .* its provenance records"):
        shipped_base.check(ok)
    with pytest.raises(ConfigError, match="sft.source must be one of shipped, train"):
        shipped_base.source(config_files.apply_overrides(config, {"sft.source": "cloud"}))


def _main(work, *extra):
    cmd = [sys.executable, "-m", "tg_jax.main", "--config=configs/default.py",
           f"--workdir={work}", *extra]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def test_a_missing_base_is_one_error_line_before_any_stage(tmp_path):
    proc = _main(tmp_path / "w", "--config.sft.base=nope")
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: invalid config: sft.source='shipped': no shipped base in")
    assert "--config.sft.source=train" in line
    assert not (tmp_path / "w").exists() or not os.listdir(tmp_path / "w")


def test_the_default_runs_rl_from_its_shipped_base(tmp_path):
    """`python -m tg_jax.main --config=configs/default.py` on tiny RL settings: no SFT, the
    base copied to W/base_model, 2 TG steps, the held-out evaluation; the report names the
    shipped file by its sha256."""
    work = tmp_path / "w"
    proc = _main(work, "--config.pipeline.arms=('tg',)", "--config.rl_loop.steps=2",
                 "--config.optim.total_steps=2", "--config.rl_loop.eval_every=0",
                 "--config.eval.num_tasks=4", "--config.eval.samples_per_task=1")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    prov = shipped_base.read_provenance(os.path.join(shipped_base.BASES_DIR, "default"))
    assert "base: shipped default (sha256 " in proc.stdout
    assert not (work / "sft").exists()  # no SFT ran
    got = shipped_base.sha256(str(work / "base_model" / "model.safetensors"))
    assert got == prov["sha256"]
    report = (work / "report" / "report.md").read_text()
    assert f"shipped `default`, weights sha256 `{prov['sha256']}`" in report
    results = json.loads((work / "report" / "results.json").read_text())
    assert results["context"]["shipped_base"]["sha256"] == prov["sha256"]
    summary = json.loads((work / "runs" / "tg_seed0" / "rl_summary.json").read_text())
    assert summary["step"] == 2 and summary["finished"]
