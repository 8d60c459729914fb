"""The judge's agreement with a labelled set (`tg_jax.evaluation.judge_agreement`)."""

import json
import subprocess
import sys

import pytest

from tests import plugin_example
from tg_jax.envs import plugins
from tg_jax.evaluation import judge_agreement as ja


def test_counts_rates_and_wilson_intervals_by_hand():
    req = plugins.guarded(plugin_example.no_shouting)
    labelled = [
        ("calm words", True),  # judged met, labelled met: TP
        ("quiet again", True),  # TP
        ("LOUDER text", True),  # judged failed, labelled met: FN
        ("SHOUTING", False),  # judged failed, labelled failed: TN
        ("sneaky loud", False),  # judged met, labelled failed: FP
    ]
    r = ja.agreement(req, labelled)
    assert r["confusion"] == {
        "judged_met": {"labelled_met": 2, "labelled_failed": 1},
        "judged_failed": {"labelled_met": 1, "labelled_failed": 1},
    }
    assert r["accuracy"] == pytest.approx(3 / 5)
    assert r["false_positive_rate"] == pytest.approx(1 / 2)  # of the 2 labelled failed
    assert r["false_negative_rate"] == pytest.approx(1 / 3)  # of the 3 labelled met
    # Wilson 95% for 3 of 5, by hand: (0.6 + 1.92/5) / (1 + 3.84/5) = 0.5565...
    z = 1.959964
    centre = (0.6 + z * z / 10) / (1 + z * z / 5)
    half = z * (0.6 * 0.4 / 5 + z * z / 100) ** 0.5 / (1 + z * z / 5)
    assert r["accuracy_ci"] == pytest.approx((centre - half, centre + half))
    assert r["accuracy_ci"][0] == pytest.approx(0.2307, abs=1e-4)
    assert r["accuracy_ci"][1] == pytest.approx(0.8824, abs=1e-4)


def test_unjudged_turns_are_left_out_and_counted():
    r = ja.agreement(plugins.guarded(plugin_example.raises), [("a", True), ("b", False)])
    assert r["unjudged"] == 2 and r["num_judged"] == 0 and r["accuracy"] is None


def test_the_command_on_a_plugin_and_bad_labels(tmp_path):
    labels = tmp_path / "l.jsonl"
    rows = [("calm", True), ("YELLING now", False), ("FINE", True)]
    labels.write_text("".join(json.dumps({"text": t, "label": lab}) + "\n" for t, lab in rows))
    out = tmp_path / "r.json"
    cmd = [
        sys.executable,
        "-m",
        "tg_jax.evaluation.judge_agreement",
        "--requirement=tests.plugin_example:no_shouting",
        f"--labels={labels}",
        f"--out={out}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "accuracy 1.000" in proc.stdout and "| met | 2 | 0 |" in proc.stdout
    assert json.loads(out.read_text())["accuracy"] == 1.0
    labels.write_text('{"text": "x", "label": "yes"}\n')
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"{labels}:1: expected" in proc.stdout
