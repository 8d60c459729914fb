"""The base model's format cost (sft_eval's forced modes) and its gate (sft.require).

A requirement decided at a turn's first token (the fence) has an opening; the SFT evaluation
plays the plain held-out episodes once more with the first answer opened by it, and
format_cost = plain pass rate - that pass rate. The gate rejects a base model whose cost is
above sft.require.max_format_cost."""

import os
import re
import types

import numpy as np
import pytest

from tg_jax import config_files
from tg_jax.envs.coding import CodingEnv, CodingEnvConfig
from tg_jax.envs.protocol import FENCE_OPENING, make_requirement
from tg_jax.envs.tasks import make_task
from tg_jax.sampling.sampler import SampleResult
from tg_jax.text import ByteTokenizer, ChatRenderer
from tg_jax.train import sft_eval, sft_gates

RENDERER = ChatRenderer(ByteTokenizer())
CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "configs")
LIN = make_task("t/lin", "lin", (2, 3), [0, 1, 4], [-5, -1, 2, 7])  # f(x) = 2x + 3


class FormatSensitive:
    """A model that solves the task in its own format and gets it wrong in the fence: the
    right code when the turn starts unforced, a wrong fenced body after the opening."""

    def __init__(self, *args, **kwargs):
        self.opening = RENDERER.tokenizer.encode(FENCE_OPENING)
        self.forced_calls = 0

    def sample(self, params, prompts, *, max_new_tokens, **kw):
        rows = []
        for p in prompts:
            if list(p[-len(self.opening) :]) == self.opening:
                self.forced_calls += 1
                text = "def f(x): return 0\n```\nCALL submit"
            else:
                text = "def f(x): return 2*x+3\nCALL submit"
            ids = RENDERER.tokenizer.encode(text) + [RENDERER.end_of_turn_ids[0]]
            rows.append(np.asarray(ids, np.int32))
        lps = [np.full(len(r), -1.0, np.float32) for r in rows]
        return SampleResult(rows, lps, lps, np.ones(len(prompts), bool))


def _evaluate(monkeypatch, requirements, *, forced, temperatures=(1.0,)):
    samplers = []

    def make(*a, **k):
        samplers.append(FormatSensitive())
        return samplers[-1]

    monkeypatch.setattr(sft_eval, "Sampler", make)
    eval_cfg = types.SimpleNamespace(seed=0, temperatures=temperatures, max_new_tokens=64)
    env_cfg = CodingEnvConfig(executor="trusted", requirements=requirements, max_turns=1)
    out = sft_eval.evaluate_base_model(
        None,
        None,
        RENDERER,
        [LIN, LIN],
        lambda: CodingEnv(env_cfg),
        eval_cfg,
        max_len=2048,
        forced=forced,
    )
    return out, samplers[0]


def test_only_the_fence_has_an_opening():
    assert make_requirement("fence").opening == FENCE_OPENING == "```python\n"
    assert make_requirement("tool_json").opening is None


def test_forced_mode_opens_the_first_answer_and_format_cost_is_plain_minus_forced(monkeypatch):
    out, sampler = _evaluate(monkeypatch, ("fence", "tool_json"), forced=True)
    plain, forced = out["modes"]["t1.0/plain"], out["modes"]["t1.0/forced_fence"]
    assert sampler.forced_calls == 2  # the two forced episodes' first (and only) turns
    # Plain: right code, unfenced (task 1, fence 0); forced: the opening + a wrong fenced body.
    assert plain["pass_rate"] == 1.0 and plain["compliance/fence"] == 0.0
    assert forced["pass_rate"] == 0.0 and forced["compliance/fence"] == 1.0
    assert forced["compliance/tool_json"] == 0.0
    assert out["forced_pass_rate/fence"] == 0.0
    assert out["format_cost/fence"] == 1.0
    assert "t1.0/forced_tool_json" not in out["modes"] and "format_cost/tool_json" not in out
    # The hinted mode is unchanged by the forced one.
    assert out["modes"]["t1.0/hinted"]["num_episodes"] == 2


def test_no_forced_mode_without_the_flag_or_temperature_one(monkeypatch):
    out, sampler = _evaluate(monkeypatch, ("fence",), forced=False)
    assert sampler.forced_calls == 0 and "format_cost/fence" not in out
    assert set(out["modes"]) == {"t1.0/plain", "t1.0/hinted"}
    out, sampler = _evaluate(monkeypatch, ("fence",), forced=True, temperatures=(0.0,))
    assert sampler.forced_calls == 0 and "format_cost/fence" not in out


def _gated(max_cost, requirements=("fence", "tool_json")):
    config = config_files.load_config_file(os.path.join(CONFIG_DIR, "tiny.py"))
    return config_files.apply_overrides(config, {
        "env.requirements": requirements, "sft.require.enabled": True,
        "sft.require.max_format_cost": max_cost,
    })  # fmt: skip


def _result(cost):
    out = {"pass_rate": 0.3}
    for r in ("fence", "tool_json"):
        out[f"unprompted_compliance/{r}"], out[f"hinted_compliance/{r}"] = 0.0, 0.99
    if cost is not None:
        out["format_cost/fence"], out["forced_pass_rate/fence"] = cost, 0.3 - cost
    return out


def test_format_cost_gate():
    on = _gated(0.1)
    assert sft_gates.check_base_model(on, _result(0.05)) == []
    assert sft_gates.check_base_model(on, _result(-0.2)) == []  # better in the format: fine
    assert sft_gates.check_base_model(on, _result(0.14)) == ["format_cost/fence 0.140 > 0.1"]
    # A base model evaluated before the forced mode existed is evaluated again, not rejected.
    assert sft_gates.unmeasured_requirements(on, _result(None)) == ["fence"]
    missing = ["format_cost/fence not in sft_eval.json"]
    assert sft_gates.check_base_model(on, _result(None)) == missing
    # Off (1.0, the default) or a requirement without an opening: not gated, not required.
    off = _gated(1.0)
    assert sft_gates.check_base_model(off, _result(0.9)) == []
    assert sft_gates.unmeasured_requirements(off, _result(None)) == []
    assert "format_cost/fence" not in sft_gates.gate_figures(off, _result(0.9))
    assert sft_gates.unmeasured_requirements(_gated(0.1, ("tool_json",)), _result(None)) == []
    tiny = config_files.load_config_file(os.path.join(CONFIG_DIR, "tiny.py"))
    assert tiny.sft.require.max_format_cost == 1.0


def test_the_gates_check_the_requirements_the_sft_transcripts_hint():
    """configs/swe.py: RL judges four requirements; the base meets the tool protocol, names
    the changed files and asks first unprompted by design, and the one its transcripts hint
    (explain_change) is gated."""
    config = config_files.load_config_file(os.path.join(CONFIG_DIR, "swe.py"))
    result = {"pass_rate": 0.1}
    for name, unprompted in (("tool_protocol", 1.0), ("files_named", 0.9),
                             ("ask_first", 0.0), ("explain_change", 0.01)):  # fmt: skip
        result[f"unprompted_compliance/{name}"] = unprompted
        result[f"hinted_compliance/{name}"] = 0.97
    assert sft_gates.check_base_model(config, result) == []
    assert list(sft_gates.gate_figures(config, result)) == [
        "pass_rate",
        "unprompted_compliance/explain_change", "hinted_compliance/explain_change",
    ]  # fmt: skip
    result["hinted_compliance/explain_change"] = 0.5
    assert sft_gates.check_base_model(config, result) == [
        "hinted_compliance/explain_change 0.500 < 0.95"
    ]
    config.unlock()
    config.sft.hint_requirements = ()  # every requirement RL judges
    assert "unprompted_compliance/tool_protocol 1.000 > 0.02" in (
        sft_gates.check_base_model(config, result)
    )


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("sft.require.pass_rate", (0.6, 0.2), "0 <= low <= high <= 1"),
        ("sft.require.pass_rate", (0.1, 1.2), "0 <= low <= high <= 1"),
        ("sft.require.min_hinted_compliance", 1.5, "min_hinted_compliance must be in [0, 1]"),
        ("sft.require.max_unprompted_compliance", -0.1, "must be in [0, 1]"),
        ("sft.require.max_format_cost", float("nan"), "max_format_cost must be >= -1"),
    ],
)
def test_require_bounds_no_base_model_can_meet_are_refused(key, value, message):
    config = config_files.load_config_file(os.path.join(CONFIG_DIR, "fence.py"))
    sft_gates.check_require_config(config)  # the config's own bounds are fine
    config.unlock()
    config.sft.require[key.rpartition(".")[2]] = value
    with pytest.raises(ValueError, match=re.escape(message)):
        sft_gates.check_require_config(config)
