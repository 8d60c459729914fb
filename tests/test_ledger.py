"""The results ledger (evaluation.ledger) and the verdict computed from it alone
(python -m tg_jax.evaluation.verdict --attempt=ID)."""

import json

import numpy as np
import pytest

from tg_jax.evaluation import ledger, stats, verdict
from tg_jax.sampling.episode import EpisodeRecord

TASKS = [f"t{i}" for i in range(6)]  # 3 clusters of 2 tasks, 2 episodes per task
CLUSTER = {t: f"f{i // 2}" for i, t in enumerate(TASKS)}


def _episodes(wins):
    """Two plain episodes per task, `wins[task]` of them successes (and a hinted one)."""
    out = []
    for t in TASKS:
        for i in range(2):
            out.append(EpisodeRecord(t, "plain", i, i < wins[t], {"fence": i == 0}, {}, 1,
                                     cluster_id=CLUSTER[t]))  # fmt: skip
        out.append(EpisodeRecord(t, "hinted", 0, True, {}, {}, 1, cluster_id=CLUSTER[t]))
    return out


def _attempt(tmp_path, **kw):
    return {"id": "c0ffee#2", "claim": "c0ffee", "attempt": 2, "hypothesis": "fence/tg-vs-grpo",
            "registry": str(tmp_path / "docs" / "preregistrations.jsonl"), "config": "sha",
            "candidate": "tg", "baseline": "grpo", "seeds": [0, 1, 2], "margin": -0.05,
            "level": 0.975, "spend": {"alpha": 0.05, "rule": "alpha/2^k", "share": 0.0125},
            "floor": 0.1, "collapse_drop": 0.1, **kw}  # fmt: skip


def _write(attempt, arm, seed, wins):
    return ledger.write_run(attempt, arm, seed, ledger.outcomes(_episodes(wins)),
                            policy_sha256="ab" * 32, commit="deadbeef", config={"seed": seed},
                            machine={"cpu_model": "test"})  # fmt: skip


def test_the_verdict_command_reproduces_the_verdict_from_a_small_ledger(tmp_path, capsys):
    attempt = _attempt(tmp_path)
    ledger.write_attempt(attempt)
    # Per seed, every task: candidate - baseline = +0.5, 0, -0.5 (2 episodes a task).
    cand = [dict.fromkeys(TASKS, 2), dict.fromkeys(TASKS, 1), dict.fromkeys(TASKS, 0)]
    base = [dict.fromkeys(TASKS, 1)] * 3
    for s in range(3):
        _write(attempt, "tg", s, cand[s])
        if s < 2:
            _write(attempt, "grpo", s, base[s])
    argv = ["--attempt=c0ffee#2", f"--registry={attempt['registry']}"]
    assert verdict.main(argv) == 1  # a pair is missing: no verdict yet
    assert "no verdict yet, missing grpo_seed2" in capsys.readouterr().out
    path = _write(attempt, "grpo", 2, base[2])
    assert path == str(tmp_path / "docs" / "ledger" / "c0ffee" / "2" / "grpo_seed2.json")
    rec = json.loads(open(path).read())
    assert rec["outcomes"]["t0"] == {"cluster": "f0", "episodes": 2, "wins": 1,
                                     "compliant": {"fence": 1}}  # fmt: skip
    assert (rec["policy_sha256"], rec["commit"]) == ("ab" * 32, "deadbeef")
    assert rec["machine"] == {"cpu_model": "test"} and rec["config"] == {"seed": 2}
    assert verdict.main(argv) == 0
    line = capsys.readouterr().out
    v = verdict.compute(ledger.dir_of(attempt["registry"], "c0ffee#2"))
    c_SxT = np.array([[cand[s][t] / 2 for t in TASKS] for s in range(3)])
    b_SxT = np.full((3, 6), 0.5)
    want = stats.noninferiority_interval(c_SxT, b_SxT, [CLUSTER[t] for t in TASKS], level=0.975)
    assert (v["difference"], v["low"], v["high"]) == pytest.approx(want)
    # By hand: mean 0; the seed means +0.5, 0, -0.5 have sd 0.5, so the Student-t bound alone
    # is t(0.9875, 2 df) * 0.5 / sqrt(3) = 6.205 * 0.2887 = 1.791 below it.
    assert v["difference"] == pytest.approx(0.0)
    assert v["low"] <= -1.79
    assert (v["verdict"], v["seeds"], v["tasks"], v["clusters"]) == ("fail", 3, 6, 3)
    assert line.startswith("c0ffee#2 (fence/tg-vs-grpo): tg vs grpo: fail: difference +0.000 [")
    assert "at level 0.975, one-sided alpha 0.01250 of the claim's; margin -0.05" in line
    # A run's outcomes are written once: other outcomes for the same pair are refused.
    with pytest.raises(ledger.LedgerError, match="holds other outcomes for grpo seed 2"):
        _write(attempt, "grpo", 2, dict.fromkeys(TASKS, 2))


def test_equal_arms_pass_and_a_collapsed_baseline_seed_is_named(tmp_path):
    attempt = _attempt(tmp_path, level=0.95)
    ledger.write_attempt(attempt)
    wins = dict.fromkeys(TASKS, 1)
    for s in range(3):
        _write(attempt, "tg", s, wins)
        _write(attempt, "grpo", s, wins)
    directory = ledger.dir_of(attempt["registry"], "c0ffee#2")
    v = verdict.compute(directory)
    assert (v["difference"], v["low"], v["verdict"]) == (0.0, 0.0, "pass")
    # The base model solved 0.75 of the tasks: a baseline at 0.5 fell more than 0.1 under it.
    base = ledger.outcomes(_episodes({t: 2 if t in TASKS[:3] else 1 for t in TASKS}))
    ledger.write_run(attempt, "base", None, base, policy_sha256="", commit="", config={},
                     machine={})  # fmt: skip
    v = verdict.compute(directory)
    assert v["base_success"] == pytest.approx(0.75)
    assert v["verdict"] == "not meaningful" and "[0, 1, 2]" in v["why"]


def test_a_ledger_run_gives_back_the_evaluations_per_task_means():
    records = _episodes({t: i % 3 for i, t in enumerate(TASKS)})
    back = ledger.episodes({"outcomes": ledger.outcomes(records)})
    ids, table = stats.task_means(records)
    ids2, table2 = stats.task_means(back)
    assert ids == ids2 and np.array_equal(table["task_success"], table2["task_success"])
    assert [r.cluster_id for r in back[::2]] == [CLUSTER[t] for t in TASKS]


def test_a_bad_attempt_id_or_ledger_is_one_error_line(tmp_path, capsys):
    assert verdict.main(["--attempt=nohash", f"--registry={tmp_path}/r.jsonl"]) == 2
    assert "is not an attempt id <claim>#<k>" in capsys.readouterr().err
    assert verdict.main(["--attempt=abc#1", f"--registry={tmp_path}/r.jsonl"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "no such ledger attempt" in err
