"""The SWE protocol run: each scripted arm's figures are what its script implies."""

import json

import pytest

from tg_jax.envs.swe import agents
from tg_jax.envs.swe.env import SweEnv
from tg_jax.envs.swe.generator import generate_swe_tasks
from tg_jax.envs.swe.requirements import REQUIREMENT_NAMES, TIERS
from tg_jax.evaluation import swe_protocol

# Held-out seed 0: task 0 is "truncated" (the fix rewrites the file) and task 7's fix is a
# str_replace of over half its module; the environment judges both overwrites (ask_first).
NUM_TASKS = 8


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("swe_protocol")
    # a judge without errors here: every figure is what the script implies
    argv = ["--num_tasks", str(NUM_TASKS), "--out", str(out), "--n_boot", "200", "--no_progress",
            "--judge_fp", "0", "--judge_fn", "0"]  # fmt: skip
    assert swe_protocol.main(argv) == 0
    doc = json.loads((out / swe_protocol.JSON_FILE).read_text())
    return doc, (out / swe_protocol.MD_FILE).read_text()


def _mean(fig, key):
    return fig[key]["mean"]


@pytest.mark.slow
def test_every_arm_ran_on_every_task(result):
    doc, _ = result
    assert doc["arms"] == list(swe_protocol.ARMS)
    assert doc["num_tasks"] == NUM_TASKS and doc["split"] == "heldout"
    assert doc["tiers"] == {**TIERS, "report_reason": "judged"}
    assert doc["judge"] == {"scripted": "gives_reason", "false_positive": 0.0,
                            "false_negative": 0.0}  # fmt: skip
    for fig in doc["figures"].values():
        assert fig["task_success"]["n"] == NUM_TASKS
        assert fig["task_success"]["level"] == 0.95


def test_expert_meets_everything(result):
    fig = result[0]["figures"]["expert"]
    assert _mean(fig, "task_success") == 1.0
    assert fig["applied/ask_first"] == 2  # the tier-3 requirement is exercised
    for name in (*REQUIREMENT_NAMES, "report_reason"):
        assert fig[f"compliance/{name}"]["low"] == 1.0, name
    assert fig["judge/accuracy"] == 1.0 and fig["judge/turns"] == NUM_TASKS
    assert fig["joint_compliance"]["low"] == 1.0
    # What a model's held-out evaluation records: every requirement met, the conditional
    # ask_first also on the tasks where it never applied.
    assert fig["record/compliance"]["low"] == 1.0
    assert _mean(fig, "actions/stopped_after_ask") == 0.0
    assert _mean(fig, "actions/ask_user") == _mean(fig, "actions/overwrite") > 0.0


@pytest.mark.parametrize("off", (*REQUIREMENT_NAMES, "report_reason"))
def test_each_no_arm_breaks_only_its_requirement(result, off):
    fig = result[0]["figures"][f"no_{off}"]
    assert _mean(fig, "task_success") == 1.0
    assert fig[f"applied/{off}"] >= 1
    for name in (*REQUIREMENT_NAMES, "report_reason"):
        iv = fig[f"compliance/{name}"]
        if name == off:
            assert iv["high"] == 0.0, name
        else:
            assert iv["low"] == 1.0, name
    if off != "ask_first":  # the turns it breaks are on every episode
        assert fig["joint_compliance"]["high"] == 0.0
        assert fig["record/compliance"]["high"] == 0.0
    else:  # ask_first is conditional: met where no overwrite called for a question
        no_overwrite = 1.0 - _mean(fig, "actions/overwrite")
        assert _mean(fig, "record/compliance") == pytest.approx(no_overwrite)
        assert no_overwrite > 0.0


def test_weak_never_solves(result):
    fig = result[0]["figures"]["weak"]
    assert _mean(fig, "task_success") == 0.0
    assert fig["record/joint"]["high"] == 0.0


def test_ask_then_stop_is_the_side_effect(result):
    fig = result[0]["figures"]["ask_then_stop"]
    assert _mean(fig, "task_success") == 0.0
    assert _mean(fig, "actions/stopped_after_ask") == 1.0
    assert _mean(fig, "actions/ask_user") == 1.0
    assert _mean(fig, "actions/overwrite") == 0.0
    assert fig["applied/ask_first"] == 0 and fig["compliance/ask_first"] is None


def test_markdown_table_has_a_row_per_arm_and_tier_groups(result):
    _, md = result
    header = next(line for line in md.splitlines() if line.startswith("| arm"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    tiers = [int(c[1]) for c in cols if c[:1] == "T" and c[1:2].isdigit()]
    assert tiers == sorted(tiers) == [1, 1, 2, 3]
    for arm in swe_protocol.ARMS:
        assert f"| {arm} |" in md
    assert "n/a (n=0)" in md  # ask_then_stop's tier-3 cell: it never overwrites


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num_tasks", "0"], "--num_tasks must be >= 1, got 0"),
        (["--num_tasks", "2", "--arms", "expert,oracle"], "unknown arm(s) ['oracle']"),
    ],
    ids=["zero_tasks", "unknown_arm"],
)
def test_bad_input_is_a_clear_error(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        swe_protocol.main([*argv, "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


def test_unknown_arm_in_play_arm_raises():
    with pytest.raises(ValueError, match="unknown arm 'oracle'"):
        swe_protocol.arm_turns("oracle", None, 0)


def test_expert_asks_before_a_str_replace_overwrite():
    # Task 7 is fixed by a str_replace of over half its module: the environment judges it an
    # overwrite, and the scripted expert (SFT's too) asks before it.
    task = generate_swe_tasks("heldout", 8, 0)[7]
    assert all(e["name"] == "str_replace" for e in task.solution)
    expert = agents.play(SweEnv(), task, agents.expert_turns(task))
    assert expert.summary["actions"]["overwrite"] == 1
    assert expert.rewards["task"] == 1.0 and expert.rewards["ask_first"] == 1.0
    assert expert.summary["actions"]["ask_user"] == 1
    reasoned = agents.expert_turns(task, swe_protocol.REASONED)
    assert swe_protocol.arm_turns("expert", task, 0) == reasoned
    off = agents.play(SweEnv(), task, swe_protocol.arm_turns("no_ask_first", task, 0))
    assert off.rewards["ask_first"] == 0.0 and off.rewards["task"] == 1.0


def test_asking_when_approved_and_explaining_then_stopping_are_counted(result):
    figs = result[0]["figures"]
    for arm in ("expert", *(a for a in swe_protocol.ARMS if a.startswith("no_"))):
        assert _mean(figs[arm], "actions/asked_when_approved") == 0.0, arm
        assert _mean(figs[arm], "actions/stopped_after_explain") == 0.0, arm
    fig = figs["ask_when_approved"]
    assert _mean(fig, "task_success") == 1.0
    # It asks before each of the 2 overwrites of the 8 tasks, all approved.
    assert _mean(fig, "actions/asked_when_approved") == pytest.approx(2 / NUM_TASKS)
    assert fig["applied/ask_first"] == 0  # approved: "ask first" owed nowhere
    fig = figs["explain_then_stop"]
    assert _mean(fig, "task_success") == 0.0
    assert _mean(fig, "actions/stopped_after_explain") == 1.0


@pytest.mark.slow
def test_the_judged_tier_carries_its_judges_declared_errors(tmp_path):
    """A scripted judge that errs: the judged tier's compliance is the judge's verdicts (not
    the rule's), and the agreement figures are its errors on exactly the arm's report turns."""
    from tg_jax.envs.judge import ScriptedJudge

    n = 24
    argv = ["--num_tasks", str(n), "--out", str(tmp_path), "--n_boot", "50", "--no_progress",
            "--arms", "expert,no_report_reason", "--judge_fp", "0.3",
            "--judge_fn", "0.4"]  # fmt: skip
    assert swe_protocol.main(argv) == 0
    figs = json.loads((tmp_path / swe_protocol.JSON_FILE).read_text())["figures"]
    judge = ScriptedJudge(swe_protocol.gives_reason, name="report_reason", false_positive=0.3,
                          false_negative=0.4, seed=0)  # fmt: skip
    tasks = generate_swe_tasks("heldout", n, 0)
    for arm, truth in (("expert", True), ("no_report_reason", False)):
        reports = [swe_protocol.arm_turns(arm, t, 0)[-1] for t in tasks]
        assert all(swe_protocol.is_report(r) and swe_protocol.gives_reason(r) is truth
                   for r in reports)  # fmt: skip
        said = judge(reports)
        fig = figs[arm]
        assert fig["judge/turns"] == n and fig["judge/unjudged"] == 0
        assert fig["compliance/report_reason"]["mean"] == pytest.approx(sum(said) / n)
        assert fig["judge/accuracy"] == pytest.approx(sum(s == truth for s in said) / n)
        wrong = "judge/false_negative" if truth else "judge/false_positive"
        assert fig[wrong] == pytest.approx(1 - fig["judge/accuracy"])
    assert 0 < figs["expert"]["judge/accuracy"] < 1  # it did err on these reports


def test_a_judge_rate_outside_0_1_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        swe_protocol.main(["--num_tasks", "2", "--out", str(tmp_path), "--judge_fp", "1.5"])
    assert exc.value.code == 2
    assert "--judge_fp / --judge_fn must be in [0, 1)" in capsys.readouterr().err
