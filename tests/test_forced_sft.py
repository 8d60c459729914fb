"""SFT transcripts forced into a format (`sft.transcripts.p_forced`): the turns meet the
requirement without a hint, and exactly the token that decides the format gets no loss."""

import numpy as np
import pytest

from tg_jax import config_files
from tg_jax.envs.base import HINT_ROLE
from tg_jax.envs.coding import CodingEnvConfig
from tg_jax.envs.protocol import check_fence, check_tool_json, has_code
from tg_jax.envs.tasks import EASY_FAMILIES, generate_tasks
from tg_jax.envs.transcripts import TranscriptConfig, make_transcripts
from tg_jax.text import ByteTokenizer, ChatRenderer, Role
from tg_jax.train import sft_data

TASKS = generate_tasks("train", 120, seed=3, families=EASY_FAMILIES)
ENV = CodingEnvConfig(executor="trusted", requirements=("fence", "tool_json"))
BYTE = ChatRenderer(ByteTokenizer())


def _transcripts(p_forced, forced=("fence",), p_hinted=0.0, seed=1):
    cfg = TranscriptConfig(p_hinted=p_hinted, p_forced=p_forced, forced_requirements=forced,
                           p_think=0.5)  # fmt: skip
    return make_transcripts(TASKS, seed=seed, config=cfg, env_config=ENV)


def test_forced_transcripts_meet_the_requirement_unhinted_and_mark_its_first_character():
    for tr in _transcripts(1.0):
        assert not tr.hinted and not any(m["role"] == HINT_ROLE for m in tr.messages[1:])
        for m in tr.messages:
            if m["role"] != "assistant":
                continue
            text = m["content"]
            if not has_code(text):  # a submit of the last code: the fence does not apply
                assert "no_loss_chars" not in m
                continue
            assert check_fence(text) and not check_tool_json(text)  # only the forced one
            (o,) = m["no_loss_chars"]
            # The first backtick of the fence, right after any thinking block.
            assert text[o:].startswith("```python\n")
            assert o == (text.index("</think>\n") + len("</think>\n") if "<think>" in text else 0)
    # Both requirements forced: two characters each turn, the fence's and the tool call's.
    for tr in _transcripts(1.0, forced=("fence", "tool_json")):
        for m in tr.messages:
            if m["role"] == "assistant" and has_code(m["content"]):
                text = m["content"]
                assert check_fence(text) and check_tool_json(text)
                first, second = m["no_loss_chars"]
                assert text[first] == "`" and text[second:].startswith("<tool_call>")


def test_the_share_forced_and_that_hinted_transcripts_are_never_forced():
    trs = _transcripts(0.5, p_hinted=0.5, seed=4)
    forced = [any("no_loss_chars" in m for m in t.messages) for t in trs]
    assert not any(f and t.hinted for f, t in zip(forced, trs, strict=True))
    share = np.mean(forced) / np.mean([not t.hinted for t in trs])
    assert 0.35 < share < 0.65, share
    # Off: nothing marked, and no unhinted turn meets a requirement.
    for t in _transcripts(0.0, seed=4):
        for m in t.messages:
            assert "no_loss_chars" not in m
            if m["role"] == "assistant" and has_code(m["content"]):
                assert not check_fence(m["content"])


@pytest.fixture(scope="module")
def bpe_renderer(make_bpe_renderer):
    return make_bpe_renderer(sft_data.transcript_texts(_transcripts(0.5, p_hinted=0.5), BYTE), 400)


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_render_leaves_exactly_the_marked_tokens_out_of_the_loss(tokenizer, bpe_renderer):
    renderer = BYTE if tokenizer == "byte" else bpe_renderer
    tok = renderer.tokenizer
    trs = [t for t in _transcripts(1.0) if any("no_loss_chars" in m for m in t.messages)]
    assert trs
    for tr in trs[:30]:
        msgs = sft_data.transcript_messages(tr)
        ids, roles = sft_data.render_example(renderer, msgs)
        plain = [{k: v for k, v in m.items() if k != "no_loss_chars"} for m in msgs]
        ids0, roles0 = sft_data.render_example(renderer, plain)
        np.testing.assert_array_equal(ids, ids0)  # the same tokens, only roles differ
        changed = np.flatnonzero(roles != roles0)
        marked = sum(len(m.get("no_loss_chars", ())) for m in msgs)
        assert len(changed) == marked and (roles[changed] == Role.PROMPT).all()
        assert all(roles0[j] == Role.ANSWER for j in changed)
        for j in changed:  # each is the token that opens the fence
            assert tok.decode(ids[j : j + 1].tolist()).startswith("`")
        # The rest of the forced turns is learnt: the fence's remaining tokens and the code.
        mask = sft_data.loss_mask(roles)
        assert mask.sum() == sft_data.loss_mask(roles0).sum() - marked


def test_bad_forced_settings_fail_clearly():
    with pytest.raises(ValueError, match="forced_requirements: unknown"):
        TranscriptConfig(p_forced=0.2, forced_requirements=("markdown",))
    with pytest.raises(ValueError, match="needs sft.transcripts.forced_requirements"):
        TranscriptConfig(p_forced=0.2)
    with pytest.raises(ValueError, match="p_forced must be in"):
        TranscriptConfig(p_forced=1.5, forced_requirements=("fence",))
    # The config section carries both fields (sft_data.transcript_config builds from it).
    config = config_files.load_config_file("configs/fence.py")
    cfg = sft_data.transcript_config(config.sft.transcripts)
    assert isinstance(cfg, TranscriptConfig) and cfg.p_forced >= 0
