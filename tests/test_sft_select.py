"""SFT model selection on dev tasks: the choice rule, and a tiny SFT that keeps a best step."""

import json
import os

import jax
import numpy as np
import pytest

from tg_jax import checkpointing, config_lib, sharding
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


def test_tiny_sft_keeps_the_selected_step_and_loads_it(tmp_path, monkeypatch):
    config = _tiny_config()
    assert (config.sft.select.start, config.sft.select.every, config.sft.steps) == (3, 3, 6)
    # Dev figures by step: step 3 is eligible (pass 0.3), step 6 breaks the hinted gate.
    figures = {3: (0.3, 1.0), 6: (0.5, 0.2)}
    calls = []

    def fake_eval(model, params, renderer, tasks, env_cfg, eval_cfg, max_len):
        step = (3, 6)[len(calls)]
        calls.append(step)
        p, h = figures[step]
        r = env_cfg.requirements[0]
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
