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


def _config(name):
    return config_files.load_config_file(os.path.join(REPO, "configs", f"{name}.py"))


@pytest.mark.parametrize("name", ["default", "fence", "joint"])
def test_each_embedded_config_s_shipped_base_is_the_recorded_file_and_architecture(name):
    config = _config(name)
    assert shipped_base.source(config) == "shipped"
    directory, prov = shipped_base.check(config)
    assert directory == os.path.join(shipped_base.BASES_DIR, name)
    assert shipped_base.sha256(os.path.join(directory, "model.safetensors")) == prov["sha256"]
    assert prov["commit"] and prov["machine"]["cpu_model"] and prov["command"]
    assert not sft_gates.check_base_model(config, prov["sft_eval"])  # it passed its gates
    md = hf_dir.open_model_dir(directory)
    want = ModelConfig.from_config(config.model)
    params = md.load_params(want)
    assert md.architecture.num_layers == want.num_layers == 2
    n = sum(int(np.prod(x.shape)) for x in __import__("jax").tree.leaves(params))
    assert n == want.num_params() == prov["sft_eval"]["num_params"]
    assert prov["sft_eval"]["requirements"] == list(config.env.requirements)
    if config.sft.init:  # continued from another shipped base: the one its config names
        init_prov = shipped_base.read_provenance(shipped_base.resolve(config.sft.init))
        assert prov["init"] == {"base": config.sft.init, "sha256": init_prov["sha256"]}


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


@pytest.mark.e2e
def test_the_default_runs_rl_from_its_shipped_base(tmp_path):
    """`python -m tg_jax.main --config=configs/default.py` on tiny RL settings: no SFT, the
    base copied to W/base_model, 2 TG steps, the held-out evaluation; the report names the
    shipped file by its sha256."""
    work = tmp_path / "w"
    proc = _main(work, "--config.pipeline.arms=('tg',)", "--config.rl_loop.steps=2",
                 "--config.optim.total_steps=2", "--config.rl_loop.eval_every=0",
                 "--config.eval.num_tasks=4", "--config.eval.samples_per_task=1",
                 "--config.sft.eval.num_tasks=8")  # fmt: skip
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
    # The base re-measured here once, after the arms, and compared with the recorded figures.
    measured = json.loads((work / "sft_eval.json").read_text())
    assert measured["num_tasks"] == 8 and measured["shipped"]["sha256"] == prov["sha256"]
    comparison = measured["comparison"]
    assert set(comparison) >= {"pass_rate", "unprompted_compliance/tool_json"}
    assert comparison["pass_rate"] == shipped_base.compare(prov["sft_eval"], measured)["pass_rate"]
    assert results["context"]["base_remeasured"] == comparison
    (line,) = [ln for ln in report.splitlines() if "(re-measured on this machine" in ln]
    assert f"pass_rate {measured['pass_rate']:.2f} (recorded " in line
    beyond = [k for k, c in comparison.items() if c["beyond"]]
    assert ("beyond the sampling interval: " + ", ".join(beyond)) in line if beyond else (
        "every difference within the sampling interval" in line)  # fmt: skip
    assert f"pass_rate {measured['pass_rate']:.3f} vs " in proc.stdout  # base: re-measured here
    # The same workdir shipped again (`python -m tg_jax.ship_base --from_workdir`): the same
    # weights, with the provenance of this run.
    out = tmp_path / "again"
    cmd = [sys.executable, "-m", "tg_jax.ship_base", "--config=configs/default.py",
           f"--workdir={work}", f"--name={out}", "--from_workdir",
           "--made_by=this test"]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    ship = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert ship.returncode == 0, ship.stderr[-3000:]
    again = shipped_base.read_provenance(str(out))
    assert again["sha256"] == prov["sha256"] and again["command"] == "this test"
    assert again["sft_eval"]["pass_rate"] == measured["pass_rate"]


def test_compare_flags_only_differences_beyond_the_sampling_interval():
    recorded = {"num_tasks": 100, "pass_rate": 0.2, "hinted_compliance/fence": 1.0,
                "eval_s": 3.0, "modes": {}}  # fmt: skip
    measured = {"num_tasks": 100, "pass_rate": 0.3, "hinted_compliance/fence": 0.9}
    got = shipped_base.compare(recorded, measured)
    assert set(got) == {"pass_rate", "hinted_compliance/fence"}
    # 1.96 sqrt(.2 .8 / 100 + .3 .7 / 100) = 1.96 sqrt(.0037) = 1.96 x 0.0608276 = 0.1192221:
    # 0.1 is inside.
    assert got["pass_rate"]["interval"] == pytest.approx(0.1192221, abs=1e-6)
    assert got["pass_rate"]["difference"] == pytest.approx(0.1)
    assert not got["pass_rate"]["beyond"]
    # 1.96 sqrt(0 + .9 .1 / 100) = 0.0588: a drop of 0.1 is beyond it.
    assert got["hinted_compliance/fence"]["interval"] == pytest.approx(0.0588, abs=1e-6)
    assert got["hinted_compliance/fence"]["beyond"]
    # Identical figures (the same machine): no difference, nothing flagged, even at p = 0.
    same = shipped_base.compare(
        {"num_tasks": 8, "pass_rate": 0.0}, {"num_tasks": 8, "pass_rate": 0.0}
    )
    assert same["pass_rate"]["difference"] == 0.0 and not same["pass_rate"]["beyond"]


def _continued(tmp_path, **overrides):
    """configs/fence.py's model with configs/tiny.py's SFT section (2 steps at lr 1e-4), run
    by the sft stage; the per-step losses."""
    from tg_jax.metrics import read_metrics
    from tg_jax.train import sft

    tiny = config_files.load_config_file(os.path.join(REPO, "configs", "tiny.py"))
    config = config_files.load_config_file(os.path.join(REPO, "configs", "fence.py"))
    config.unlock()
    config.sft = tiny.sft
    config = config_files.apply_overrides(
        config, {"sft.steps": 2, "sft.optim.lr": 1e-4, "sft.select.start": 99, **overrides}
    )
    sft.run_sft(config, str(tmp_path))
    return [r["loss"] for r in read_metrics(tmp_path, stage="sft")]


@pytest.mark.slow
def test_sft_init_continues_the_shipped_base(tmp_path):
    """SFT from sft.init starts at the base's loss on fence transcripts (the default base was
    trained on the same expert: well under 1 nat per token), a random init at ~ln 272 = 5.6;
    its first update is taken from the base's weights: the loss at step 1 is the base's."""
    from safetensors.numpy import load_file

    from tg_jax import sharding
    from tg_jax.models.checkpoint_io import params_to_hf
    from tg_jax.train import sft

    base = _continued(tmp_path / "init", **{"sft.init": "default"})
    scratch = _continued(tmp_path / "scratch")
    assert base[0] < 1.0 < 4.5 < scratch[0], (base, scratch)
    config = config_files.apply_overrides(_default(), {"sft.init": "default"})
    mesh, rules = sharding.make_mesh(config.mesh), sharding.logical_rules(config.mesh)
    params = sft.initial_params(config, mesh, rules)  # the base's weights, named as in its file
    got = params_to_hf(params, ModelConfig.from_config(config.model))
    want = load_file(os.path.join(shipped_base.BASES_DIR, "default", "model.safetensors"))
    assert set(got) <= set(want) and "model.embed_tokens.weight" in got
    for name, value in got.items():
        np.testing.assert_array_equal(np.asarray(value), want[name], err_msg=name)
    assert sft.initial_params(_default(), mesh, rules) is None  # sft.init "": a random init


def test_sft_init_may_train_a_longer_context_than_its_base_and_rl_from_a_base_may_not():
    """Rotary positions, nothing learnt per position: SFT continuing a base trains the longer
    context it is given (configs/swe.py); RL from a shipped base runs at most the context the
    base was trained at."""
    longer = {"model.max_seq_len": 1024}  # the default base: max_position_embeddings 768
    config = config_files.apply_overrides(_default(), {"sft.init": "default", **longer})
    directory, prov = shipped_base.sft_init(config)
    assert directory == shipped_base.resolve("default") and prov["name"] == "default"
    with pytest.raises(ConfigError, match="model.max_seq_len 1024 > .*max_position_embeddings 768"):
        shipped_base.check(config)  # sft.source "shipped", base "default"
    with pytest.raises(ConfigError, match="does not fit the config: model.num_layers = 3"):
        shipped_base.sft_init(config_files.apply_overrides(config, {"model.num_layers": 3}))


@pytest.mark.e2e
def test_a_bad_sft_init_is_one_error_line(tmp_path):
    for extra, want in (
        (("--config.sft.init=nope",), "error: invalid config: sft.init='nope': no shipped base in"),
        (("--config.sft.init=default", "--config.sft.tokenizer=bpe"),
         "error: invalid config: sft.init='default' needs sft.tokenizer='byte'"),
        (("--config.sft.init=default", "--config.model.num_layers=3"),
         "error: invalid config: sft.init='default': the base does not fit the config"),
    ):  # fmt: skip
        proc = _main(tmp_path / "w", "--config.stage=sft", *extra)
        assert proc.returncode == 2, proc.stderr[-3000:]
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(want), line
    assert not (tmp_path / "w").exists() or not os.listdir(tmp_path / "w")


@pytest.mark.slow
def test_remeasure_records_dev_figures_and_keeps_the_earlier_ones(tmp_path):
    """`python -m tg_jax.ship_base --remeasure`: the base's figures measured again on its dev
    tasks (sft.eval) become the recorded ones; the weights and the earlier figures stay."""
    copy = tmp_path / "base"
    shutil.copytree(os.path.join(shipped_base.BASES_DIR, "default"), copy)
    before = shipped_base.read_provenance(str(copy))
    config = config_files.apply_overrides(
        _default(), {"sft.eval.num_tasks": 4, "sft.eval.max_new_tokens": 16,
                     "sft.eval.temperatures": (1.0,)},
    )  # fmt: skip
    got = shipped_base.remeasure(config, str(copy), "this test", "abc123")
    after = shipped_base.read_provenance(str(copy))
    assert after["sft_eval"] == json.loads(json.dumps(got))
    assert got["tasks"] == {"split": "dev", "seed": 8} and got["num_tasks"] == 4
    assert got["selected_step"] == before["sft_eval"]["selected_step"]  # how it was made
    *kept, old = after["sft_eval_history"]
    assert kept == before.get("sft_eval_history", [])
    assert old["sft_eval"] == before["sft_eval"] and old["by"] == "this test"
    assert old["commit"] == "abc123"
    assert (
        after["sha256"] == before["sha256"] == shipped_base.sha256(str(copy / "model.safetensors"))
    )
