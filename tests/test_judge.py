"""Judged requirements (tg_jax.envs.judge) and a checkpoint as the judge (tg_jax.engine.judge)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tg_jax.envs.base import Unjudged
from tg_jax.envs.coding import CodingEnv, CodingEnvConfig
from tg_jax.envs.judge import BatchingJudge, ScriptedJudge, judged_requirement, parse_verdict


@pytest.mark.parametrize(
    "answer, verdict",
    [("yes", True), ("No.", False), ("**Yes**, it is", True), ("  NO\n", False),
     ("<think>maybe no</think>\n\nyes", True), ("Yesterday", None), ("I think yes", None),
     ("", None), ("nope", None), ("\"no\"", False)],
)  # fmt: skip
def test_parse_verdict_reads_the_answers_first_word(answer, verdict):
    assert parse_verdict(answer) is verdict


class _Recorder:
    """A judge that records its batches: a turn is met iff it contains "ok"."""

    def __init__(self, sleep: float = 0.0):
        self.batches: list[list[str]] = []
        self.sleep = sleep
        self.lock = threading.Lock()

    def __call__(self, texts):
        with self.lock:
            self.batches.append(list(texts))
        time.sleep(self.sleep)
        return ["ok" in t for t in texts]


def _from_threads(fn, texts):
    out = [None] * len(texts)

    def run(i):
        try:
            out[i] = fn(texts[i])
        except Unjudged as e:
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_turns_waiting_at_once_are_judged_in_one_batch_and_cached_by_text():
    rec = _Recorder(sleep=0.05)
    judge = BatchingJudge(rec, name="ok", batch_size=16, wait_s=0.5)
    texts = [f"turn {i} " + ("ok" if i % 3 else "bad") for i in range(12)]
    got = _from_threads(judge.verdict, texts)
    assert got == [bool(i % 3) for i in range(12)]
    # 12 threads arrive within the 0.5 s window: far fewer calls than turns, none larger
    # than the batch size, every turn judged exactly once
    assert len(rec.batches) <= 3 and max(map(len, rec.batches)) <= 16
    assert sorted(t for b in rec.batches for t in b) == sorted(texts)
    assert (judge.calls, judge.judged, judge.hits) == (len(rec.batches), 12, 0)
    assert judge(texts[:4]) == [False, True, True, False]  # the cache: no new call
    assert (len(rec.batches), judge.hits) == (judge.calls, 4)


def test_a_batch_never_exceeds_the_batch_size():
    rec = _Recorder()
    judge = BatchingJudge(rec, name="ok", batch_size=3, wait_s=0.3)
    got = _from_threads(judge.verdict, [f"{i} ok" for i in range(10)])
    assert got == [True] * 10 and max(map(len, rec.batches)) <= 3
    assert sum(map(len, rec.batches)) == 10


def test_a_judge_that_hangs_raises_or_miscounts_leaves_turns_unjudged(caplog):
    slow = BatchingJudge(_Recorder(sleep=2.0), name="slow", timeout_s=0.2, wait_s=0.0)
    with pytest.raises(Unjudged, match="no verdict within 0.2 s"):
        slow.verdict("ok")

    calls = []

    def flaky(texts):
        calls.append(list(texts))
        if len(calls) == 1:
            raise RuntimeError("judge server down")
        return [True] * len(texts)

    judge = BatchingJudge(flaky, name="flaky", wait_s=0.0)
    with pytest.raises(Unjudged, match="RuntimeError: judge server down"):
        judge.verdict("a")
    assert judge.verdict("a") is True and len(calls) == 2  # an error is not cached
    short = BatchingJudge(lambda texts: [True], name="short", wait_s=0.3)
    got = _from_threads(short.verdict, ["x", "y", "z"])
    assert all(isinstance(g, Unjudged) for g in got), got
    assert "1 verdicts for" in str(got[0])
    assert any("judge 'flaky'" in r.message for r in caplog.records)


def test_a_judge_that_cannot_tell_is_unjudged_and_not_asked_again():
    rec = []

    def unsure(texts):
        rec.append(list(texts))
        return [None] * len(texts)

    judge = BatchingJudge(unsure, name="unsure", wait_s=0.0)
    for _ in range(2):
        with pytest.raises(Unjudged, match="could not tell"):
            judge.verdict("hmm")
    assert rec == [["hmm"]]


def test_a_scripted_judge_errs_at_its_declared_rates_the_same_way_every_time():
    rule = lambda t: int(t.split()[1]) % 2 == 0  # noqa: E731
    judge = ScriptedJudge(rule, name="even", false_positive=0.1, false_negative=0.25, seed=3)
    texts = [f"turn {i}" for i in range(8000)]
    got = np.asarray(judge(texts))
    truth = np.asarray([rule(t) for t in texts])
    fp, fn = got[~truth].mean(), (~got[truth]).mean()
    # 4000 turns each side: 4 standard errors are 0.019 and 0.027
    assert abs(fp - 0.1) < 0.019 and abs(fn - 0.25) < 0.027, (fp, fn)
    assert judge(texts[::-1]) == list(got[::-1])  # a function of the text, not the order
    other = ScriptedJudge(rule, name="even", false_positive=0.1, false_negative=0.25, seed=4)
    assert other(texts) != list(got)  # the seed picks which turns it gets wrong
    perfect = ScriptedJudge(rule, name="even")
    assert perfect(texts) == list(truth)


def test_a_judged_requirement_judges_an_environments_turns():
    """A judged requirement beside the built-in fence in the coding environment: its verdict
    and its unjudged turns reach the episode summary."""
    judge = BatchingJudge(
        lambda texts: [None if "???" in t else "please" in t for t in texts], name="polite"
    )
    polite = judged_requirement("polite", judge, hint="Reminder: say please.")
    env = CodingEnv(CodingEnvConfig(requirements=("fence",), executor="trusted"))
    env.requirements = (*env.requirements, polite)
    assert env.judge_turn("please run it")[0]["polite"] is True
    assert env.judge_turn("run it")[0]["polite"] is False
    verdicts, unjudged = env.judge_turn("??? run it")
    assert verdicts["polite"] is None and unjudged == ["polite"]
    assert polite.timeout_s == judge.timeout_s + 1.0


@pytest.mark.slow
def test_a_checkpoint_judges_with_its_own_template_as_transformers_decodes(tmp_path):
    """ModelJudge on a small random Qwen3 checkpoint with Qwen3's public template: the prompt
    is the template's (transformers' apply_chat_template ids), each answer is transformers'
    greedy continuation, and the verdict is that answer's first word. 5 turns on 2 slots (the
    engine refills its slots)."""
    import torch
    import transformers

    from tests.hf_checkpoints import make_model_dir
    from tests.test_hf_run import DENSE
    from tg_jax.engine.judge import ModelJudge

    make_model_dir(tmp_path, DENSE)
    rubric = "Is the reply polite?"
    judge = ModelJudge(str(tmp_path), rubric, max_new_tokens=6, slots=2, max_context=256)
    turns = ["def f(x):\n    return x * 3 + 1", "All tests passed.", "f(0) = 4", "Submit.", "x"]
    got = judge(turns)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    stops = model.generation_config.eos_token_id
    for turn, verdict in zip(turns, got, strict=True):
        messages = [{"role": "system", "content": rubric},
                    {"role": "user", "content": judge.prompt.format(turn=turn)}]  # fmt: skip
        ids = tok.apply_chat_template(messages, add_generation_prompt=True,
                                      enable_thinking=False, tokenize=True)  # fmt: skip
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        assert judge.prompt_ids(turn) == ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                                 eos_token_id=stops, pad_token_id=stops[-1])  # fmt: skip
        new = [int(i) for i in out[0, len(ids) :] if int(i) not in stops]
        answer = tok.decode(new)
        assert judge.answers[turn] == answer
        assert verdict is parse_verdict(answer)
