"""Privilege-drift guard: hint leakage on hand-made turns, in rollouts and in held-out records."""

import jax
import pytest

from tg_jax.envs import leakage
from tg_jax.envs.coding import CodingEnv, CodingEnvConfig
from tg_jax.envs.hints import CORRECT_HINTS
from tg_jax.envs.tasks import generate_tasks
from tg_jax.evaluation import heldout
from tg_jax.sampling.episode import EpisodeRecord
from tg_jax.sampling.rollout import RolloutConfig, evaluate, rollout_groups
from tg_jax.sampling.scripted import ScriptedSampler
from tg_jax.text import ByteTokenizer, ChatRenderer
from tg_jax.train import rl_rollouts

FENCE = CORRECT_HINTS["fence"]  # "Reminder: put code in a ```python block." (7 words)
TOOL = CORRECT_HINTS["tool_json"]  # 'Reminder: use <tool_call>{"name": ...}</tool_call>.' (5)
RENDERER = ChatRenderer(ByteTokenizer())
CONFIG = RolloutConfig(max_new_tokens=160, max_total_tokens=2048)


def test_words_and_ngrams():
    assert leakage.words(FENCE) == ["reminder", "put", "code", "in", "a", "python", "block"]
    assert leakage.ngrams(leakage.words(FENCE)) == {
        ("reminder", "put", "code", "in", "a", "python"),
        ("put", "code", "in", "a", "python", "block"),
    }
    # Shorter than 6 words: the whole hint is the one n-gram.
    assert leakage.ngrams(leakage.words(TOOL)) == {
        ("reminder", "use", "tool_call", "name", "tool_call")
    }
    assert leakage.ngrams([]) == set()


@pytest.mark.parametrize(
    "text, hints, want",
    [
        # The behaviour itself is not leakage: a fenced block shares 1-2 words with the hint.
        ("```python\ndef f(x): return x\n```", [FENCE], False),
        ('<tool_call>{"name": "run_tests"}</tool_call>', [TOOL], False),
        # 6 consecutive hint words, whatever the case and punctuation around them.
        ("OK. Put code in a PYTHON block, as asked.", [FENCE], True),
        ("put code in a python", [FENCE], False),  # 5 of 7 words: no 6-gram
        ("Reminder, use tool_call name tool_call", [TOOL], True),  # the whole short hint
        ("reminder use tool_call name", [TOOL], False),
        # A multi-line hint message: each line is a reference of its own.
        ("put code in a python block", [f"{TOOL}\n{FENCE}"], True),
        ("anything", [], False),
    ],
)
def test_leaks_on_hand_made_turns(text, hints, want):
    assert leakage.leaks(text, hints) is want


def test_leaking_turns_counts_turns_with_per_turn_references():
    turns = [
        "put code in a python block",  # the shared (own) hint
        "keep your lines short please ok",  # only turn 1's teacher hint had these words
        "keep your lines short please ok",  # turn 2's teacher hint did not
        "def f(x): return x",
    ]
    teacher = [[], ["Reminder: keep your lines short please ok."], ["Reminder: small steps."], []]
    assert leakage.leaking_turns(turns, [FENCE]) == 1
    assert leakage.leaking_turns(turns, [FENCE], teacher) == 2
    assert leakage.leaking_turns(turns, [], None) == 0


def _env():
    return CodingEnv(CodingEnvConfig(max_turns=3, requirements=("fence", "tool_json")))


def test_rollout_metric_and_heldout_value():
    tasks = generate_tasks("heldout", 2, seed=0)
    copying = f'{FENCE} def f(x): return x\n<tool_call>{{"name": "run_tests"}}</tool_call>'
    clean = '```python\ndef f(x): return x\n```\n<tool_call>{"name": "run_tests"}</tool_call>'
    script = [copying, clean, clean]
    trajs = rollout_groups(
        ScriptedSampler(RENDERER, script), None, RENDERER, _env, tasks, rollouts_per_task=1,
        config=CONFIG, rng=jax.random.key(0), policy_version=0,
    )  # fmt: skip
    assert [t.info["hint_leaking_turns"] for t in trajs] == [1, 1]
    assert [t.num_turns for t in trajs] == [3, 3]
    m = rl_rollouts.rollout_metrics(trajs)
    assert m["rollout/hint_leakage"] == pytest.approx(2 / 6)
    # A teacher hint picked for a turn is a reference for that turn.
    picked = "Reminder: python def f(x): return x."  # the clean turn's first 6 words
    trajs = rollout_groups(
        ScriptedSampler(RENDERER, [clean] * 3), None, RENDERER, _env, tasks[:1],
        rollouts_per_task=1, config=CONFIG, rng=jax.random.key(0), policy_version=0,
        hint_picker=lambda name, group_id: picked,
    )  # fmt: skip
    assert trajs[0].info["hint_leaking_turns"] == 3
    assert trajs[0].info["turn_hint_texts"] == [{"fence": picked, "tool_json": picked}] * 3
    records, _ = evaluate(
        ScriptedSampler(RENDERER, script), None, RENDERER, _env, tasks, config=CONFIG,
        rng=jax.random.key(0),
    )  # fmt: skip
    assert [r.hint_leaking_turns for r in records] == [1, 1]
    assert records[0].values()["hint_leakage"] == pytest.approx(1 / 3)
    assert heldout.heldout_metrics(records)["heldout/hint_leakage"] == pytest.approx(1 / 3)
    # Round trip, and records written before the guard existed have no leakage value.
    assert EpisodeRecord.from_dict(records[0].to_dict()) == records[0]
    old = records[0].to_dict()
    del old["hint_leaking_turns"]
    assert "hint_leakage" not in EpisodeRecord.from_dict(old).values()
