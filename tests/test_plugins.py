"""A team's own requirements and environments by import path (`tg_jax.envs.plugins`).

The plug-ins live outside tg_jax (tests/plugin_example.py, tests/plugin_broken.py) and are
named as a user names them: in `env.requirements` / `env.kind`, on the command line.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from tests import plugin_example
from tg_jax.config_lib import env_config, tasks_config
from tg_jax.envs import (
    PluginError,
    env_factory,
    env_kind,
    make_env,
    plugins,
    requirement_names,
)
from tg_jax.envs.base import EpisodeSummary
from tg_jax.envs.coding import CodingEnv, CodingEnvConfig
from tg_jax.envs.tasks import generate_tasks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EX = "tests.plugin_example"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("tests.no_such_module:x", "no module named 'tests.no_such_module'"),
        ("tests.plugin_broken:x", "importing 'tests.plugin_broken' failed: No module named "
                                  "'a_module_that_is_not_installed_xyz'"),
        (f"{EX}:missing", f"module '{EX}' has no attribute 'missing'"),
        (f"{EX}:not_a_requirement", "is a int: expected a tg_jax.envs.Requirement or a factory"),
        (f"{EX}:factory_of_a_string", "the factory returned a str, expected a tg_jax.envs"),
        (f"{EX}:factory_that_raises", "the factory raised KeyError: 'report_style'"),
        (f"{EX}:judged_by_a_missing_checkpoint", "the factory raised ValueError: ModelJudge: "
         "/nonexistent/judge_checkpoint is not a checkpoint directory (no config.json)"),
        (":x", "expected 'package.module:attribute'"),
    ],
)  # fmt: skip
def test_a_bad_requirement_plugin_is_a_clear_error(spec, message):
    cfg = env_config(requirements=("fence", spec), executor="trusted")
    with pytest.raises(PluginError) as e:
        requirement_names(cfg)
    assert spec in str(e.value) and message in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "kind, message",
    [
        (f"{EX}:NotAnEnvironment", "is a type: expected a subclass of tg_jax.envs.Environment"),
        (f"{EX}:nowhere", f"module '{EX}' has no attribute 'nowhere'"),
        ("no_such_package.envs:Env", "no module named 'no_such_package'"),
    ],
)
def test_a_bad_environment_plugin_is_a_clear_error(kind, message):
    with pytest.raises(PluginError) as e:
        env_kind(env_config(kind=kind))
    assert message in str(e.value), str(e.value)


def test_two_requirements_of_one_name_are_refused():
    cfg = env_config(requirements=(f"{EX}:no_shouting", f"{EX}:no_shouting"), executor="trusted")
    with pytest.raises(PluginError, match=r"names requirement\(s\) \['no_shouting'\] twice"):
        requirement_names(cfg)


def test_plugins_and_builtins_judge_side_by_side_under_their_own_names():
    specs = ("fence", f"{EX}:no_shouting", f"{EX}:short_turns")
    env = CodingEnv(CodingEnvConfig(requirements=specs, executor="trusted", requirement_weight=2.0))
    assert [r.name for r in env.requirements] == ["fence", "no_shouting", "short_turns"]
    assert requirement_names(env_config(requirements=specs)) == (
        "fence", "no_shouting", "short_turns",
    )  # fmt: skip
    assert all(r.weight == 2.0 for r in env.requirements)  # env.requirement_weight
    task = generate_tasks("train", 1, seed=0)[0]
    env.reset(task)
    turn = "```python\ndef f(x): return x\n```\nCALL run_tests"
    res = env.step(turn)
    assert res.info["verdicts"] == {"fence": True, "no_shouting": True, "short_turns": False}
    res = env.step("SHOUTING here\nCALL submit")
    assert res.done
    assert env.summary().verdicts["no_shouting"] == [True, False]
    assert res.rewards["no_shouting"] == pytest.approx(0.5)  # fraction of judged turns
    assert env.summary().unjudged == {}


def test_a_checker_that_raises_or_hangs_leaves_the_turn_unjudged(caplog, monkeypatch):
    # Each requirement's warning is logged once per process: an earlier test of this worker
    # (test_judge_agreement's raising checker) must not have used it up.
    monkeypatch.setattr(plugins, "_warned", set())
    specs = ("fence", f"{EX}:raises", f"{EX}:slow")
    env = CodingEnv(CodingEnvConfig(requirements=specs, executor="trusted"))
    env.reset(generate_tasks("train", 1, seed=0)[0])
    t0 = time.monotonic()
    res = env.step("```python\ndef f(x): return x\n```\nCALL run_tests")
    took = time.monotonic() - t0
    assert res.info["verdicts"] == {"fence": True, "raises": None, "slow": None}
    # The 8 s checker bounded by its 0.2 s timeout (slack for a loaded machine).
    assert took < 4.0, f"the 0.2 s timeout did not bound the 8 s checker ({took:.2f} s)"
    env.step("CALL submit")
    summary = env.summary()
    assert summary.unjudged == {"raises": 2, "slow": 2}
    assert summary.verdicts["raises"] == [None, None]
    # Not judged is neither met nor failed: no failed turn for the TG gate.
    assert summary.failed_turns("raises") == [] and summary.failed_turns("slow") == []
    assert "checker bug" in caplog.text and "ran past 0.2 s" in caplog.text


def test_an_unjudged_count_reaches_the_rollout_metrics():
    from tests.test_rl_rollouts import _traj
    from tg_jax.train import rl_rollouts

    trajs = [_traj([{"raises": None}], 1.0, {}), _traj([{"raises": None}], 0.0, {})]
    trajs[0].info["unjudged"] = {"raises": 2}
    m = rl_rollouts.rollout_metrics(trajs)
    assert m["rollout/unjudged/raises"] == pytest.approx(1.0)  # (2 + 0) / 2 episodes


def test_a_plugin_environment_builds_and_plays():
    cfg = env_config(kind=f"{EX}:WordEnv", requirements=(f"{EX}:short_turns",))
    assert env_kind(cfg) == f"{EX}:WordEnv"
    env = env_factory(cfg)()
    assert isinstance(env, plugin_example.WordEnv)
    tasks = list(plugin_example.WordEnv.generate_tasks("train", 3, seed=0))
    prompt = env.reset(tasks[0])
    assert tasks[0]["word"] in prompt
    res = env.step(f"{tasks[0]['word']}!")
    assert res.done and res.rewards == {"task": 1.0, "short_turns": 1.0}
    assert isinstance(env.summary(), EpisodeSummary)
    assert requirement_names(cfg) == ("short_turns",)
    with pytest.raises(ValueError, match="no built-in requirements"):
        make_env(env_config(kind=f"{EX}:WordEnv", requirements=("fence",)))


def test_the_data_stage_stores_a_plugin_environments_tasks(tmp_path):
    import ml_collections

    from tg_jax.data import task_data

    config = ml_collections.ConfigDict(
        {"env": env_config(kind=f"{EX}:WordEnv", requirements=(f"{EX}:short_turns",)),
         "tasks": tasks_config(seed=3, num_train=5, num_heldout=2)}
    )  # fmt: skip
    sources = task_data.prepare_tasks(config, str(tmp_path))
    train = task_data.load_tasks(sources, "train")
    expected = list(plugin_example.WordEnv.generate_tasks("train", 5, 3))
    assert [t["task_id"] for t in train] == [t["task_id"] for t in expected]
    assert [t["word"] for t in train] == [t["word"] for t in expected]
    assert all(t["kind"] == plugins.PLUGIN_TASK_KIND for t in train)
    assert len(task_data.load_tasks(sources, "heldout")) == 2


def _main(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, "-m", "tg_jax.main", "--config=configs/tiny.py", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_a_bad_plugin_on_the_command_line_is_one_error_line(tmp_path):
    proc = _main(f"--workdir={tmp_path}", "--config.stage=pipeline",
                 "--config.env.requirements=('fence', 'tests.plugin_example:missing')")  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("error: invalid config: env.requirements entry 'tests.plugin_example:missing': "
            "module 'tests.plugin_example' has no attribute 'missing'") in proc.stderr  # fmt: skip
    assert not any(tmp_path.iterdir()), "nothing may be written before the config is checked"


def test_a_plugin_environment_without_dev_tasks_and_a_periodic_evaluation_is_refused(tmp_path):
    proc = _main(f"--workdir={tmp_path}", "--config.stage=pipeline",
                 "--config.rl_loop.eval_every=1", f"--config.env.kind={EX}:FileOnlyEnv",
                 f"--config.env.requirements=('{EX}:short_turns',)")  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: invalid config: env.kind '{EX}:FileOnlyEnv': the periodic "
                           "evaluation (rl_loop.eval_every) reads dev tasks"), line  # fmt: skip
    assert not any(tmp_path.iterdir())


@pytest.mark.e2e
def test_the_tiny_main_job_with_a_plugin_requirement_and_environment(tmp_path):
    """The user's command on the tiny main job: a plug-in requirement beside the fence in the
    coding environment, its held-out tasks from the user's file with its own field names,
    then a plug-in environment; each plug-in's compliance is in the report and the held-out
    figures."""
    work = tmp_path / "coding"
    mine = tmp_path / "mine.jsonl"
    with mine.open("w") as f:
        for i, t in enumerate(generate_tasks("heldout", 16, seed=5)):
            rec = {("uid" if k == "task_id" else k): v for k, v in t.to_record().items()}
            f.write(json.dumps({**rec, "uid": f"mine-{i}"}) + "\n")
    reqs = "--config.env.requirements=('fence', 'tests.plugin_example:no_shouting')"
    proc = _main(f"--workdir={work}", "--config.stage=pipeline",
                 "--config.pipeline.arms=('tg',)", reqs, f"--config.tasks.heldout_source={mine}",
                 "--config.tasks.fields=('task_id=uid',)")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    evaluated = [json.loads(line)["task_id"]
                 for line in (work / "runs" / "tg_seed0" / "heldout.jsonl").open()]  # fmt: skip
    assert evaluated and all(t.startswith("mine-") for t in evaluated), evaluated[:4]
    table = _requirement_table(work)
    assert table[0] == ["arm", "fence", "no_shouting"] and table[2][0] == "tg", table
    results = json.loads((work / "report" / "results.json").read_text())
    plain = results["arms"]["tg"]["heldout"]["plain"]["bootstrap"]
    assert {"compliance/fence", "compliance/no_shouting"} <= set(plain)
    assert table[2][2].startswith(f"{plain['compliance/no_shouting']['mean']:.2f}")

    work = tmp_path / "word"
    proc = _main(f"--workdir={work}", "--config.stage=pipeline", "--config.pipeline.arms=('tg',)",
                 "--config.env.kind=tests.plugin_example:WordEnv",
                 "--config.env.requirements=('tests.plugin_example:short_turns', "
                 "'tests.plugin_example:judged_brief')")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = _requirement_table(work)
    assert table[0] == ["arm", "judged_brief", "short_turns"], table
    # the judged requirement (a scripted judge) judged every held-out turn, none unjudged
    results = json.loads((work / "report" / "results.json").read_text())
    plain = results["arms"]["tg"]["heldout"]["plain"]["bootstrap"]
    assert "compliance/judged_brief" in plain and "unjudged/judged_brief" not in plain
    assert table[2][1].startswith(f"{plain['compliance/judged_brief']['mean']:.2f}")
    heldout = [json.loads(line) for line in (work / "runs" / "tg_seed0" / "heldout.jsonl").open()]
    assert heldout and all(r["task_id"].startswith("word-heldout-") for r in heldout)


def _requirement_table(workdir) -> list[list[str]]:
    """The cells of report.md's "Compliance per requirement" table."""
    text = (workdir / "report" / "report.md").read_text()
    section = text.split("## Compliance per requirement", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("|")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in rows]


def _config(kind: str, requirements: tuple, **tasks):
    import ml_collections

    from tg_jax.config_lib import tasks_config

    return ml_collections.ConfigDict(
        {"env": env_config(kind=kind, requirements=requirements),
         "tasks": tasks_config(num_train=4, num_heldout=2, **tasks)}
    )  # fmt: skip


def test_a_plugin_environments_tasks_from_a_jsonl_file_and_a_directory(tmp_path):
    from tg_jax.data import task_data

    train = tmp_path / "train.jsonl"
    train.write_text('{"id": "a", "w": "apple"}\n\n{"id": "b", "w": "river"}\n')
    held = tmp_path / "held"
    held.mkdir()
    (held / "x.json").write_text('{"id": "x", "w": "stone"}')
    config = _config(f"{EX}:WordEnv", (f"{EX}:short_turns",), train_source=str(train),
                     heldout_source=str(held), fields=("task_id=id", "word=w"))  # fmt: skip
    sources = task_data.prepare_tasks(config, str(tmp_path / "work"))
    got = task_data.load_tasks(sources, "train")
    assert [(t["task_id"], t["word"]) for t in got] == [("a", "apple"), ("b", "river")]
    assert [t["word"] for t in task_data.load_tasks(sources, "heldout")] == ["stone"]
    env = make_env(config.env)
    assert "apple" in env.reset(got[0])
    # The dataset's name follows the files' content: a changed file is a new dataset.
    name = task_data.tasks_dataset_name(config)
    train.write_text('{"id": "a", "w": "maple"}\n')
    assert task_data.tasks_dataset_name(config) != name


def test_coding_tasks_from_a_users_file_with_its_own_field_names(tmp_path):
    from tg_jax.data import task_data

    records = [t.to_record() for t in generate_tasks("heldout", 3, seed=5)]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(
        json.dumps({("uid" if k == "task_id" else k): v for k, v in r.items()}) + "\n"
        for r in records
    ))  # fmt: skip
    config = _config("coding", ("fence",), heldout_source=str(path), fields=("task_id=uid",))
    sources = task_data.prepare_tasks(config, str(tmp_path / "work"))
    got = task_data.load_tasks(sources, "heldout")
    assert [t.task_id for t in got] == [r["task_id"] for r in records]
    assert [t.to_record() for t in got] == records
    assert len(task_data.load_tasks(sources, "train")) == 4  # the other split generated


@pytest.mark.parametrize(
    "text, fields, message",
    [
        ('{"id": "a"}\n{"id": "a"}\n', ("task_id=id",), "t.jsonl:2: duplicate task_id 'a'"),
        ('{"id": "a"}\n{"id": \n', ("task_id=id",), "t.jsonl:2: invalid JSON"),
        ('{"name": "a"}\n', (), "t.jsonl:1: no 'task_id' (map one of the task's fields onto it"),
        ('[1, 2]\n', (), "t.jsonl:1: a task must be a JSON object, got list"),
        ('{"id": "a"}\n', ("task_id:id",), "tasks.fields entry 'task_id:id': expected"),
        ('{"id": "a", "task_id": "b"}\n', ("task_id=id",), "field 'task_id' twice"),
    ],
)  # fmt: skip
def test_a_bad_task_file_names_where(tmp_path, text, fields, message):
    from tg_jax.data.task_files import TaskFileError, read_task_source

    path = tmp_path / "t.jsonl"
    path.write_text(text)
    with pytest.raises(TaskFileError) as e:
        list(read_task_source(str(path), fields))
    assert message in str(e.value), str(e.value)
    with pytest.raises(TaskFileError, match="no such file or directory"):
        list(read_task_source(str(tmp_path / "missing.jsonl")))
