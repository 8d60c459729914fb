"""SFT model selection on dev tasks: the choice rule, and a tiny SFT that keeps a best step."""

import json
import os

import jax
import numpy as np
import pytest

from tg_jax import checkpointing, config_files, config_lib, sharding
from tg_jax.metrics import read_metrics
from tg_jax.train import sft, sft_eval, sft_select

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "configs")


def _entry(step, pass_rate, unprompted=0.0, hinted=1.0, cfg=None):
    cfg = cfg or sft_select.SelectConfig.from_config(config_lib.sft_select_config())
    f = {"pass_rate": pass_rate, "hinted_pass_rate": 0.0, "unprompted_max": unprompted,
         "hinted_min": hinted}  # fmt: skip
    ok = sft_select.compliant(f, cfg)
    return {"step": step, "figures": f, "compliant": ok,
            "eligible": ok and pass_rate <= cfg.pass_rate_max}  # fmt: skip


def test_choose_prefers_eligible_then_compliant_then_pass_rate_then_later_step():
    assert sft_select.choose([]) is None
    # Highest eligible pass rate wins over a higher pass rate that breaks a gate.
    entries = [_entry(1000, 0.25), _entry(1250, 0.40, unprompted=0.05), _entry(1500, 0.30)]
    assert sft_select.choose(entries)["step"] == 1500
    # Above pass_rate_max (0.6) is not eligible.
    assert sft_select.choose([_entry(1000, 0.7), _entry(1250, 0.3)])["step"] == 1250
    # None eligible: a compliant one before a non-compliant one with a higher pass rate.
    entries = [_entry(1000, 0.1, hinted=0.5), _entry(1250, 0.05)]
    assert sft_select.choose(entries)["step"] == 1250
    # Ties: the later step.
    assert sft_select.choose([_entry(1000, 0.3), _entry(1250, 0.3)])["step"] == 1250


def test_due_steps_and_bad_config():
    cfg = sft_select.SelectConfig.from_config(config_lib.sft_select_config(start=1000, every=250))
    due = [s for s in range(1, 2501) if cfg.due(s, 2500)]
    assert due == [1000, 1250, 1500, 1750, 2000, 2250, 2500]
    assert cfg.due(1100, 1100)  # the last step is always evaluated once past start
    with pytest.raises(ValueError, match="every"):
        sft_select.SelectConfig.from_config(config_lib.sft_select_config(every=0))
    with pytest.raises(ValueError, match="compliance bounds"):
        sft_select.SelectConfig.from_config(config_lib.sft_select_config(hinted_min=1.5))


def test_selection_bounds_follow_the_gates():
    c = config_lib.sft_config()
    c.require.min_hinted_compliance = 0.9
    c.require.max_unprompted_compliance = 0.05
    assert (c.select.hinted_min, c.select.unprompted_max) == (0.9, 0.05)


def _tiny_config():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny", os.path.join(CONFIG_DIR, "tiny.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


@pytest.mark.slow
def test_tiny_sft_keeps_the_selected_step_and_loads_it(tmp_path, monkeypatch):
    config = _tiny_config()
    assert (config.sft.select.start, config.sft.select.every, config.sft.steps) == (3, 3, 6)
    # Dev figures by step: step 3 is eligible (pass 0.3), step 6 breaks the hinted gate.
    figures = {3: (0.3, 1.0), 6: (0.5, 0.2)}
    calls = []

    def fake_eval(model, params, renderer, tasks, make_env, eval_cfg, max_len):
        step = (3, 6)[len(calls)]
        calls.append(step)
        p, h = figures[step]
        r = make_env().requirements[0].name
        mode = lambda pr, c: {"pass_rate": pr, f"compliance/{r}": c}  # noqa: E731
        return {"modes": {"t1.0/plain": mode(p, 0.0), "t1.0/hinted": mode(0.0, h)}}

    monkeypatch.setattr(sft_eval, "evaluate_base_model", fake_eval)
    work = str(tmp_path / "w")
    state = sft.run_sft(config, work)
    assert calls == [3, 6]
    record = sft_select.read_selection(os.path.join(work, sft.SFT_DIR))
    assert record["best_step"] == 3 and record["best_eligible"] is True
    assert [e["eligible"] for e in record["evaluations"]] == [True, False]
    assert sft.selected_step(config, work) == 3 and int(state.step) == 3
    assert sft.sft_finished(config, work)

    model = sft.build_model(config)
    mesh, rules = sharding.make_mesh(config.mesh), sharding.logical_rules(config.mesh)
    loaded = sft.load_sft_state(config, work, model, mesh, rules)
    best = checkpointing.restore_checkpoint(
        os.path.join(work, sft.SFT_DIR, sft_select.BEST_DIR), loaded, step=3
    ).state
    final = checkpointing.restore_checkpoint(sft.sft_checkpoint_dir(work), loaded, step=6).state
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(best.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    pairs = zip(jax.tree.leaves(loaded.params), jax.tree.leaves(final.params), strict=True)
    diff = [np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in pairs]
    assert max(diff) > 0  # the selected step is not the last one

    # A finished SFT is not redone and returns the selected state again.
    again = sft.run_sft(config, work)
    assert int(again.step) == 3 and calls == [3, 6]
    # Selection off: the last step is the base model.
    config.sft.select.enabled = False
    assert sft.selected_step(config, work) == 6


def test_corrupt_selection_record_is_a_clear_error(tmp_path):
    d = tmp_path / "sft"
    d.mkdir()
    (d / sft_select.SELECTION_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not a valid SFT selection record"):
        sft_select.read_selection(str(d))
    (d / sft_select.SELECTION_FILE).write_text(json.dumps({"best_step": 3}))
    with pytest.raises(ValueError, match="delete"):
        sft_select.read_selection(str(d))


def test_extension_decision_and_schedule():
    ext = sft_select.ExtendConfig(steps=500, min_pass_rate=0.25, lr_fraction=0.2)
    low, high = _entry(2250, 0.22), _entry(2500, 0.30)
    decided = sft_select.decide_extension([low], 2500, ext)
    assert decided["extended"] and decided["steps"] == 500
    assert decided["best_eligible_pass_rate"] == pytest.approx(0.22)
    assert not sft_select.decide_extension([low, high], 2500, ext)["extended"]
    # Only eligible evaluations up to sft.steps count; none eligible: extended.
    broken = _entry(2500, 0.5, hinted=0.5)
    assert sft_select.decide_extension([broken], 2500, ext)["best_eligible_pass_rate"] is None
    assert sft_select.decide_extension([broken, _entry(2750, 0.4)], 2500, ext)["extended"]
    # No dev evaluation up to sft.steps (select.start later, a short forced run): not extended.
    none = sft_select.decide_extension([], 50, ext)
    assert not none["extended"] and none["steps"] == 0
    assert (
        sft_select.describe_extension(none) == "sft: no dev evaluation up to step 50: not extended"
    )
    with pytest.raises(ValueError, match="lr_fraction"):
        sft_select.ExtendConfig(steps=1, min_pass_rate=0.2, lr_fraction=0.0)
    config = _tiny_config()
    config.sft.extend.steps = 4
    config.sft.select.enabled = False
    with pytest.raises(ValueError, match="needs sft.select.enabled"):
        sft_select.extend_config(config)
    # The extension's cosine: 0.2 x lr at sft.steps down to lr x end_lr_fraction.
    config = config_files.apply_overrides(
        _tiny_config(), {"sft.extend.steps": 4, "sft.extend.lr_fraction": 0.2}
    )
    lr, end = float(config.sft.optim.lr), float(config.sft.optim.end_lr_fraction)
    schedule = sft.extension_schedule(config)
    base = int(config.sft.steps)
    assert float(schedule(base)) == pytest.approx(0.2 * lr)
    assert float(schedule(base + 2)) == pytest.approx(end * lr + (0.2 - end) * lr / 2)
    assert float(schedule(base + 4)) == pytest.approx(end * lr)


def _fake_dev_eval(pass_rates, calls):
    def fake_eval(model, params, renderer, tasks, make_env, eval_cfg, max_len):
        p = pass_rates[len(calls)]
        calls.append(p)
        r = make_env().requirements[0].name
        mode = lambda pr, c: {"pass_rate": pr, f"compliance/{r}": c}  # noqa: E731
        return {"modes": {"t1.0/plain": mode(p, 0.0), "t1.0/hinted": mode(0.0, 1.0)}}

    return fake_eval


def _params(state):
    return [np.asarray(x) for x in jax.tree.leaves(state.params)]


@pytest.mark.slow
def test_tiny_sft_extends_a_low_run_and_resumes_inside_the_extension(tmp_path, monkeypatch, capsys):
    overrides = {"sft.extend.steps": 3, "sft.extend.min_pass_rate": 0.25}
    config = config_files.apply_overrides(_tiny_config(), overrides)
    # Dev pass rates at steps 3, 6 (under 0.25: extended) and 9 (the extension's last step).
    calls = []
    monkeypatch.setattr(sft_eval, "evaluate_base_model", _fake_dev_eval([0.1, 0.2, 0.4], calls))
    work = str(tmp_path / "w")
    state = sft.run_sft(config, work)
    assert calls == [0.1, 0.2, 0.4] and int(state.step) == 9
    record = sft_select.read_selection(os.path.join(work, sft.SFT_DIR))
    assert record["extension"]["extended"] and record["extension"]["at_step"] == 6
    assert record["best_step"] == 9 and sft.sft_finished(config, work)
    assert sft.last_step(config, work) == 9
    lrs = {m["step"]: m["lr"] for m in read_metrics(work, stage="sft")}
    schedule = sft.extension_schedule(config)
    for step in (7, 8, 9):  # the lr logged at step s is the one step s - 1 -> s used
        assert lrs[step] == pytest.approx(float(schedule(step - 1)))

    # The same run stopped inside the extension and resumed: the same params.
    calls2 = []
    monkeypatch.setattr(sft_eval, "evaluate_base_model", _fake_dev_eval([0.1, 0.2, 0.4], calls2))
    work2 = str(tmp_path / "w2")
    stopped = sft.run_sft(config, work2, stop_after=7)
    assert int(stopped.step) == 7 and not sft.sft_finished(config, work2)
    resumed = sft.run_sft(config, work2)
    assert int(resumed.step) == 9 and calls2 == [0.1, 0.2, 0.4]
    for a, b in zip(_params(state), _params(resumed), strict=True):
        np.testing.assert_array_equal(a, b)

    # Stopped at sft.steps before the decision was recorded (a preemption there): the resumed
    # run decides, says so, and ends as the uninterrupted one.
    calls3 = []
    monkeypatch.setattr(sft_eval, "evaluate_base_model", _fake_dev_eval([0.1, 0.2, 0.4], calls3))
    work3 = str(tmp_path / "w3")
    sft.run_sft(config, work3, stop_after=6)
    sft_dir = os.path.join(work3, sft.SFT_DIR)
    record = sft_select.read_selection(sft_dir)
    del record["extension"]
    (tmp_path / "w3" / sft.SFT_DIR / sft_select.SELECTION_FILE).write_text(json.dumps(record))
    assert sft_select.final_step(config, sft_dir) is None and not sft.sft_finished(config, work3)
    capsys.readouterr()
    resumed = sft.run_sft(config, work3)
    assert "extending by 3 steps (sft.extend)" in capsys.readouterr().err
    assert int(resumed.step) == 9 and calls3 == [0.1, 0.2, 0.4]
    for a, b in zip(_params(state), _params(resumed), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_tiny_sft_not_extended_is_the_run_without_the_option(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(
        sft_eval, "evaluate_base_model", _fake_dev_eval([0.1, 0.3, 0.1, 0.3], calls)
    )
    on = config_files.apply_overrides(_tiny_config(), {"sft.extend.steps": 3})
    state_on = sft.run_sft(on, str(tmp_path / "on"))
    record = sft_select.read_selection(os.path.join(str(tmp_path / "on"), sft.SFT_DIR))
    assert record["extension"]["extended"] is False and record["extension"]["steps"] == 0
    state_off = sft.run_sft(_tiny_config(), str(tmp_path / "off"))
    assert int(state_on.step) == int(state_off.step) == 6 and len(calls) == 4
    for a, b in zip(_params(state_on), _params(state_off), strict=True):
        np.testing.assert_array_equal(a, b)
