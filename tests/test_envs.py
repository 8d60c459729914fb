"""Tests of the coding environment: tasks, protocol, episodes, hints and expert transcripts."""

import json
import random

import numpy as np
import pytest

from tg_jax.envs.base import HINT_ROLE, EpisodeSummary, weighted_total
from tg_jax.envs.coding import (
    CodingEnv,
    CodingEnvConfig,
    ExecOutcome,
    format_test_result,
    run_candidate,
    run_trusted,
)
from tg_jax.envs.hints import (
    CORRECT_HINTS,
    IRRELEVANT_HINTS,
    WRONG_HINTS,
    FeedbackRates,
    pick_hint,
    pick_hints,
)
from tg_jax.envs.protocol import (
    FENCE_HINT,
    TOOL_JSON_HINT,
    check_fence,
    check_tool_json,
    fence_applies,
    format_turn,
    has_code,
    parse_turn,
)
from tg_jax.envs.tasks import (
    EASY_FAMILIES,
    FAMILIES,
    SPLITS,
    Task,
    generate_tasks,
    make_task,
    split_of,
)
from tg_jax.envs.transcripts import (
    TranscriptConfig,
    make_transcripts,
    replay,
    wrong_guesses,
)

# f(x) = 2*x+3 (a train-split function), visible at 0, 1, 4; hidden includes negatives.
LIN = make_task("t/lin", "lin", (2, 3), [0, 1, 4], [-5, -1, 2, 7])
# f(x) = abs(x)+1, seen at x >= 0 only: the linear guess x+1 passes run_tests, fails submit.
ABS = make_task("t/abs", "abs", (1, 1), [0, 1, 3], [-4, -2, 2, 5])


# ---------------------------------------------------------------- tasks


def test_every_function_is_in_exactly_one_split_and_each_split_has_every_family():
    for fam in FAMILIES.values():
        held = {p for p in fam.grid if split_of(fam.name, p) == "heldout"}
        assert 1 <= len(held) < len(fam.grid) / 2, fam.name
    train = generate_tasks("train", 400, seed=0, families=tuple(FAMILIES))
    heldout = generate_tasks("heldout", 400, seed=0, families=tuple(FAMILIES))
    key = lambda t: (t.family, t.params)
    assert {key(t) for t in train}.isdisjoint({key(t) for t in heldout})
    assert {t.family for t in heldout} == set(FAMILIES)
    assert all(t.split == "train" for t in train) and all(t.split == "heldout" for t in heldout)


def test_dev_split_is_disjoint_from_train_and_heldout():
    key = lambda t: (t.family, t.params)
    for fam in FAMILIES.values():
        dev = {p for p in fam.grid if split_of(fam.name, p) == "dev"}
        assert 1 <= len(dev) < len(fam.grid) / 4, fam.name
    fams = tuple(FAMILIES)
    sets = {s: {key(t) for t in generate_tasks(s, 400, seed=0, families=fams)} for s in SPLITS}
    assert sets["dev"].isdisjoint(sets["train"]) and sets["dev"].isdisjoint(sets["heldout"])
    assert all(split_of(f, p) == "dev" for f, p in sets["dev"])


def test_heldout_set_of_the_default_config_has_100_distinct_functions():
    import os

    from tg_jax import config_files

    path = os.path.join(os.path.dirname(__file__), "..", "configs", "default.py")
    c = config_files.load_config_file(path)
    tasks = c.tasks
    held = generate_tasks("heldout", tasks.num_heldout, tasks.seed, families=tasks.families)
    train = generate_tasks("train", tasks.num_train, tasks.seed, families=tasks.families)
    # The evaluations take the first n held-out tasks: each n covers >= 100 functions.
    for n in (c.sft.eval.num_tasks, c.eval.num_tasks, tasks.num_heldout):
        assert len({t.function_id for t in held[:n]}) >= 100, n
    assert {t.function_id for t in held}.isdisjoint({t.function_id for t in train})
    # Drawn in rounds: balanced over families, no function twice before all were drawn.
    first = held[:100]
    assert len({t.function_id for t in first}) == 100
    assert {t.family: 25 for t in first} == {
        f: sum(t.family == f for t in first) for f in tasks.families
    }
    assert held[0].function_id == f"{held[0].family}:{held[0].params[0]}"


def test_generation_is_deterministic_and_seeded():
    a, b = generate_tasks("train", 30, seed=5), generate_tasks("train", 30, seed=5)
    assert a == b
    assert a != generate_tasks("train", 30, seed=6)
    t = a[0]
    assert t.task_id == "train/5/0" and len(t.visible) == 3 and len(t.hidden) == 8
    assert [x for x, _ in t.visible[:2]] == [0, 1]
    assert not {x for x, _ in t.visible} & {x for x, _ in t.hidden}
    assert all(t.fn(x) == y for x, y in t.visible + t.hidden)


def test_prompt_and_solution_texts():
    assert LIN.prompt == "f(0)=3 f(1)=5 f(4)=11. Write f(x); run_tests, submit."
    assert LIN.solution() == "def f(x): return 2*x+3"
    assert ABS.solution() == "def f(x): return abs(x)+1"
    assert make_task("q", "quad", (-1, 0), [0], [1]).solution() == "def f(x): return -x*x"
    assert make_task("m", "mod", (3, -2), [0], [1]).solution() == "def f(x): return x%3-2"


def test_record_roundtrip_is_json_serialisable():
    for t in generate_tasks("heldout", 20, seed=1):
        rec = json.loads(json.dumps(t.to_record()))
        assert Task.from_record(rec) == t


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda r: r.pop("family"), "missing field 'family'"),
        (lambda r: r.update(family="exp"), "'family'"),
        (lambda r: r.update(params=[2]), "'params'"),
        (lambda r: r.update(params=[True, 3]), "'params'"),
        (lambda r: r.update(task_id=""), "'task_id'"),
        (lambda r: r.update(split="test"), "'split'"),
        (lambda r: r.update(visible=[[0, 4]]), "'visible' has f(0)=4"),
        (lambda r: r.update(hidden="1,2"), "'hidden'"),
        (lambda r: r.update(hidden=[[1, 5, 6]]), "'hidden'"),
    ],
)
def test_bad_records_raise_naming_the_field(mutate, field):
    rec = LIN.to_record()
    mutate(rec)
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(")", r"\)")):
        Task.from_record(rec)


def test_record_with_a_function_from_the_other_split_is_rejected():
    fam, params = next(
        (f.name, p) for f in FAMILIES.values() for p in f.grid if split_of(f.name, p) == "heldout"
    )
    rec = make_task("x", fam, params, [0, 1], [2]).to_record()
    rec["split"] = "train"
    with pytest.raises(ValueError, match="'split'"):
        Task.from_record(rec)


# ---------------------------------------------------------------- protocol and checkers

STRICT = '```python\ndef f(x): return 2*x+3\n```\n<tool_call>{"name": "run_tests"}</tool_call>'
LEGACY = "def f(x): return 2*x+3\nCALL run_tests"


@pytest.mark.parametrize(
    "turn, fence, tool_json, code",
    [
        (STRICT, True, True, True),
        ("<think>lin</think>\n" + STRICT, True, True, True),
        (LEGACY, False, False, True),
        ("```python\ndef f(x): return x\n```\nCALL submit", True, False, True),
        ('def f(x): return x\n<tool_call>{"name":"submit"}</tool_call>', False, True, True),
        ('<tool_call>{"name": "submit"}</tool_call>', False, True, False),
        ("```\ndef f(x): return x\n```\nCALL run_tests", False, False, True),  # no language
        ("```py\ndef f(x): return x\n```\nCALL run_tests", False, False, True),
        ("x = 1\n```python\ndef f(x): return x\n```\nCALL run_tests", False, False, True),
        (
            '```python\ndef f(x): return x\n```\n<tool_call>{"name": run}</tool_call>',
            True,
            False,
            True,
        ),
        (STRICT + '\n<tool_call>{"name": "submit"}</tool_call>', True, False, True),  # two calls
        (STRICT + "\nCALL run_tests", True, False, True),  # legacy line too
        ("CALL submit", False, False, False),
    ],
)
def test_checkers_on_hand_written_turns(turn, fence, tool_json, code):
    assert check_fence(turn) is fence
    assert check_tool_json(turn) is tool_json
    assert has_code(turn) is code


def test_an_empty_fence_is_judged_and_fails():
    # Seen in RL: the policy learns the backticks before the code. Such a turn must count as
    # failing the fence requirement (reward 0, targeted by TG), not as "no code, not judged".
    env = CodingEnv(CodingEnvConfig(executor="trusted"))
    env.reset(make_task("t", "add", (2,), (0, 1, 3), (-2, 4)))
    turn = '<think>add</think>\n````python\n````\n<tool_call>{"name": "submit"}</tool_call>'
    res = env.step(turn)
    assert env.judge(turn) == {"fence": False, "tool_json": True}  # the format alone
    # Nothing to submit: not a valid action, so its well-formed call fails tool_json too.
    assert res.info["verdicts"] == {"fence": False, "tool_json": False}
    assert fence_applies("````python\n````") and not fence_applies("CALL submit")
    assert res.rewards["fence"] == 0.0


@pytest.mark.parametrize(
    "turn, error",
    [
        ("I think the answer is linear.", "error: no tool call (run_tests or submit)"),
        (
            'def f(x): return x\n<tool_call>{"name": run_tests}</tool_call>',
            "error: bad tool_call JSON",
        ),
        ('def f(x): return x\n<tool_call>["run_tests"]</tool_call>', 'needs {"name": ...}'),
        ('<tool_call>{"name": "run_tests"}', "error: <tool_call> is not closed"),
        ("def f(x): return x\nCALL deploy", "error: unknown tool 'deploy'"),
        ('<tool_call>{"name": "rm -rf"}</tool_call>', "error: unknown tool 'rm -rf'"),
        ("<think>hmm... def f(x): return x\nCALL run_tests", "error: <think> is not closed"),
        ("\x00\xff\ud800 garbage", "error: no tool call (run_tests or submit)"),
    ],
)
def test_malformed_turns_parse_to_clear_errors(turn, error):
    p = parse_turn(turn)
    assert p.tool is None and error in p.error


def test_parse_extracts_think_code_and_tool():
    p = parse_turn("<think>abs</think>\n" + STRICT)
    assert (p.think, p.code, p.tool, p.error) == (
        "abs",
        "def f(x): return 2*x+3",
        "run_tests",
        None,
    )
    p = parse_turn(LEGACY)
    assert (p.think, p.code, p.tool) == (None, "def f(x): return 2*x+3", "run_tests")


def test_format_turn_produces_what_the_checkers_accept():
    code = LIN.solution()
    for fence in (False, True):
        for tj in (False, True):
            turn = format_turn(code, "run_tests", fence=fence, tool_json=tj, think="lin")
            assert (check_fence(turn), check_tool_json(turn)) == (fence, tj)
            assert parse_turn(turn).code == code
    assert format_turn(code, "run_tests") == LEGACY
    assert format_turn(code, "run_tests", fence=True, tool_json=True) == STRICT


# ---------------------------------------------------------------- execution


@pytest.mark.parametrize(
    "code, values, error",
    [
        ("def f(x): return 2*x+3", ("3", "5", "11"), None),
        ("def f(x): return 2.0*x+3", ("3", "5", "11"), None),
        ("def f(x): return str(x)", ("'0'", "'1'", "'4'"), None),
        ("def f(x): return 1//x", ("!ZeroDivisionError", "1", "0"), None),
        ("def f(x): return 10**40", ("100000000000..",) * 3, None),
        ("def f(x) return x", None, "SyntaxError line 1"),
        ("def g(x): return x", None, "f is not defined"),
        ("import sys\nsys.exit(3)\ndef f(x): return x", None, "SystemExit: 3"),
        ("print('noise')\ndef f(x):\n    print(x)\n    return x", ("0", "1", "4"), None),
    ],
)
def test_sandbox_and_trusted_executors_agree(code, values, error):
    expected = ExecOutcome(values, error)
    assert run_trusted(code, [0, 1, 4]) == expected
    assert run_candidate(code, [0, 1, 4]) == expected


@pytest.mark.parametrize(
    "code, error",
    [
        ("def f(x):\n    while True: pass", "timeout"),
        ("import os\nos.write(1, b'x' * 10**6)\ndef f(x): return x", "too much output"),
        ("import os\nos._exit(0)", "no result"),
        ("x = bytearray(1 << 30)", "MemoryError"),
        ("import socket\nsocket.socket()", "PermissionError: sandbox: network access"),
    ],
)
def test_sandboxed_candidate_failures(code, error):
    out = run_candidate(code, [0, 1], timeout_s=0.5)
    assert out.values is None and out.error.startswith(error)


def test_format_test_result_texts():
    assert format_test_result(ExecOutcome(("3", "5", "11"), None), LIN.visible) == ("3/3 passed", 3)
    obs, n = format_test_result(ExecOutcome(("3", "4", "9"), None), LIN.visible)
    assert (obs, n) == ("1/3 passed; f(1)=4 expected 5", 1)
    obs, _ = format_test_result(ExecOutcome(("!TypeError", "5", "11"), None), LIN.visible)
    assert obs == "2/3 passed; f(0) raised TypeError"
    obs, _ = format_test_result(ExecOutcome(None, "NameError: name 'y' is not defined" * 3), [])
    assert len(obs) == 60 and obs.startswith("error: NameError")


# ---------------------------------------------------------------- episodes


def _episode(env, task, turns):
    prompt = env.reset(task)
    results = [env.step(t) for t in turns]
    assert all(r.done is (i == len(turns) - 1) for i, r in enumerate(results))
    return prompt, results


def test_correct_legacy_episode():
    env = CodingEnv()
    prompt, (r1, r2) = _episode(env, LIN, [LEGACY, "CALL submit"])
    assert prompt == LIN.prompt
    assert r1.observation == "3/3 passed" and r1.rewards == {"task": 0, "fence": 0, "tool_json": 0}
    assert r2.observation is None and r2.info["tool_output"] == "4/4 hidden tests passed"
    assert r2.rewards == {"task": 1.0, "fence": 0.0, "tool_json": 0.0}
    assert r2.info["summary"] == {
        "verdicts": {"fence": [False, None], "tool_json": [False, False]},
        "actions": {"run_tests": 1, "submit": 1, "malformed": 0},
        "turns": 2,
        "end_reason": "submit",
        "unjudged": {},  # no plug-in checker failed (tg_jax.envs.plugins)
        "rejected": [],  # every turn was accepted
    }


def test_compliant_episode_earns_requirement_rewards():
    env = CodingEnv()
    sub = '<tool_call>{"name": "submit"}</tool_call>'
    _, (r1, r2) = _episode(env, LIN, ["<think>lin</think>\n" + STRICT, sub])
    assert r1.observation == "3/3 passed"
    assert r2.rewards == {"task": 1.0, "fence": 1.0, "tool_json": 1.0}
    assert weighted_total(r2.rewards, env.requirements) == 3.0


def test_wrong_answer_passes_visible_but_fails_hidden_and_fraction_mode():
    turns = ["def f(x): return x+1\nCALL run_tests", "CALL submit"]
    _, (r1, r2) = _episode(CodingEnv(), ABS, turns)
    assert r1.observation == "3/3 passed"
    assert r2.rewards["task"] == 0.0 and r2.info["hidden_passed"] == 2
    env = CodingEnv(CodingEnvConfig(task_reward="fraction"))
    _, (_, r2) = _episode(env, ABS, turns)
    assert r2.rewards["task"] == 0.5


def test_revision_after_failed_tests():
    turns = [
        "def f(x): return 2*x\nCALL run_tests",
        "```python\ndef f(x): return 2*x+3\n```\nCALL submit",
    ]
    _, (r1, r2) = _episode(CodingEnv(), LIN, turns)
    assert r1.observation == "0/3 passed; f(0)=0 expected 3"
    assert r2.rewards == {"task": 1.0, "fence": 0.5, "tool_json": 0.0}
    env = CodingEnv(CodingEnvConfig(requirement_reward="all"))
    _, (_, r2) = _episode(env, LIN, turns)
    assert r2.rewards == {"task": 1.0, "fence": 0.0, "tool_json": 0.0}


def test_malformed_turns_until_the_turn_limit():
    env = CodingEnv(CodingEnvConfig(max_turns=3))
    turns = [
        "\x00\x01 garbage",
        '<tool_call>{"name": run_tests</tool_call>',
        "CALL submit",  # nothing to submit yet
    ]
    _, (r1, r2, r3) = _episode(env, LIN, turns)
    assert r1.observation == "error: no tool call (run_tests or submit)"
    assert r2.observation == "error: bad tool_call JSON"
    assert r3.observation is None and r3.info["tool_output"] == "error: no code to submit"
    assert r3.rewards == {"task": 0.0, "fence": 0.0, "tool_json": 0.0}
    summ = env.summary()
    assert summ.end_reason == "max_turns" and summ.actions["malformed"] == 3
    with pytest.raises(RuntimeError):
        env.step(LEGACY)


def test_a_requirement_met_on_a_rejected_turn_earns_no_reward():
    """The tool_json hack: a well-formed tool call around no code is not a valid action, so the
    environment rejects the turn: its call counts as failing tool_json and earns no reward."""
    env = CodingEnv(CodingEnvConfig(max_turns=3))
    hack = '<tool_call>{"name": "run_tests"}</tool_call>'
    sub = '<tool_call>{"name": "submit"}</tool_call>'
    _, (r1, r2, r3) = _episode(env, LIN, [hack, STRICT, sub])
    assert r1.observation == "error: no code to test"
    summ = env.summary()
    assert summ.verdicts["tool_json"] == [False, True, True] and summ.rejected == [0]
    assert env.judge(hack)["tool_json"] is True  # the format alone is met
    assert r3.rewards == {"task": 1.0, "fence": 1.0, "tool_json": pytest.approx(2 / 3)}
    _, rs = _episode(env, LIN, [hack] * 3)  # only the format, never the work
    assert env.summary().verdicts["tool_json"] == [False] * 3
    assert env.summary().rejected == [0, 1, 2]
    assert rs[-1].rewards == {"task": 0.0, "fence": 0.0, "tool_json": 0.0}


def test_broken_code_gives_error_observations_not_exceptions():
    env = CodingEnv(CodingEnvConfig(max_turns=4, timeout_s=0.5))
    turns = [
        "def f(x) return x\nCALL run_tests",
        "def f(x): return 1//x\nCALL run_tests",
        "def f(x):\n    while True: pass\nCALL run_tests",
        "CALL run_tests",
    ]
    _, rs = _episode(env, LIN, turns)
    assert [r.info["tool_output"] for r in rs] == [
        "error: SyntaxError line 1",
        "0/3 passed; f(0) raised ZeroDivisionError",
        "error: timeout",
        "error: no code to test",
    ]
    assert env.summary().actions == {"run_tests": 3, "submit": 0, "malformed": 1}


def test_single_turn_limit_and_submit_with_code():
    env = CodingEnv(CodingEnvConfig(max_turns=1, requirements=("fence",)))
    _, (r,) = _episode(env, LIN, ["```python\ndef f(x): return 2*x+3\n```\nCALL submit"])
    assert r.rewards == {"task": 1.0, "fence": 1.0}
    _, (r,) = _episode(env, LIN, [LEGACY])
    assert r.done and r.rewards == {"task": 0.0, "fence": 0.0}
    assert env.summary().end_reason == "max_turns"


def test_random_garbage_never_raises():
    rng = random.Random(0)
    env = CodingEnv(CodingEnvConfig(max_turns=50))
    env.reset(LIN)
    pieces = ["```", "python", "<think>", "</think>", "<tool_call>", "</tool_call>", "{", '"name"']
    for _ in range(40):
        text = "".join(rng.choice(pieces + [chr(rng.randrange(0, 0x3000))]) for _ in range(30))
        res = env.step(text.encode("utf-8", "surrogatepass"))
        assert isinstance(res.info["tool_output"], str) and len(res.info["tool_output"]) <= 60


def test_env_config_is_validated():
    with pytest.raises(ValueError):
        CodingEnvConfig(requirements=("explain",))
    with pytest.raises(ValueError):
        CodingEnvConfig(task_reward="partial")
    with pytest.raises(ValueError):
        CodingEnvConfig(max_turns=0)


def test_episode_summary_rewards_and_hint_messages():
    s = EpisodeSummary({"fence": [True, False, None, True]}, {})
    assert s.failed_turns("fence") == [1]
    assert s.requirement_reward("fence") == pytest.approx(2 / 3)
    assert s.requirement_reward("fence", "all") == 0.0
    assert EpisodeSummary({"fence": [None]}, {}).requirement_reward("fence") == 0.0
    # Turn 3 rejected: met there is not rewarded (1 of 3 judged), its verdict still stands.
    r = EpisodeSummary({"fence": [True, False, None, True]}, {}, turns=4, rejected=[3])
    assert r.requirement_reward("fence") == pytest.approx(1 / 3) and r.failed_turns("fence") == [1]
    assert EpisodeSummary({"fence": [True]}, {}, turns=1, rejected=[0]).requirement_reward(
        "fence", "all") == 0.0  # fmt: skip
    with pytest.raises(RuntimeError, match="before any turn"):
        EpisodeSummary({"fence": []}, {}).reject_turn()
    env = CodingEnv()
    assert env.hint_message(["tool_json", "fence"]) == {
        "role": HINT_ROLE,
        "content": FENCE_HINT + "\n" + TOOL_JSON_HINT,
    }


# ---------------------------------------------------------------- imperfect feedback


def test_pick_hint_kinds_rates_and_determinism():
    assert pick_hint("fence", random.Random(0)) == ("correct", CORRECT_HINTS["fence"])
    rates = FeedbackRates(correct=0.5, irrelevant=0.3, wrong=0.2)
    picks = [pick_hint("tool_json", random.Random(7), rates) for _ in range(2)]
    assert picks[0] == picks[1]
    rng = np.random.default_rng(0)
    draws = [pick_hint("tool_json", rng, rates) for _ in range(4000)]
    kinds = [k for k, _ in draws]
    for kind, rate in (("correct", 0.5), ("irrelevant", 0.3), ("wrong", 0.2)):
        assert abs(kinds.count(kind) / len(kinds) - rate) < 0.03
    for kind, text in draws:
        pool = {"correct": [TOOL_JSON_HINT], "irrelevant": IRRELEVANT_HINTS}
        assert text in pool.get(kind, WRONG_HINTS["tool_json"])
    kinds, text = pick_hints(["fence", "tool_json"], random.Random(1))
    assert kinds == ["correct", "correct"] and text == FENCE_HINT + "\n" + TOOL_JSON_HINT
    with pytest.raises(ValueError):
        FeedbackRates(correct=0.5, irrelevant=0.1, wrong=0.1)


# ---------------------------------------------------------------- expert transcripts


def test_wrong_guesses_fail_hidden_tests_and_include_plausible_ones():
    for t in generate_tasks("train", 50, seed=2) + [ABS]:
        guesses = wrong_guesses(t)
        assert guesses
        for fam, params in guesses:
            assert any(FAMILIES[fam].fn(params, x) != y for x, y in t.hidden)
    assert ("lin", (1, 1)) in wrong_guesses(ABS)  # fits every visible example


def test_easy_families_copy_the_constant_and_stay_in_their_set():
    # add b+x, sub b-x, vee b+abs(x), bowl b+x*x: b is f(0), shown in every prompt.
    vee = make_task("t", "vee", (3,), (0, 1, 2), (-4, -1, 5))
    assert vee.visible == ((0, 3), (1, 4), (2, 5)) and vee.hidden == ((-4, 7), (-1, 4), (5, 8))
    assert vee.solution() == "def f(x): return 3+abs(x)"
    assert FAMILIES["sub"].code((-2,)) == "def f(x): return -2-x"
    assert FAMILIES["bowl"].fn((-2,), 3) == 7 and FAMILIES["add"].fn((0,), 5) == 5
    # 3+x fits every visible example of this task and fails the hidden x < 0: the plausible
    # mistake; guesses come from the easy families only.
    guesses = wrong_guesses(vee)
    assert ("add", (3,)) in guesses
    assert {fam for fam, _ in guesses} <= set(EASY_FAMILIES)
    tasks = generate_tasks("heldout", 200, seed=0, families=EASY_FAMILIES)
    assert {t.family for t in tasks} == set(EASY_FAMILIES)
    for t in tasks[:50]:
        assert {fam for fam, _ in wrong_guesses(t)} <= set(EASY_FAMILIES)
        assert dict(t.visible)[0] == t.params[0]  # the constant is in the prompt


def test_unknown_or_empty_families_are_clear_errors():
    with pytest.raises(ValueError, match=r"unknown task families \['cubic'\]"):
        generate_tasks("train", 4, families=("add", "cubic"))
    with pytest.raises(ValueError, match="empty"):
        generate_tasks("train", 4, families=())


def test_transcripts_replay_through_the_sandboxed_env():
    tasks = generate_tasks("train", 12, seed=3)
    cfg = TranscriptConfig(p_hinted=0.5, p_multi_turn=0.9, p_fix=0.5)
    trs = make_transcripts(tasks, seed=0, config=cfg)
    assert [t.messages for t in trs] == [t.messages for t in make_transcripts(tasks, 0, cfg)]
    env = CodingEnv()  # sandbox executor: what RL will use
    for task, tr in zip(tasks, trs, strict=True):
        results = replay(task, tr.messages, env)
        tool_msgs = [m["content"] for m in tr.messages if m["role"] == "tool"]
        assert [r.observation for r in results[:-1]] == tool_msgs
        assert results[-1].done and results[-1].rewards == tr.rewards
        assert tr.rewards["task"] == float(tr.correct)
        # Hinted turns meet exactly the hinted requirements; unhinted turns meet none.
        msgs = tr.messages
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            hint = msgs[i - 1]["content"] if msgs[i - 1]["role"] == HINT_ROLE and i > 1 else ""
            assert check_fence(m["content"]) == (FENCE_HINT in hint)
            assert check_tool_json(m["content"]) == (TOOL_JSON_HINT in hint)
        assert sum(len(m["content"]) for m in msgs) <= cfg.max_chars


def test_transcript_knobs_shape_the_data():
    tasks = generate_tasks("train", 300, seed=4)
    trs = make_transcripts(tasks, seed=1)
    assert 0.62 < np.mean([t.rewards["task"] for t in trs]) < 0.78  # p_correct = 0.7
    assert 0.2 < np.mean([t.hinted for t in trs]) < 0.38  # p_hinted = 0.3
    unhinted = [t for t in trs if not t.hinted]
    assert all(t.rewards["fence"] == 0 and t.rewards["tool_json"] == 0 for t in unhinted)
    n_turns = {sum(m["role"] == "assistant" for m in t.messages) for t in trs}
    assert n_turns == {1, 2, 3}
    assert any("<think>" in m["content"] for t in trs for m in t.messages)
    all_right = make_transcripts(tasks[:40], 0, TranscriptConfig(p_correct=1.0, p_hinted=0.0))
    assert all(t.rewards["task"] == 1.0 and not t.hinted for t in all_right)
    all_wrong = make_transcripts(tasks[:40], 0, TranscriptConfig(p_correct=0.0))
    assert all(t.rewards["task"] == 0.0 for t in all_wrong)
    one_turn = make_transcripts(
        tasks[:40], 0, env_config=CodingEnvConfig(executor="trusted", max_turns=1)
    )
    assert all(len(t.messages) in (2, 3) for t in one_turn)


def test_ignored_hints_keep_the_hint_message_but_not_the_format():
    tasks = generate_tasks("train", 200, seed=5, families=EASY_FAMILIES)

    def hinted_turns(p_ignore):
        cfg = TranscriptConfig(p_hinted=1.0, p_hint_requirement=1.0, p_ignore_hint=p_ignore)
        out = []
        for tr in make_transcripts(tasks, seed=2, config=cfg):
            msgs = tr.messages
            for i, m in enumerate(msgs):
                if m["role"] == "assistant" and msgs[i - 1]["role"] == HINT_ROLE:
                    out.append((FENCE_HINT in msgs[i - 1]["content"], m["content"]))
        return out

    followed = hinted_turns(0.0)
    assert all(check_fence(text) == fence_hinted for fence_hinted, text in followed)
    ignored = hinted_turns(1.0)
    assert ignored and not any(check_fence(t) or check_tool_json(t) for _, t in ignored)
    some = hinted_turns(0.25)
    rate = np.mean([not check_tool_json(t) for _, t in some if "CALL" in t or "tool_call" in t])
    assert 0.15 < rate < 0.35, rate


@pytest.mark.slow
def test_result_parsing_is_safe_from_many_threads():
    # The environment steps of a rollout run in a thread pool, beside the sampling loop's
    # thread; in CPython 3.11 concurrent AST construction can raise SystemError ("AST
    # constructor recursion depth mismatch"), which crashed an RL run. Garbage collection with
    # finalizers inside the AST constructor switches threads there: with bare
    # ast.literal_eval this loop raises it within the first round; coding.literal serialises.
    import concurrent.futures
    import gc
    import sys

    from tg_jax.envs import coding

    class Cyclic:
        def __del__(self):
            sum(range(50))  # Python code run by the collector, a chance to switch threads

    def parse(_):
        junk = [Cyclic() for _ in range(3)]
        for j in junk:
            j.me = j
        del junk
        return coding.literal(text)

    text = repr(([[i, [i, (i, {"k": [i] * 3})]] for i in range(40)], None))
    want = eval(text)  # noqa: S307 - a literal built above
    interval, threshold = sys.getswitchinterval(), gc.get_threshold()
    sys.setswitchinterval(1e-6)
    gc.set_threshold(1, 1, 1)
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = [r for _ in range(3) for r in pool.map(parse, range(300))]
    finally:
        sys.setswitchinterval(interval)
        gc.set_threshold(*threshold)
    assert len(got) == 900 and all(g == want for g in got)
