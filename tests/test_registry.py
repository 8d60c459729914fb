"""The registry of pre-registered tests (tg_jax.evaluation.registry): an attempt is appended
once, a re-registration must name every earlier attempt, the verdict's error rate is split
over the attempts, and the outcome is appended when the report is written."""

import json
import os
import subprocess
import sys

import pytest

from tg_jax import config_files
from tg_jax.evaluation import protocol, registry
from tg_jax.evaluation.report_settings import ReportSettings
from tg_jax.train import pipeline

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(reg, **overrides):
    config = config_files.load_config_file(os.path.join(REPO, "configs", "tiny.py"))
    return config_files.apply_overrides(
        config, {"eval.hypothesis": "tiny/tg-vs-grpo", "eval.registry": str(reg), **overrides}
    )


def _arms(config):
    return {a: pipeline.arm_config(config, a) for a in config.pipeline.arms}


def _lines(reg):
    return [json.loads(x) for x in reg.read_text().splitlines()]


def test_attempts_are_appended_once_and_a_second_must_name_the_first(tmp_path):
    reg = tmp_path / "preregistrations.jsonl"
    first = _config(reg)
    out = protocol.preregister(first, str(tmp_path / "w1"), _arms(first))
    assert out["registry_id"] == "tiny/tg-vs-grpo#1"
    again = protocol.preregister(first, str(tmp_path / "w1"), _arms(first))  # a resumed run
    assert again["registry_id"] == "tiny/tg-vs-grpo#1" and len(_lines(reg)) == 1
    (entry,) = _lines(reg)
    assert entry["config"] == out["sha256"] and entry["earlier"] == [] and entry["outcome"] is None
    assert (entry["margin"], entry["level"], entry["candidate"]) == (-0.05, 0.95, "tg")
    # The same hypothesis again (more steps, a new workdir) without naming attempt 1: refused.
    second = _config(reg, **{"rl_loop.steps": 3})
    with pytest.raises(registry.RegistryError, match=r"1 earlier attempt\(s\).*tiny/tg-vs-grpo#1"):
        protocol.preregister(second, str(tmp_path / "w2"), _arms(second))
    assert len(_lines(reg)) == 1
    named = _config(reg, **{"rl_loop.steps": 3, "eval.earlier": ("tiny/tg-vs-grpo#1",)})
    out2 = protocol.preregister(named, str(tmp_path / "w2"), _arms(named))
    assert out2["registry_id"] == "tiny/tg-vs-grpo#2"
    assert _lines(reg)[1]["earlier"] == ["tiny/tg-vs-grpo#1"]
    # Outcomes are appended and merged by id.
    ni = {"verdict": "fail", "mean": -0.03, "lower": -0.07, "level": 0.95}
    registry.record_outcome(str(reg), "tiny/tg-vs-grpo#1", ni)
    entries = registry.read(str(reg))
    assert entries["tiny/tg-vs-grpo#1"]["outcome"]["verdict"] == "fail"
    assert entries["tiny/tg-vs-grpo#2"]["outcome"] is None
    assert registry.attempts(entries, "tiny/tg-vs-grpo") == ["tiny/tg-vs-grpo#1",
                                                              "tiny/tg-vs-grpo#2"]  # fmt: skip
    # An attempt stopped before its verdict is recorded as such, and still counts.
    registry.record_abandoned(str(reg), "tiny/tg-vs-grpo#2", "a bug in its commit")
    entries = registry.read(str(reg))
    assert entries["tiny/tg-vs-grpo#2"]["outcome"] == {"verdict": "abandoned",
                                                       "why": "a bug in its commit"}  # fmt: skip
    assert len(registry.attempts(entries, "tiny/tg-vs-grpo")) == 2
    with pytest.raises(registry.RegistryError, match="no registered attempt 'tiny/x#1'"):
        registry.record_abandoned(str(reg), "tiny/x#1", "never registered")


def test_the_error_rate_is_split_over_the_attempts():
    assert registry.corrected_level(0.95, 0) == pytest.approx(0.95)
    assert registry.corrected_level(0.95, 1) == pytest.approx(0.975)
    assert registry.corrected_level(0.95, 4) == pytest.approx(0.99)
    settings = ReportSettings(hypothesis="h", earlier=("h#1", "h#2"))
    assert settings.verdict_level() == pytest.approx(1 - 0.05 / 3)
    assert ReportSettings(earlier=("h#1",)).verdict_level() == 0.95  # no hypothesis: no split


def test_a_bad_registry_line_names_the_file_and_line(tmp_path):
    reg = tmp_path / "r.jsonl"
    reg.write_text('{"id": "a#1", "hypothesis": "a"}\nnot json\n')
    with pytest.raises(registry.RegistryError, match=r"r.jsonl:2: not a registry line"):
        registry.read(str(reg))


def test_the_command_refuses_an_unnamed_earlier_attempt_before_any_work(tmp_path):
    reg = tmp_path / "preregistrations.jsonl"
    first = {"id": "tiny/tg-vs-grpo#1", "hypothesis": "tiny/tg-vs-grpo", "workdir": "elsewhere",
             "outcome": {"verdict": "fail"}}  # fmt: skip
    reg.write_text(json.dumps(first) + "\n")
    work = tmp_path / "w"
    cmd = [sys.executable, "-m", "tg_jax.main", "--config=configs/tiny.py", f"--workdir={work}",
           "--config.stage=pipeline", "--config.eval.hypothesis=tiny/tg-vs-grpo",
           f"--config.eval.registry={reg}"]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()[-1:]
    assert line.startswith("error: invalid config: hypothesis 'tiny/tg-vs-grpo' has 1 earlier")
    assert not os.listdir(work)  # nothing ran


def test_the_projects_registry_reads_and_every_attempt_names_the_ones_before():
    entries = registry.read(os.path.join(REPO, "docs", "preregistrations.jsonl"))
    assert len(entries) >= 14
    for hypothesis in {e["hypothesis"] for e in entries.values()}:
        ids = registry.attempts(entries, hypothesis)
        assert ids == [f"{hypothesis}#{n}" for n in range(1, len(ids) + 1)]
        for n, key in enumerate(ids):
            assert entries[key]["earlier"] == ids[:n], key
            if entries[key]["outcome"] is None:  # a registered run still going: its latest
                assert key == ids[-1], key
                continue
            assert entries[key]["outcome"]["verdict"] in registry.OUTCOMES
