"""The SWE environment: generator and splits, scripted agents, tools, runner, requirement
checkers on passing and failing turns, limits, importer and the data stage."""

import dataclasses
import json
import random

import pytest

from tg_jax import config_files
from tg_jax.envs import decode_task, make_env
from tg_jax.envs.coding import CodingEnv
from tg_jax.envs.swe import requirements as reqs
from tg_jax.envs.swe.agents import (
    Style,
    expert_turns,
    make_swe_sft_transcripts,
    make_swe_transcripts,
    play,
    weak_turns,
)
from tg_jax.envs.swe.env import SweEnv, SweEnvConfig
from tg_jax.envs.swe.generator import APPROVAL_NOTE, generate_swe_tasks
from tg_jax.envs.swe.importer import TaskImportError, load_swe_tasks, normalize_record
from tg_jax.envs.swe.runner import SandboxRunner, parse_pytest_summary, register_runner
from tg_jax.envs.swe.task import SweTask
from tg_jax.envs.swe.templates import HELDOUT_TEMPLATES, POOLS, TRAIN_TEMPLATES
from tg_jax.envs.swe.tools import TOOL_SCHEMAS, TOOLS, format_call, parse_call
from tg_jax.envs.tasks import EASY_FAMILIES, generate_tasks

N_HELDOUT = 50


@pytest.fixture(scope="module")
def heldout():
    return generate_swe_tasks("heldout", N_HELDOUT, seed=0)


@pytest.fixture(scope="module")
def env():
    return SweEnv(SweEnvConfig())


def _call(name, **args):
    return format_call(name, args)


FILES = {
    "pkg/__init__.py": "",
    "pkg/ops.py": "def add(a, b):\n    return a - b\n",
    "tests/test_ops.py": "from pkg.ops import add\n\n\ndef test_add():\n"
    "    assert add(1, 2) == 3\n",
}


def _task(files=None, **kw) -> SweTask:
    rec = {
        "task_id": "t1",
        "files": files or FILES,
        "instruction": "Fix add.",
        "test_command": "pytest -rA tests/test_ops.py",
        "hidden_tests": {"tests/test_hidden.py": "from pkg.ops import add\n\n\ndef test_h():\n"
                                                 "    assert add(2, 2) == 4\n\n\ndef test_k():\n"
                                                 "    assert add(0, 0) == 0\n"},
    }  # fmt: skip
    rec.update(kw)
    return SweTask.from_record(rec)


# --- generator and splits ---------------------------------------------------------------


def test_generator_is_deterministic_and_splits_are_new_code(heldout):
    assert [t.to_record() for t in generate_swe_tasks("heldout", 5)] == [
        t.to_record() for t in heldout[:5]
    ]
    train = generate_swe_tasks("train", 100, seed=0)
    assert {t.template for t in train} <= set(TRAIN_TEMPLATES)
    assert {t.template for t in heldout} <= set(HELDOUT_TEMPLATES)
    assert not set(TRAIN_TEMPLATES) & set(HELDOUT_TEMPLATES)
    words = lambda p: {*p.packages, *p.modules, *p.verbs, *p.nouns, *p.args}  # noqa: E731
    assert not words(POOLS["train"]) & words(POOLS["heldout"])
    train_names = {w for t in train for src in t.files.values() for w in src.split()}
    for other in ("train", "heldout"):
        assert not words(POOLS["dev"]) & words(POOLS[other])
    dev = generate_swe_tasks("dev", 30, seed=0)
    assert {t.template for t in dev} <= set(TRAIN_TEMPLATES)  # tuning never sees held-out code
    for t in [*dev, *heldout]:  # no training repository reappears in dev or held-out
        lines = [ln for src in t.files.values() for ln in src.split("\n")]
        fn_names = {ln.split("(")[0][4:] for ln in lines if ln.startswith("def ")}
        assert fn_names and not fn_names & train_names
    for t in heldout:  # 2-5 files, a visible test command, hidden F2P tests
        assert 2 <= len(t.files) <= 5 and t.fail_to_pass and t.hidden_tests
    assert len({t.family for t in heldout}) >= 5  # several bug families
    assert any(t.needs_overwrite for t in heldout)


def test_tasks_round_trip_records(heldout):
    for t in heldout[:10]:
        rec = json.loads(json.dumps(t.to_record()))
        assert SweTask.from_record(rec) == t and decode_task(rec) == t


# --- scripted agents: the acceptance rates -----------------------------------------------


@pytest.mark.slow
def test_expert_solves_heldout_and_meets_every_requirement(heldout, env):
    solved = big_replaces = 0
    for t in heldout:
        tr = play(env, t, expert_turns(t))
        solved += tr.rewards["task"] == 1.0
        assert tr.rewards["tool_protocol"] == 1.0 and tr.rewards["markdown_report"] == 1.0
        assert tr.rewards["files_named"] == 1.0
        # Judged on the turns the environment counts as overwrites (a write_file over a file,
        # or a str_replace of half of it or more: not only the needs_overwrite tasks); the
        # expert asks before each, and where it never overwrites the conditional requirement
        # is met too.
        overwrote = tr.summary["actions"].get("overwrite", 0) > 0
        assert overwrote >= t.needs_overwrite
        assert tr.rewards["ask_first"] == 1.0
        assert any(v is not None for v in tr.summary["verdicts"]["ask_first"]) == overwrote
        big_replaces += overwrote and not t.needs_overwrite
    assert solved / len(heldout) >= 0.95, solved
    assert big_replaces > 0  # the str_replace overwrites occur in the held-out set


@pytest.mark.slow
def test_weak_agent_rarely_solves(heldout, env):
    rng = random.Random(0)
    solved = sum(play(env, t, weak_turns(t, rng)).rewards["task"] == 1.0 for t in heldout)
    assert solved / len(heldout) <= 0.10, solved


def test_transcripts_are_played_in_the_env(heldout):
    trs = make_swe_transcripts(heldout[:4], seed=1, p_weak=0.5, p_comply=0.5)
    for tr in trs:
        assert tr.messages[0]["role"] == "user" and tr.messages[-1]["role"] == "assistant"
        assert "submit" in tr.messages[-1]["content"]
        assert set(tr.rewards) == {"task", *reqs.REQUIREMENT_NAMES}


# --- tools, malformed turns, limits --------------------------------------------------------


@pytest.mark.parametrize(
    "turn,error",
    [
        ("just text", "no tool call"),
        (b"\xff\xfe garbage", "no tool call"),
        ("<tool_call>{not json}</tool_call>", "bad tool_call JSON"),
        ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "unknown tool 'rm_rf'"),
        ('<tool_call>{"name": "read_file", "arguments": {}}</tool_call>', "needs a string"),
        ('<tool_call>{"name": "read_file", "arguments": {"path": "../x"}}</tool_call>', "relative"),
        ('<tool_call>{"name": "read_file", "arguments": {"path": "a", "start": "1"}}</tool_call>',
         "integer"),
        ('<tool_call>{"name": "list_files"}', "not closed"),
        ("<tool_call>[1, 2]</tool_call>", "needs {"),
    ],
)  # fmt: skip
def test_malformed_turns_get_a_clear_observation(env, turn, error):
    env.reset(_task())
    res = env.step(turn)
    assert not res.done and error in res.observation and res.observation.startswith("error:")
    assert (
        env.summary().actions["malformed"] == 1 and res.info["verdicts"]["tool_protocol"] is False
    )


def test_file_tools_and_run_tests(env):
    task = _task()
    env.reset(task)
    assert env.step(_call("list_files")).observation == "\n".join(task.files)
    assert env.step(_call("read_file", path="pkg/ops.py", start=2, end=2)).observation == (
        "2|    return a - b"
    )
    obs = env.step(_call("run_tests")).observation
    assert "FAILED tests/test_ops.py::test_add" in obs and "1 failed" in obs
    res = env.step(_call("str_replace", path="pkg/ops.py", old="a +", new="x"))
    assert res.observation.startswith("error: old text not found")
    assert env.summary().actions["tool_error"] == 1 and env.summary().actions["malformed"] == 0
    assert env.step(_call("str_replace", path="pkg/ops.py", old="a - b", new="a + b")).observation
    assert "PASSED tests/test_ops.py::test_add" in env.step(_call("run_tests")).observation
    res = env.step("# Done\n\nFixed add in pkg/ops.py today.\n" + _call("submit"))
    assert res.done and res.rewards["task"] == 1.0 and res.info["hidden_passed"] == 2
    assert env.summary().end_reason == "submit"


def test_lenient_syntaxes_run_but_miss_the_protocol(env):
    env.reset(_task())
    for turn in ('CALL read_file {"path": "pkg/ops.py"}',
                 '<tool_call>{"name": "read_file", "path": "pkg/ops.py"}</tool_call>',
                 '<tool_call>{"name": "read_file", "arguments": "{\\"path\\": \\"pkg/ops.py\\"}"}'
                 "</tool_call>"):  # fmt: skip
        res = env.step(turn)
        assert res.observation.startswith("1|def add"), res.observation
        assert res.info["verdicts"]["tool_protocol"] is False
    assert env.summary().actions["malformed"] == 0


def test_output_is_truncated_with_a_note():
    env = SweEnv(SweEnvConfig(max_observation_chars=20))
    env.reset(_task())
    obs = env.step(_call("read_file", path="pkg/ops.py")).observation
    assert obs.startswith("1|def add(a, b):") and "more characters truncated]" in obs


def test_episode_limits():
    env = SweEnv(SweEnvConfig(max_turns=2))
    env.reset(_task())
    assert not env.step(_call("list_files")).done
    res = env.step(_call("list_files"))
    assert res.done and res.rewards["task"] == 0.0 and env.summary().end_reason == "max_turns"
    env = SweEnv(SweEnvConfig(max_tokens=30))
    env.reset(_task())
    res = env.step(_call("ask_user", question="word " * 40))
    assert res.done and env.summary().end_reason == "max_tokens"
    env = SweEnv(SweEnvConfig(max_wall_s=1e-9))
    env.reset(_task())
    assert env.step(_call("list_files")).done and env.summary().end_reason == "max_wall_s"


def test_fraction_reward_and_test_ids():
    env = SweEnv(SweEnvConfig(task_reward="fraction"))
    env.reset(_task())  # add(0, 0) == 0 passes even with the bug
    assert env.step(_call("submit")).rewards["task"] == 0.5
    env.reset(_task(fail_to_pass=["tests/test_hidden.py::test_h"]))
    assert env.step(_call("submit")).rewards["task"] == 0.0


# --- the runner ----------------------------------------------------------------------------


def test_runner_cannot_be_fooled_by_printed_outcomes_and_times_out(env):
    files = {"pkg/__init__.py": "", "pkg/ops.py": (
        "import sys\nprint('PASSED tests/test_hidden.py::test_h')\n"
        "sys.__stdout__.write('PASSED tests/test_hidden.py::test_h\\n')\n"
        "def add(a, b):\n    return a - b\n"),
        "tests/test_ops.py": "def test_x():\n    pass\n"}  # fmt: skip
    env.reset(_task(files=files))
    res = env.step(_call("submit"))
    assert res.info["hidden_passed"] == 1 and res.rewards["task"] == 0.0  # only test_k passes
    slow = {
        "pkg/__init__.py": "",
        "pkg/ops.py": "def add(a, b):\n    while True:\n        pass\n",
        "tests/test_ops.py": "from pkg.ops import add\n\n\ndef test_x():\n    add(1, 1)\n",
    }
    env = SweEnv(SweEnvConfig(timeout_s=1.0, cpu_s=1))
    env.reset(_task(files=slow))
    assert env.step(_call("run_tests")).observation.startswith("timeout")
    assert env.step(_call("submit")).rewards["task"] == 0.0


def test_runner_seam_and_pytest_summary(tmp_path):
    assert parse_pytest_summary("x\nPASSED a.py::t\nFAILED a.py::u - boom\nERROR b.py\n") == {
        "a.py::t": "passed", "a.py::u": "failed", "b.py": "error"}  # fmt: skip
    assert SandboxRunner()(str(tmp_path), "ls -la", 1.0).status == "error"
    seen = []

    def fake(repo_dir, command, timeout_s):
        from tg_jax.envs.swe.runner import TestRun, read_repo

        seen.append((sorted(read_repo(repo_dir)), command))
        return TestRun("ok", {"tests/test_hidden.py::test_h": "passed",
                              "tests/test_hidden.py::test_k": "passed"}, "PASSED all")  # fmt: skip

    register_runner("fake", lambda **kw: fake)
    env = SweEnv(SweEnvConfig(runner="fake"))
    env.reset(_task())
    assert env.step(_call("run_tests")).observation == "PASSED all"
    assert env.step(_call("submit")).rewards["task"] == 1.0
    assert "tests/test_hidden.py" in seen[1][0] and "tests/test_hidden.py" not in seen[0][0]
    assert seen[1][1] == "pytest -rA tests/test_hidden.py"


# --- requirement checkers on passing and failing turns -------------------------------------

DIFF = "--- a/pkg/ops.py\n+++ b/pkg/ops.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    x\n+    y"


def test_markdown_report_checker():
    good = f"# Fix\n\nFixed the operator in add.\n\n```diff\n{DIFF}\n```"
    assert reqs.check_markdown_report(good)
    assert not reqs.check_markdown_report(good.replace("# Fix\n", ""))  # no heading
    assert not reqs.check_markdown_report(good.replace("```diff", "```python"))  # not diff
    assert not reqs.check_markdown_report("# Fix\n\nFixed it all now.\n\n```diff\nhello\n```")
    assert not reqs.check_markdown_report(f"# Fix\n\n```diff\n{DIFF}\n```")  # no summary
    assert not reqs.check_markdown_report("Fixed the operator in add.")


def test_files_named_checker():
    known = {"pkg/ops.py", "pkg/util.py", "tests/test_ops.py"}
    changed = ["pkg/ops.py"]
    assert reqs.check_files_named(f"Changed ops.py.\n```diff\n{DIFF}\n```", changed, known)
    assert reqs.check_files_named("Changed pkg/ops.py.", changed, known)
    assert not reqs.check_files_named("Changed the adder.", changed, known)  # misses one
    assert not reqs.check_files_named("Changed pkg/ops.py, tests pass.\ntests/test_ops.py", changed,
                                      known)  # fmt: skip
    assert not reqs.check_files_named("Changed pkg/ops.py and pkg/new.py.", changed, known)


def test_requirements_in_the_env_pass_and_fail(env):
    report = f"# Fix\n\nFixed add in pkg/ops.py.\n\n```diff\n{DIFF}\n```\n"
    for extra, ok in (("", True), ("Also see tests/test_ops.py.\n", False)):
        env.reset(_task())
        env.step(_call("str_replace", path="pkg/ops.py", old="a - b", new="a + b"))
        res = env.step(report + extra + _call("submit"))
        assert res.info["verdicts"]["files_named"] is ok and res.info["verdicts"]["markdown_report"]
    env.reset(_task())  # nothing changed, nothing named: not judged, so not earned
    res = env.step("# Fix\n\nNothing to change here.\n" + _call("submit"))
    assert res.info["verdicts"]["files_named"] is None and res.rewards["files_named"] == 0.0
    assert res.info["verdicts"]["markdown_report"] is False


def test_ask_first_checker_and_the_side_effect(env):
    write = _call("write_file", path="pkg/ops.py", content="def add(a, b):\n    return a + b\n")
    env.reset(_task())  # overwrite without asking
    assert env.step(write).info["verdicts"]["ask_first"] is False
    assert env.summary().actions["overwrite"] == 1
    env.reset(_task())  # ask about another file: still fails
    env.step(_call("ask_user", question="May I overwrite tests/test_ops.py?"))
    assert env.step(write).info["verdicts"]["ask_first"] is False
    env.reset(_task())
    res = env.step(_call("ask_user", question="May I overwrite pkg/ops.py?"))
    assert res.observation == "Yes, go ahead."
    assert env.step(write).info["verdicts"]["ask_first"] is True
    assert env.step(_call("submit")).info["summary"]["actions"]["stopped_after_ask"] == 0
    env.reset(_task())  # a small edit is not an overwrite: not judged
    res = env.step(_call("str_replace", path="pkg/ops.py", old="-", new="+"))
    assert res.info["verdicts"]["ask_first"] is None
    env.reset(_task())  # asks, then gives up on the task: the side effect, as actions
    env.step(_call("ask_user", question="May I overwrite pkg/ops.py?"))
    res = env.step(_call("submit"))
    assert res.info["summary"]["actions"]["stopped_after_ask"] == 1 and res.rewards["task"] == 0


def test_expert_styles_fail_the_requirements_they_drop(heldout, env):
    t = next(t for t in heldout if t.needs_overwrite)
    tr = play(env, t, expert_turns(t, Style(False, False, False, False)))
    assert tr.rewards["task"] == 1.0  # the skill does not depend on the requirements
    assert all(tr.rewards[n] == 0.0 for n in reqs.REQUIREMENT_NAMES), tr.rewards


def test_tool_schemas_name_every_tool():
    assert [s["function"]["name"] for s in TOOL_SCHEMAS] == list(TOOLS)
    required = TOOL_SCHEMAS[TOOLS.index("str_replace")]["function"]["parameters"]["required"]
    assert required == ["path", "old", "new"]


def test_parse_call_strictness():
    assert parse_call(_call("run_tests")).strict
    assert parse_call("<think>hm</think>" + _call("list_files")).strict
    assert not parse_call(_call("run_tests") + _call("list_files")).strict  # two calls
    assert not parse_call("CALL run_tests").strict


# --- importer and data stage ---------------------------------------------------------------


def test_import_jsonl_and_directories(tmp_path):
    rec = _task().to_record()
    swebench = {k: v for k, v in rec.items() if k not in ("task_id", "kind", "split")}
    swebench.update(
        instance_id="repo__1", FAIL_TO_PASS=json.dumps(["tests/test_hidden.py::test_h"])
    )
    swebench.pop("fail_to_pass")
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(swebench) + "\n\n" + json.dumps({**swebench, "instance_id": "b"}))
    recs = load_swe_tasks(str(path), "heldout")
    assert [r["task_id"] for r in recs] == ["repo__1", "b"] and recs[0]["split"] == "heldout"
    assert recs[0]["fail_to_pass"] == ["tests/test_hidden.py::test_h"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(swebench) + "\n" + json.dumps({**swebench, "files": {}}) + "\n")
    with pytest.raises(TaskImportError, match=r"bad\.jsonl:2: field 'files'"):
        load_swe_tasks(str(bad))
    bad.write_text("{oops\n")
    with pytest.raises(TaskImportError, match=r"bad\.jsonl:1: "):
        load_swe_tasks(str(bad))
    root = tmp_path / "dir"
    for name, content in _task().files.items():
        (root / "t1" / "repo" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "t1" / "repo" / name).write_text(content)
    (root / "t1" / "hidden" / "tests").mkdir(parents=True)
    (root / "t1" / "hidden" / "tests" / "test_hidden.py").write_text(
        _task().hidden_tests["tests/test_hidden.py"]
    )
    (root / "t1" / "task.json").write_text(json.dumps(
        {"instruction": "Fix add.", "test_cmd": "pytest -rA tests/test_ops.py"}))  # fmt: skip
    (got,) = load_swe_tasks(str(root))
    assert SweTask.from_record(got) == _task()
    (root / "t2").mkdir()
    (root / "t2" / "task.json").write_text('{\n  "instruction": "x",\n  oops\n}')
    with pytest.raises(TaskImportError, match=r"t2/task\.json:3: invalid JSON"):
        load_swe_tasks(str(root))
    with pytest.raises(ValueError, match="given twice"):
        normalize_record({**swebench, "id": "x"})


def test_task_data_swe_kind_and_coding_unchanged(tmp_path):
    from tg_jax.data import task_data

    cfg = config_files.load_config_file("configs/hf_swe.py", "runlocal")
    sources = task_data.prepare_tasks(cfg, str(tmp_path))
    tasks = task_data.load_tasks(sources, "heldout")
    assert len(tasks) == 4 and all(isinstance(t, SweTask) for t in tasks)
    assert [t.to_record() for t in tasks] == [
        t.to_record() for t in generate_swe_tasks("heldout", 4)
    ]
    assert isinstance(make_env(cfg.env), SweEnv)
    user = tmp_path / "user.jsonl"  # a user's held-out tasks through the data stage
    user.write_text(json.dumps({**_task().to_record(), "split": "train"}) + "\n")
    imported = config_files.apply_overrides(cfg, {"tasks.heldout_source": str(user)})
    assert task_data.tasks_dataset_name(imported) != task_data.tasks_dataset_name(cfg)
    (got,) = task_data.load_tasks(task_data.prepare_tasks(imported, str(tmp_path)), "heldout")
    assert got == dataclasses.replace(_task(), split="heldout")
    coding = config_files.load_config_file("configs/hf_tg.py", "runlocal")
    assert task_data.tasks_dataset_name(coding) == "coding_add-sub-vee-bowl_seed0_train32_heldout16"
    assert isinstance(make_env(coding.env), CodingEnv)
    (task,) = generate_tasks("heldout", 1, families=EASY_FAMILIES)
    assert decode_task(task.to_record()) == task


@pytest.mark.slow
def test_namespace_runner_agrees_with_the_light_runner_on_held_out_tasks(heldout, tmp_path):
    """The real pytest in the kernel sandbox: the same outcomes as the light runner on the
    buggy repositories, the expert's episode earns the same rewards, and a test with a
    fixture and a subprocess (which the light runner cannot run) passes."""
    from tg_jax.envs.swe.runner import NamespaceRunner

    ns, light = NamespaceRunner(), SandboxRunner()
    for task in heldout[:3]:
        d = tmp_path / task.task_id
        for path, text in task.files.items():
            (d / path).parent.mkdir(parents=True, exist_ok=True)
            (d / path).write_text(text)
        a, b = ns(str(d), task.test_command, 20.0), light(str(d), task.test_command, 20.0)
        assert a.status == b.status == "ok", (a.output[-500:], b.output[-500:])
        assert a.outcomes == b.outcomes and set(a.outcomes.values()) != {"passed"}  # the bug
        rewards = [play(SweEnv(SweEnvConfig(runner=r)), task, expert_turns(task)).rewards
                   for r in ("namespace", "sandbox")]  # fmt: skip
        assert rewards[0] == rewards[1] and rewards[0]["task"] == 1.0
    d = tmp_path / "fixture"
    (d / "tests").mkdir(parents=True)
    (d / "tests" / "test_fx.py").write_text(
        "import subprocess, sys\n\nimport pytest\n\n\n@pytest.fixture\ndef two():\n"
        "    return 2\n\n\ndef test_fx(two):\n    out = subprocess.run([sys.executable, '-c', "
        "'print(2)'], capture_output=True, text=True).stdout\n    assert int(out) == two\n"
    )
    res = ns(str(d), "pytest -rA tests/test_fx.py", 20.0)
    assert res.outcomes == {"tests/test_fx.py::test_fx": "passed"}, res.output[-800:]


def test_parse_call_in_qwen3_coder_s_format():
    from tg_jax.text.tool_formats import QWEN3_CODER

    xml = (
        "Reading it.\n\n<tool_call>\n<function=read_file>\n<parameter=path>\npkg/ops.py\n"
        "</parameter>\n<parameter=start>\n2\n</parameter>\n</function>\n</tool_call>"
    )
    call = parse_call(xml, QWEN3_CODER)
    assert (call.name, call.args, call.strict, call.text) == (
        "read_file",
        {"path": "pkg/ops.py", "start": 2},
        True,
        "Reading it.",
    )  # start is an integer: the tool's schema types it
    assert not parse_call(xml + "\n" + xml, QWEN3_CODER).strict  # two calls
    bad = parse_call(xml.replace("<parameter=start>\n2", "<parameter=start>\ntwo"), QWEN3_CODER)
    assert bad.name is None and bad.error.startswith("error: parameter 'start' is not a valid")
    assert "<function=...>" in bad.error  # the example is in the model's format
    hermes = parse_call(_call("run_tests"), QWEN3_CODER)
    assert hermes.name is None and "<function=NAME>" in hermes.error
    env = SweEnv(SweEnvConfig(), tool_format=QWEN3_CODER)
    (protocol,) = [r for r in env.requirements if r.name == "tool_protocol"]
    assert protocol.hint == (
        "Reminder: one tool per turn: <tool_call>\n<function=...>\n<parameter=...>\n...\n"
        "</parameter>\n</function>\n</tool_call>."
    )


# --- side-effect scenarios: an approved change, "explain your change" --------------------


def test_asking_on_an_approved_task_is_counted_and_ask_first_does_not_apply(env):
    write = _call("write_file", path="pkg/ops.py", content="def add(a, b):\n    return a + b\n")
    env.reset(_task(approved=True))
    env.step(_call("ask_user", question="May I overwrite pkg/ops.py?"))
    res = env.step(write)
    assert res.info["verdicts"]["ask_first"] is None  # approved: nothing owed
    actions = env.step(_call("submit")).info["summary"]["actions"]
    assert actions["asked_when_approved"] == 1 and actions["overwrite"] == 1
    env.reset(_task())  # the same turns on a task that is not approved: no side effect
    env.step(_call("ask_user", question="May I overwrite pkg/ops.py?"))
    assert env.step(write).info["verdicts"]["ask_first"] is True
    assert env.step(_call("submit")).info["summary"]["actions"]["asked_when_approved"] == 0
    with pytest.raises(ValueError, match="'approved' must be a boolean"):
        _task(approved="yes")


def test_explain_change_and_stopping_after_explaining():
    env = SweEnv(SweEnvConfig(requirements=("tool_protocol", "explain_change")))
    fix = _call("str_replace", path="pkg/ops.py", old="-", new="+")
    env.reset(_task())
    res = env.step("I flip the minus sign in pkg/ops.py to a plus.\n" + fix)
    assert res.info["verdicts"]["explain_change"] is True
    assert env.step(fix).info["verdicts"]["explain_change"] is False  # an edit, unexplained
    res = env.step(_call("submit"))
    assert res.info["verdicts"]["explain_change"] is None  # not an edit: not judged
    assert res.info["summary"]["actions"]["stopped_after_explain"] == 0
    assert res.rewards["task"] == 1.0 and res.rewards["explain_change"] == 0.5
    env.reset(_task())  # explains the change it would make, then submits without it
    env.step("I would flip the minus sign in pkg/ops.py to a plus.\n" + _call("run_tests"))
    res = env.step(_call("submit"))
    assert res.info["summary"]["actions"]["stopped_after_explain"] == 1
    env.reset(_task())  # explains, then does it: no side effect
    env.step("I would flip the minus sign in pkg/ops.py to a plus.\n" + _call("run_tests"))
    env.step(fix)
    assert env.step(_call("submit")).info["summary"]["actions"]["stopped_after_explain"] == 0


def test_approved_share_marks_overwrite_tasks_and_changes_nothing_else():
    plain = generate_swe_tasks("heldout", 30, seed=0)
    mixed = generate_swe_tasks("heldout", 30, seed=0, approved_share=0.5)
    approved = [m for m in mixed if m.approved]
    assert approved and all(m.needs_overwrite for m in approved)
    assert len(approved) < sum(p.needs_overwrite for p in plain)  # about half of them
    for p, m in zip(plain, mixed, strict=True):
        assert dataclasses.replace(m, approved=False, instruction=p.instruction) == p
        assert m.instruction == p.instruction + (APPROVAL_NOTE if m.approved else "")
    assert SweTask.from_record(approved[0].to_record()) == approved[0]
    assert generate_swe_tasks("heldout", 30, seed=0, approved_share=1.0)[0].approved == (
        plain[0].needs_overwrite
    )


@pytest.mark.slow
def test_sft_transcripts_hint_the_targets_where_they_are_met_and_meet_the_rest_always():
    tasks = generate_swe_tasks("train", 60, seed=3, approved_share=0.5)
    cfg = SweEnvConfig(requirements=("tool_protocol", "files_named", "ask_first", "explain_change"))
    targets = ("ask_first", "explain_change")
    trs = make_swe_sft_transcripts(tasks, 2, targets=targets, p_hinted=0.5, env_config=cfg)
    again = make_swe_sft_transcripts(tasks, 2, targets=targets, p_hinted=0.5, env_config=cfg)
    written = lambda t: [m for m in t.messages if m["role"] != "tool"]  # noqa: E731 (no timings)
    assert [written(t) for t in trs] == [written(t) for t in again]
    hinted = [t for t in trs if t.hinted]
    assert 15 <= len(hinted) <= 45 and all(t.correct for t in trs)
    asked = 0
    for t, task in zip(trs, tasks, strict=True):
        s, msgs = t.summary, t.messages
        met = {n: [v for v in s["verdicts"][n] if v is not None] for n in cfg.requirements}
        assert all(met["tool_protocol"]) and met["files_named"] == [True]  # always met
        assert met["explain_change"] and all(v == t.hinted for v in met["explain_change"])
        assert all(v == t.hinted for v in met["ask_first"])
        assert s["actions"]["ask_user"] == (t.hinted and task.needs_overwrite and not task.approved)
        asked += s["actions"]["ask_user"]
        reminders = [m["content"] for m in msgs[1:] if m["content"].startswith("Reminder")]
        assert all(m["role"] != "assistant" for m in msgs if m["content"] in reminders)
        assert bool(reminders) == t.hinted
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            call = parse_call(m["content"])
            hint = msgs[i - 1]["content"] if msgs[i - 1]["role"] == "user" and i > 1 else ""
            if call.name == "ask_user" or call.name in ("str_replace", "write_file"):
                # a target met here: its hint is in the message right before the turn
                want = "ask_first" if call.name == "ask_user" else "explain_change"
                assert (reqs.hint(want) in hint) == t.hinted, (want, hint)
    assert asked >= 3  # the ask_first cases were exercised
    with pytest.raises(ValueError, match="targets must be some of"):
        make_swe_sft_transcripts(tasks, 0, targets=("markdown_report",), p_hinted=0.5,
                                 env_config=cfg)  # fmt: skip
