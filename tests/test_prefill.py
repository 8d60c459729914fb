"""The prefill diagnostic (`python -m tg_jax.evaluation.prefill`): the first answer opens with
the given text, forced, and nothing else changes; and the user's command end to end."""

import json
import os

import jax
import numpy as np
import pytest

from tg_jax import config_files
from tg_jax.evaluation import prefill
from tg_jax.sampling.sampler import SampleResult
from tg_jax.text import ByteTokenizer, ChatRenderer

RENDERER = ChatRenderer(ByteTokenizer())
ROOT = os.path.join(os.path.dirname(__file__), "..")


class Echo:
    """Returns `reply` for every prompt, with log-prob -1 per token; records its calls."""

    def __init__(self, reply):
        self.reply = RENDERER.tokenizer.encode(reply)
        self.calls = []

    def sample(self, params, prompts, *, max_new_tokens, **kw):
        self.calls.append(
            ([list(p) for p in prompts], list(np.broadcast_to(max_new_tokens, (len(prompts),))))
        )
        rows = [np.asarray(self.reply, np.int32) for _ in prompts]
        lps = [np.full(len(r), -1.0, np.float32) for r in rows]
        return SampleResult(rows, lps, lps, np.ones(len(prompts), bool))


def _prompt(turns):
    msgs = [{"role": "user", "content": "task"}]
    for k in range(turns):
        msgs += [{"role": "assistant", "content": f"turn {k}"}, {"role": "tool", "content": "ok"}]
    return RENDERER.render_with_roles(msgs, add_generation_prompt=True)[0]


def test_only_the_first_turn_is_prefilled_and_the_prefill_is_forced():
    inner = Echo("def f(x): return x\n```\nCALL submit")
    s = prefill.PrefillSampler(inner, RENDERER, "```python\n")
    first, later = _prompt(0), _prompt(1)
    out = s.sample(None, [first, later], max_new_tokens=64, rng=None)
    pre = RENDERER.tokenizer.encode("```python\n")
    ((prompts, budgets),) = inner.calls
    # The first-turn prompt continues after the prefill, with that much less budget.
    assert prompts[0] == first + pre and prompts[1] == later
    assert budgets == [64 - len(pre), 64]
    text0 = RENDERER.tokenizer.decode(out.tokens[0].tolist())
    assert text0 == "```python\ndef f(x): return x\n```\nCALL submit"
    assert RENDERER.tokenizer.decode(out.tokens[1].tolist()).startswith("def f")
    # Forced tokens carry log-prob 0; the sampled ones keep theirs.
    np.testing.assert_array_equal(out.logprobs[0][: len(pre)], 0.0)
    np.testing.assert_array_equal(out.logprobs[0][len(pre) :], -1.0)
    np.testing.assert_array_equal(out.logprobs[1], -1.0)
    # A call with no first-turn prompt passes through untouched.
    out = s.sample(None, [later], max_new_tokens=8, rng=None)
    assert inner.calls[-1] == ([later], [8])
    with pytest.raises(ValueError, match="no room"):
        s.sample(None, [first], max_new_tokens=len(pre), rng=None)
    with pytest.raises(ValueError, match="empty"):
        prefill.PrefillSampler(inner, RENDERER, "")


class Thinker:
    """A thinking model: a first turn opens with "<think>plan</think>" (or, `bare`, with code);
    after the forced opening it writes a fenced body; records its calls."""

    def __init__(self, bare=()):
        self.bare, self.calls = set(bare), []
        enc = RENDERER.tokenizer.encode
        self.think_end = RENDERER.tokenizer.special_id("</think>")
        self.forced = enc("\n```python\n")
        self.opening = enc("```python\n")
        self.end = RENDERER.end_of_turn_ids[0]

    def sample(self, params, prompts, *, max_new_tokens, stop_ids, rng, row_ids=None, **kw):
        self.calls.append({
            "prompts": [list(p) for p in prompts], "stop_ids": stop_ids,
            "budgets": list(max_new_tokens), "row_ids": row_ids, "kw": kw,
        })  # fmt: skip
        enc = RENDERER.tokenizer.encode
        rows = []
        for p, stops, rid in zip(prompts, stop_ids, row_ids, strict=True):
            p = list(p)
            if p[-len(self.forced) :] == self.forced or p[-len(self.opening) :] == self.opening:
                ids = enc("def f(x): return x\n```\nCALL submit") + [self.end]
            elif rid in self.bare:
                ids = enc("def f(x): return x\nCALL submit") + [self.end]
            elif self.think_end in stops:
                ids = enc("<think>plan</think>")
            else:
                ids = enc("<think>plan</think>\ndef f(x): return x\nCALL submit") + [self.end]
            rows.append(np.asarray(ids, np.int32))
        lps = [np.full(len(r), -1.0, np.float32) for r in rows]
        return SampleResult(rows, lps, lps, np.ones(len(prompts), bool))


def test_after_thinking_keeps_the_thinking_block_and_opens_the_format_after_it():
    inner = Thinker(bare={1})
    s = prefill.PrefillSampler(inner, RENDERER, "```python\n", after_thinking=True)
    first, later = _prompt(0), _prompt(1)
    stops = RENDERER.end_of_turn_ids
    out = s.sample(
        None, [first, first, later], max_new_tokens=64, stop_ids=stops, rng=jax.random.key(0),
        row_ids=[0, 1, 2], cache=object(), keys=[0, 1, 2],
    )  # fmt: skip
    texts = [RENDERER.tokenizer.decode(t.tolist()) for t in out.tokens]
    end = RENDERER.tokenizer.decode([inner.end])
    # Row 0 thought first: its block is kept, the fence opens after it.
    assert texts[0] == "<think>plan</think>\n```python\ndef f(x): return x\n```\nCALL submit" + end
    # Row 1 wrote no thinking block: opened at its start; row 2 (a later turn) untouched.
    assert texts[1] == "```python\ndef f(x): return x\n```\nCALL submit" + end
    assert texts[2] == "<think>plan</think>\ndef f(x): return x\nCALL submit" + end
    # Forced tokens carry log-prob 0, sampled ones theirs.
    n_think = len(RENDERER.tokenizer.encode("<think>plan</think>"))
    lp0 = out.logprobs[0]
    np.testing.assert_array_equal(lp0[:n_think], -1.0)
    np.testing.assert_array_equal(lp0[n_think : n_think + len(inner.forced)], 0.0)
    np.testing.assert_array_equal(lp0[n_think + len(inner.forced) :], -1.0)
    np.testing.assert_array_equal(out.logprobs[1][: len(inner.opening)], 0.0)
    assert out.stopped.all()
    # Phase 1: every row, only first turns also stop at </think>; phase 2: row 0 continues
    # after its block with that much less budget; phase 3: row 1 from the opening. No cache.
    p1, p2, p3 = inner.calls
    assert [inner.think_end in st for st in p1["stop_ids"]] == [True, True, False]
    assert p2["row_ids"] == [0] and p3["row_ids"] == [1]
    think = RENDERER.tokenizer.encode("<think>plan</think>")
    assert p2["prompts"][0] == first + think + inner.forced
    assert p2["budgets"] == [64 - n_think - len(inner.forced)]
    assert p3["prompts"][0] == first + inner.opening and p3["budgets"] == [64 - len(inner.opening)]
    assert all("cache" not in c["kw"] and "keys" not in c["kw"] for c in inner.calls)


def test_summary_numbers():
    from tg_jax.sampling.episode import EpisodeRecord

    recs = [
        EpisodeRecord("a", "plain", 0, True, {"fence": True}, {"run_tests": 1, "malformed": 0}, 2),
        EpisodeRecord(
            "b", "plain", 0, False, {"fence": False}, {"run_tests": 0, "malformed": 2}, 1
        ),  # fmt: skip
        EpisodeRecord("c", "plain", 0, True, {"fence": True}, {"run_tests": 0, "malformed": 1}, 1),
        EpisodeRecord("d", "plain", 0, False, {"fence": True}, {"run_tests": 2, "malformed": 0}, 3),
    ]
    s = prefill.summarize(recs)
    assert s["episodes"] == 4 and s["task_success"] == 0.5
    assert s["compliance"] == {"fence": 0.75} and s["ran_tests"] == 0.5
    assert s["malformed_per_episode"] == 0.75
    lo, hi = s["task_success_ci"]
    assert 0.0 <= lo <= 0.5 <= hi <= 1.0


@pytest.mark.slow
def test_users_command_on_a_saved_model(tmp_path, capsys):
    from tg_jax.data import task_data
    from tg_jax.models import ModelConfig, Transformer, hf_dir, init_params
    from tg_jax.text import write_byte_tokenizer

    config = config_files.load_config_file(os.path.join(ROOT, "configs", "fence.py"), "runlocal")
    work, model_dir = tmp_path / "w", tmp_path / "model"
    task_data.prepare_tasks(config, str(work))
    cfg = ModelConfig.from_config(config.model)
    params = init_params(Transformer(cfg), jax.random.key(0))
    hf_dir.export_model_dir(str(model_dir), params, cfg)
    write_byte_tokenizer(str(model_dir))
    out = tmp_path / "prefill.json"
    rc = prefill.main([
        "--config", os.path.join(ROOT, "configs", "fence.py:runlocal"), "--workdir", str(work),
        "--model_dir", str(model_dir), "--prefill", "```python\\n", "--num_tasks", "3",
        "--samples", "1", "--out", str(out),
    ])  # fmt: skip
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["prefill"] == "```python\n"
    for name in ("plain", "prefilled"):
        assert result[name]["episodes"] == 3 and set(result[name]["compliance"]) == {"fence"}
    assert result["after_thinking"] is False
    # --after_thinking: the same command, the format opened after the first thinking block.
    rc = prefill.main([
        "--config", os.path.join(ROOT, "configs", "fence.py:runlocal"), "--workdir", str(work),
        "--model_dir", str(model_dir), "--prefill", "```python\\n", "--num_tasks", "3",
        "--samples", "1", "--out", str(out), "--after_thinking",
    ])  # fmt: skip
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["after_thinking"] is True and result["prefilled"]["episodes"] == 3
    # Both ran on dev tasks; the held-out tasks are the final evaluation's: refused, and read
    # only when asked, the read recorded in the workdir's ledger.
    from tg_jax.evaluation import heldout_reads

    assert heldout_reads.reads(str(work)) == []
    held = ["--config", os.path.join(ROOT, "configs", "fence.py:runlocal"), "--workdir",
            str(work), "--model_dir", str(model_dir), "--prefill", "```python\\n",
            "--num_tasks", "3", "--samples", "1", "--split", "heldout"]  # fmt: skip
    assert prefill.main(held) == 2
    assert "only the final evaluation reads" in capsys.readouterr().err
    assert heldout_reads.reads(str(work)) == []
    assert prefill.main([*held, "--reread_heldout"]) == 0
    (read,) = heldout_reads.reads(str(work))
    assert read["purpose"] == "tg_jax.evaluation.prefill" and read["asked"] and read["tasks"] == 3
    assert "1 more read(s)**: tg_jax.evaluation.prefill on" in heldout_reads.describe(
        heldout_reads.summary(str(work)))  # fmt: skip
