"""`tg.span` "to_break": where a failed turn breaks its requirement (protocol), which token
holds that character (rollout), and the distillation mask cut after it (batch, RL loop)."""

import os
import random
import types

import numpy as np
import pytest

from tg_jax import config_files
from tg_jax.envs.base import Requirement
from tg_jax.envs.coding import CodingEnv, CodingEnvConfig
from tg_jax.envs.protocol import (
    check_fence,
    check_tool_json,
    fence_breaks_at,
    format_turn,
    make_requirement,
    tool_json_breaks_at,
)
from tg_jax.envs.tasks import FAMILIES, generate_tasks
from tg_jax.rl.batch import build_batch
from tg_jax.rl.tg import break_span
from tg_jax.sampling.scripted import scripted_rollout
from tg_jax.text import ByteTokenizer, ChatRenderer

RENDERER = ChatRenderer(ByteTokenizer())
TASK = generate_tasks("heldout", 1, seed=0)[0]


@pytest.mark.parametrize("name", ["fence", "tool_json"])
def test_the_break_is_where_the_turn_leaves_its_compliant_rewrite(name):
    # A turn written without the requirement breaks it where it stops sharing characters
    # with the same turn written with it: the first code character (fence), the tool call
    # (tool_json), after any thinking block.
    rng = random.Random(0)
    families = sorted(FAMILIES)
    checked = 0
    for _ in range(300):
        fam = rng.choice(families)
        code = FAMILIES[fam].code(rng.choice(FAMILIES[fam].grid))
        tool = rng.choice(["run_tests", "submit"])
        think = rng.choice([None, fam])
        other = rng.random() < 0.5  # the other requirement met or not: irrelevant here
        kw = {"fence": other, "tool_json": other, "think": think}
        bad = format_turn(code, tool, **{**kw, name: False})
        good = format_turn(code, tool, **{**kw, name: True})
        check, breaks_at = {
            "fence": (check_fence, fence_breaks_at),
            "tool_json": (check_tool_json, tool_json_breaks_at),
        }[name]
        assert not check(bad) and check(good)
        assert breaks_at(bad) == len(os.path.commonprefix([bad, good])), (bad, good)
        checked += 1
    assert checked == 300


def test_break_offsets_of_hand_written_turns():
    cases = {
        # fence: a wrong language tag breaks at the tag's first wrong character
        "```py\ndef f(x): return x\n```\nCALL submit": ("fence", 5),
        # ... a tool call before the closing fence, at the call
        "```python\ndef f(x): return x\nCALL submit": ("fence", 29),
        # ... text left outside the block, at that text
        "```python\ndef f(x): return x\n```\nhello\nCALL submit": ("fence", 33),
        # ... an empty block, at its closing fence
        "```python\n```\nCALL submit": ("fence", 10),
        # ... runs of backticks: the fourth one
        "``````````": ("fence", 3),
        # tool_json: a bad JSON payload, at the payload
        'def f(x): return x\n<tool_call>{"name": "sub"}</tool_call>': ("tool_json", 30),
        # ... no call at all: the end of the turn (where the call belonged)
        "def f(x): return x": ("tool_json", 18),
        # ... a CALL line after a good call: at the CALL line
        '<tool_call>{"name": "submit"}</tool_call>\nCALL submit': ("tool_json", 42),
    }
    for text, (name, want) in cases.items():
        req = make_requirement(name)
        assert req.verdict(text) is False, text
        assert req.break_offset(text) == want, (text, req.break_offset(text))
    # An unclosed thinking block: the turn is malformed before any code; no break located.
    assert fence_breaks_at("<think>lin\ndef f(x): return x\nCALL submit") is None
    assert tool_json_breaks_at("<think>lin") is None


def test_requirements_without_a_locator_and_bad_locators():
    plain = Requirement("r", lambda t: False, "hint")
    assert plain.break_offset("abc") is None
    bad = Requirement("r", lambda t: False, "hint", breaks_at=lambda t: len(t) + 1)
    with pytest.raises(ValueError, match="breaks_at gave 4 outside"):
        bad.break_offset("abc")
    env = CodingEnv(CodingEnvConfig(requirements=("fence", "tool_json")))
    text = "def f(x): return x\nCALL submit"
    # Only failed requirements are located; a passing or non-applicable one is not.
    assert env.breaks(text, {"fence": False, "tool_json": False}) == {"fence": 0, "tool_json": 19}
    assert env.breaks(text, {"fence": None, "tool_json": True}) == {}


@pytest.fixture(scope="module")
def bpe_renderer(make_bpe_renderer):
    corpus = [format_turn("def f(x): return 2*x+3", "run_tests", fence=True, tool_json=True)] * 20
    corpus += [format_turn("def f(x): return x", "submit", think="lin")] * 20
    return make_bpe_renderer(corpus, 300)


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_rollout_records_the_token_that_holds_the_break(tokenizer, bpe_renderer):
    renderer = RENDERER if tokenizer == "byte" else bpe_renderer
    tok = renderer.tokenizer
    env = lambda: CodingEnv(CodingEnvConfig(requirements=("fence", "tool_json"), max_turns=3))  # noqa: E731
    turns = [
        "<think>lin</think>\ndef f(x): return 2*x+3\nCALL run_tests",  # breaks both
        '```python\ndef f(x): return x\n```\n<tool_call>{"name": "run_tests"}</tool_call>',
        "```python\ndef f(x): return x\n```\nCALL submit",  # breaks tool_json only
    ]
    traj = scripted_rollout(renderer, env, TASK, turns)
    assert traj.turn_verdicts == [
        {"fence": False, "tool_json": False}, {"fence": True, "tool_json": True},
        {"fence": True, "tool_json": False},
    ]  # fmt: skip
    assert set(traj.turn_breaks[0]) == {"fence", "tool_json"} and traj.turn_breaks[1] == {}
    assert set(traj.turn_breaks[2]) == {"tool_json"}
    header = len(renderer.assistant_header())
    for k, breaks in enumerate(traj.turn_breaks):
        first = int(traj.turn_starts[k]) + header  # the turn's first sampled token
        for name, index in breaks.items():
            off = make_requirement(name).break_offset(turns[k])
            # The tokens before the break token decode to at most `off` characters, and with
            # it to more: it holds character `off`.
            before = tok.decode(traj.tokens[first:index].tolist())
            upto = tok.decode(traj.tokens[first : index + 1].tolist())
            assert len(before) <= off < len(upto), (name, k, before, upto)
            assert traj.turn_ids[index] == k
    # The byte tokenizer: the break tokens are exactly "d" of def and "C" of CALL.
    if tokenizer == "byte":
        get = lambda k, n: tok.decode([int(traj.tokens[traj.turn_breaks[k][n]])])  # noqa: E731
        assert (get(0, "fence"), get(0, "tool_json"), get(2, "tool_json")) == ("d", "C", "C")


def test_a_turn_without_a_call_breaks_at_its_closing_token():
    env = lambda: CodingEnv(CodingEnvConfig(requirements=("tool_json",), max_turns=1))  # noqa: E731
    traj = scripted_rollout(RENDERER, env, TASK, ["def f(x): return x"])
    (index,) = traj.turn_breaks[0].values()
    assert RENDERER.tokenizer.decode([int(traj.tokens[index])]) == "<|im_end|>"


def _batch(trajs, gate="failed_turns", mode="per_trajectory", include_thinking=False):
    return build_batch(trajs, max_len=512, teacher_max_len=768, mode=mode, gate=gate,
                       include_thinking=include_thinking, max_teacher_rows=4,
                       pad_to_multiple=0)  # fmt: skip


@pytest.mark.parametrize("mode", ["per_trajectory", "per_turn"])
def test_cut_keeps_each_targeted_turn_up_to_its_break_token(mode):
    env = lambda: CodingEnv(CodingEnvConfig(requirements=("fence",), max_turns=3))  # noqa: E731
    turns = ["<think>lin</think>\ndef f(x): return 2*x+3\nCALL run_tests",
             "```python\ndef f(x): return x\n```\nCALL run_tests",
             "```py\ndef f(x): return x\n```\nCALL submit"]  # fmt: skip
    traj = scripted_rollout(RENDERER, env, TASK, turns)
    assert [v["fence"] for v in traj.turn_verdicts] == [False, True, False]
    batch = _batch([traj], mode=mode, include_thinking=True)
    cut, removed = break_span.cut_after_breaks(batch, [traj], "failed_turns")
    before, after = np.asarray(batch.tg_mask_BxT)[0], np.asarray(cut.tg_mask_BxT)[0]
    header = len(RENDERER.assistant_header())
    want = np.zeros_like(before)
    decode = lambda i: RENDERER.tokenizer.decode([int(traj.tokens[i])])  # noqa: E731
    for k, char in ((0, "d"), (2, "\n")):  # the first code character; the newline after ```py
        first = int(traj.turn_starts[k]) + header
        last = traj.turn_breaks[k]["fence"]
        assert decode(last) == char
        # Position t predicts token t + 1: the kept targets are tokens first..last.
        want[first - 1 : last] = True
    np.testing.assert_array_equal(after, want)
    assert removed == int(before.sum() - after.sum()) > 0
    assert not (after & ~before).any()
    # The thinking tokens before the break stay in the mask (tg.include_thinking decides).
    assert after[int(traj.turn_starts[0]) + header - 1]
    # Everything else in the batch is unchanged.
    np.testing.assert_array_equal(cut.teacher_tokens_BtxTt, batch.teacher_tokens_BtxTt)


def test_turns_whose_break_is_unknown_stay_whole():
    env = lambda: CodingEnv(CodingEnvConfig(requirements=("fence",), max_turns=1))  # noqa: E731
    traj = scripted_rollout(RENDERER, env, TASK, ["def f(x): return x\nCALL submit"])
    batch = _batch([traj])
    # No breaks recorded (a trajectory from an older run, or a requirement without locator).
    old = types.SimpleNamespace(**{**vars(traj), "turn_breaks": None})
    _, removed = break_span.cut_after_breaks(batch, [old], "failed_turns")
    assert removed == 0
    # gate all_turns targets a requirement that passed the turn: no break, the turn stays.
    env2 = lambda: CodingEnv(CodingEnvConfig(requirements=("fence", "tool_json"), max_turns=1))  # noqa: E731
    traj2 = scripted_rollout(
        RENDERER, env2, TASK, ['def f(x): return x\n<tool_call>{"name": "submit"}</tool_call>']
    )
    assert traj2.turn_verdicts[0] == {"fence": False, "tool_json": True}
    assert break_span.turn_cuts(traj2, "all_turns") == {}
    assert set(break_span.turn_cuts(traj2, "failed_turns")) == {0}


def test_the_rl_loop_applies_the_option_and_the_config_checks_it():
    from tests import rl_loop_driver as driver
    from tg_jax.rl.step_config import TGConfig
    from tg_jax.train import rl

    env = lambda: CodingEnv(CodingEnvConfig(requirements=("fence",), max_turns=1))  # noqa: E731
    text = "def f(x): return 2*x+3\nCALL submit"
    traj = scripted_rollout(RENDERER, env, TASK, [text])
    counts = {}
    for span in ("turn", "to_break"):
        config = config_files.apply_overrides(
            driver.make_config("tg"),
            {"tg.span": span, "rl_loop.length_multiple": 0, "env.requirements": ("fence",)},
        )
        parts = driver.batch_parts(config, 512, 768)
        counts[span] = int(np.asarray(rl._build_batch(parts, [traj], 0).tg_mask_BxT).sum())
    # The whole answer + <|im_end|> vs the first code token only (the break is at offset 0).
    assert counts["turn"] == len(text) + 1 and counts["to_break"] == 1
    with pytest.raises(ValueError, match="span"):
        TGConfig(span="after_break")


@pytest.mark.e2e
def test_users_command_with_the_option(tmp_path):
    # The fence smoke run as a user types it, once per span: the first step samples the same
    # rollouts from the same base (same seeds), and "to_break" distils fewer of their tokens.
    import json

    from tests.test_frozen_teacher_cli import _main

    first_step = {}
    for span in ("turn", "to_break"):
        work = tmp_path / span
        _main("configs/fence.py:runlocal", work, "--config.pipeline.arms=('tg',)",
              f"--config.tg.span={span}")  # fmt: skip
        run = work / "runs" / "tg_seed0"
        assert json.loads((run / "rl_summary.json").read_text())["finished"]
        train = [json.loads(line) for line in open(run / "metrics.jsonl")]
        first_step[span] = next(m for m in train if m.get("stage") == "train" and m["step"] == 1)
    assert (
        first_step["turn"]["cost/sampled_tokens"] == first_step["to_break"]["cost/sampled_tokens"]
    )
    assert 0 < first_step["to_break"]["tg_num_distilled"] < first_step["turn"]["tg_num_distilled"]
