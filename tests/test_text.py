"""Tokenizers and Qwen3 chat rendering, checked against Hugging Face's apply_chat_template."""

import json
import os

import numpy as np
import pytest

from tg_jax.text import (
    ByteTokenizer,
    ChatRenderer,
    HFTokenizer,
    Role,
    Tokenizer,
    hint_message,
    load_tokenizer,
)

TEMPLATE_PATH = os.path.join(os.path.dirname(__file__), "data", "qwen3_chat_template.jinja")

# Qwen3's added tokens: the first three are "special", the tags are plain added tokens.
QWEN3_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
QWEN3_TAGS += ["<think>", "</think>"]
# Qwen2/3's pre-tokenizer split pattern.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the hidden tests on a Python function.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
        },
    }
]


def _call(code: str) -> dict:
    return {"type": "function", "function": {"name": "run_tests", "arguments": {"code": code}}}


SYSTEM = {"role": "system", "content": "You are a careful coding agent."}
USER = {"role": "user", "content": "Write f(x) with f(1)=2, f(2)=4. Héllo ünïcode ✓."}
# One user query, then a multi-step tool episode; thinking in every turn.
TOOL_EPISODE = [
    SYSTEM,
    USER,
    {
        "role": "assistant",
        "reasoning_content": "Looks like doubling.",
        "content": "Let me test it.",
        "tool_calls": [_call("def f(x):\n    return 2 * x")],
    },
    {"role": "tool", "content": "2/2 tests passed"},
    {
        "role": "assistant",
        "reasoning_content": "\nAll pass.\n",
        "content": "```python\ndef f(x):\n    return 2 * x\n```",
    },
]


def _messages_for_hf(messages):
    """HF has no "hint" role: a hint is a user message."""
    return [{**m, "role": "user"} if m["role"] == "hint" else m for m in messages]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """A small byte-level BPE tokenizer with Qwen3's pre-tokenizer, added tokens and template."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as RawTokenizer

    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    corpus = [m.get("content") or "" for m in TOOL_EPISODE] * 20
    corpus += ["def f(x):\n    return x + 1\n", "tests passed, assistant user system\n\n"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN3_SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_TAGS])
    path = tmp_path_factory.mktemp("qwen3_tok")
    tok.save(str(path / "tokenizer.json"))
    with open(TEMPLATE_PATH) as f:
        template = f.read()
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def hf_ref(qwen_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_dir)


@pytest.fixture(scope="module")
def hf_tok(qwen_dir):
    return HFTokenizer.from_dir(qwen_dir)


# Tokenizers.


def test_byte_tokenizer_ids_and_round_trip():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 272 and tok.vocab_size % 8 == 0
    assert (tok.pad_id, tok.eos_id) == (256, 257)
    assert tok.special_id("<|im_start|>") == 258 and tok.special_id("<|im_end|>") == 259
    text = "<|im_start|>user\nHé ✓<|im_end|>\n<think>\nhm</think><tool_call>{}</tool_call>"
    ids = tok.encode(text)
    assert ids[0] == 258 and ids[:6] == [258, *b"user\n"]
    assert ids.count(tok.special_id("<think>")) == 1
    assert ids.count(tok.special_id("</tool_call>")) == 1
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(np.asarray(ids, np.int32)) == text
    # A near-miss of a special stays bytes.
    assert tok.encode("<|im_end>") == list(b"<|im_end>")
    with pytest.raises(KeyError):
        tok.special_id("<nope>")


def test_byte_tokenizer_decodes_any_ids():
    tok = ByteTokenizer()
    # Invalid UTF-8, a character cut by a special, and the vocab's padding ids.
    assert tok.decode([0xFF, 0xFE, ord("A")]) == "\ufffd\ufffdA"
    euro = list("€".encode())
    assert tok.decode(euro[:2] + [tok.special_id("<think>")] + euro) == "\ufffd<think>€"
    assert tok.decode([tok.vocab_size - 1, ord("x")]) == "x"


def test_hf_tokenizer(qwen_dir, hf_tok):
    assert isinstance(hf_tok, Tokenizer)
    raw_size = hf_tok.vocab_size
    assert hf_tok.eos_id == hf_tok.special_id("<|im_end|>")
    assert hf_tok.pad_id == hf_tok.special_id("<|endoftext|>")
    for name in QWEN3_SPECIAL + QWEN3_TAGS:  # Special and plain added tokens are single ids.
        assert hf_tok.encode(f"a{name}b")[1:-1] == [hf_tok.special_id(name)]
    text = TOOL_EPISODE[1]["content"] + "<think>\nx</think>\n\n  def<|im_end|>\n"
    assert hf_tok.decode(hf_tok.encode(text)) == text
    padded = HFTokenizer.from_dir(qwen_dir, vocab_size=raw_size + 16)
    assert padded.vocab_size == raw_size + 16
    assert padded.decode([raw_size + 3, *hf_tok.encode("ok")]) == "ok"
    assert hf_tok.chat_template is not None and "tool_response" in hf_tok.chat_template
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert load_tokenizer(qwen_dir).encode("ok") == hf_tok.encode("ok")


# One-shot rendering against the real template.

CONVERSATIONS = {
    "tool_episode": dict(messages=TOOL_EPISODE),
    "tool_episode_with_tools": dict(messages=TOOL_EPISODE, tools=TOOLS),
    "tools_without_system": dict(messages=TOOL_EPISODE[1:], tools=TOOLS),
    "two_queries_drop_old_thinking": dict(
        messages=[
            SYSTEM,
            USER,
            {"role": "assistant", "reasoning_content": "Double it.", "content": "2x"},
            {"role": "user", "content": "Now triple."},
            {"role": "assistant", "content": "<think>\nTriple.\n</think>\n\n3x"},
        ]
    ),
    "parallel_tool_results": dict(
        messages=[
            USER,
            {"role": "assistant", "content": "", "tool_calls": [_call("a"), _call("b")]},
            {"role": "tool", "content": "ok a"},
            {"role": "tool", "content": "fail b"},
            {"role": "assistant", "content": "done", "tool_calls": [_call('"q"')]},
        ],
        tools=TOOLS,
    ),
    "hint_before_turn": dict(
        messages=[USER, hint_message("Reminder: put code in a ```python block.")],
    ),
    "string_arguments_no_thinking": dict(
        messages=[
            USER,
            {
                "role": "assistant",
                "content": "x",
                "tool_calls": [{"function": {"name": "run_tests", "arguments": '{"code": 1}'}}],
            },
            {"role": "tool", "content": "<tool_response>odd</tool_response>"},
        ],
        enable_thinking=False,
    ),
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_prompt_matches_hf_template(hf_ref, hf_tok, name, add_generation_prompt):
    case = CONVERSATIONS[name]
    kwargs = dict(tools=case.get("tools"), enable_thinking=case.get("enable_thinking", True))
    messages = case["messages"]
    renderer = ChatRenderer(hf_tok)
    hf_kwargs = dict(kwargs, add_generation_prompt=add_generation_prompt)
    hf_messages = _messages_for_hf(messages)
    want_text = hf_ref.apply_chat_template(hf_messages, tokenize=False, **hf_kwargs)
    assert renderer.prompt_text(messages, add_generation_prompt, **kwargs) == want_text
    want_ids = hf_ref.apply_chat_template(
        hf_messages, tokenize=True, return_dict=False, **hf_kwargs
    )
    assert renderer.render_prompt(messages, add_generation_prompt, **kwargs) == list(want_ids)
    # The byte tokenizer renders the same text.
    byte = ChatRenderer(ByteTokenizer())
    assert byte.tokenizer.decode(byte.render_prompt(messages, add_generation_prompt, **kwargs)) == (
        want_text
    )


def test_hf_rendering_keeps_the_last_turns_thinking(hf_ref):
    text = hf_ref.apply_chat_template(TOOL_EPISODE, tokenize=False)
    assert "<think>\nLooks like doubling.\n</think>" in text
    assert "<think>\nAll pass.\n</think>\n\n```python" in text


# Append-only rendering.


@pytest.mark.parametrize("tok_name", ["byte", "hf"])
def test_rollout_appends_to_the_one_shot_rendering(hf_tok, tok_name):
    """A rollout built turn by turn equals the template's rendering when nothing is dropped."""
    tok = ByteTokenizer() if tok_name == "byte" else hf_tok
    r = ChatRenderer(tok)
    prompt, turn1, obs, turn2 = TOOL_EPISODE[:2], TOOL_EPISODE[2], TOOL_EPISODE[3], TOOL_EPISODE[4]
    ids = r.render_prompt(prompt, tools=TOOLS)
    assert ids[-len(r.assistant_header()) :] == r.assistant_header()
    # The sampler generates a turn (minus the header, already in the prompt) ending with im_end.
    generated = r.render_message(turn1)[len(r.assistant_header()) : -len(r.separator_ids)]
    assert generated[-1] in r.end_of_turn_ids
    ids += generated + r.separator_ids + r.render_message(obs) + r.assistant_header()
    assert ids == r.render_prompt(TOOL_EPISODE[:4], tools=TOOLS)
    ids += r.render_message(turn2)[len(r.assistant_header()) :]
    assert ids == r.render_prompt(TOOL_EPISODE, add_generation_prompt=False, tools=TOOLS)
    assert r.is_append_only(TOOL_EPISODE, tools=TOOLS)
    assert ids == r.render_with_roles(TOOL_EPISODE, tools=TOOLS)[0]
    assert tok.decode(r.separator_ids) == r.separator == "\n"


def test_find_drift_points_at_dropped_thinking(hf_tok):
    r = ChatRenderer(hf_tok)
    messages = CONVERSATIONS["two_queries_drop_old_thinking"]["messages"]
    drift = r.find_drift(messages)
    assert drift is not None and drift.message_index == 2  # The first assistant turn.
    header_end = len(r.render_prompt(messages[:2]))
    assert drift.token_index == header_end  # Right where its <think> block would be.
    assert not r.is_append_only(messages)
    # Without the second query the thinking survives and nothing drifts.
    assert r.find_drift(messages[:3]) is None
    # A final assistant turn without thinking gets an empty <think> block from the template.
    no_think = [USER, {"role": "assistant", "content": "hi"}]
    assert r.find_drift(no_think) == (1, len(r.render_prompt(no_think[:1])))
    assert r.is_append_only([USER, {"role": "assistant", "content": "hi", "reasoning_content": ""}])


def test_render_messages_groups_tool_results():
    r = ChatRenderer(ByteTokenizer())
    tools = [{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]
    text = r.tokenizer.decode(r.render_messages(tools))
    assert text == (
        "<|im_start|>user\n<tool_response>\na\n</tool_response>\n"
        "<tool_response>\nb\n</tool_response><|im_end|>\n"
    )
    assert r.tokenizer.decode(r.render_message(tools[0])) == (
        "<|im_start|>user\n<tool_response>\na\n</tool_response><|im_end|>\n"
    )


# Roles.


def _role_text(tok, ids, roles):
    """[(role name, text)] runs of equal role."""
    runs, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or roles[i] != roles[start]:
            runs.append((Role(roles[start]).name, tok.decode(ids[start:i])))
            start = i
    return runs


def test_render_with_roles_hand_made():
    tok = ByteTokenizer()
    r = ChatRenderer(tok)
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "reasoning_content": "t", "content": "A", "tool_calls": [_call("c")]},
        {"role": "tool", "content": "R"},
        hint_message("H"),
        {"role": "assistant", "content": "<think>\nu\n</think>\n\nB"},
        {"role": "assistant", "content": "C"},
    ]
    ids, roles = r.render_with_roles(messages, add_generation_prompt=True)
    assert len(ids) == len(roles)
    call = '<tool_call>\n{"name": "run_tests", "arguments": {"code": "c"}}\n</tool_call>'
    assert _role_text(tok, ids, roles) == [
        ("PROMPT", "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"),
        ("THINK", "<think>\nt\n</think>"),
        ("ANSWER", f"\n\nA\n{call}<|im_end|>"),
        ("PROMPT", "\n"),
        ("ENV", "<|im_start|>user\n<tool_response>\nR\n</tool_response><|im_end|>\n"),
        ("HINT", "<|im_start|>user\nH<|im_end|>\n"),
        ("PROMPT", "<|im_start|>assistant\n"),
        ("THINK", "<think>\nu\n</think>"),
        ("ANSWER", "\n\nB<|im_end|>"),
        ("PROMPT", "\n<|im_start|>assistant\n"),
        ("ANSWER", "C<|im_end|>"),
        ("PROMPT", "\n<|im_start|>assistant\n"),
    ]
    # Removing the hint's tokens gives the sequence without the hint (the student's).
    keep = np.asarray(roles) != Role.HINT
    student = [m for m in messages if m["role"] != "hint"]
    assert np.asarray(ids)[keep].tolist() == r.render_with_roles(student, True)[0]
    # A configurable hint role.
    sys_hint = ChatRenderer(tok, hint_role="system").render_message(hint_message("H"))
    assert tok.decode(sys_hint) == "<|im_start|>system\nH<|im_end|>\n"


@pytest.mark.parametrize("tok_name", ["byte", "hf"])
def test_split_thinking_matches_think_role(hf_tok, tok_name):
    tok = ByteTokenizer() if tok_name == "byte" else hf_tok
    r = ChatRenderer(tok)
    messages = CONVERSATIONS["two_queries_drop_old_thinking"]["messages"] + TOOL_EPISODE[1:]
    ids, roles = r.render_with_roles(messages, tools=TOOLS)
    mask = r.split_thinking(ids)
    assert mask.dtype == bool and mask.sum() > 0
    np.testing.assert_array_equal(mask, np.asarray(roles) == Role.THINK)
    # A generated turn on its own, and an unclosed (truncated) block.
    turn = tok.encode("<think>\nhmm</think>\n\nok<|im_end|>")
    assert tok.decode(np.asarray(turn)[r.split_thinking(turn)]) == "<think>\nhmm</think>"
    cut = tok.encode("<think>\nstill thinking") + [tok.pad_id] * 2
    np.testing.assert_array_equal(r.split_thinking(cut), [True] * (len(cut) - 2) + [False] * 2)
    # <think> inside an answer does not open a block; batches work row by row.
    inner = tok.encode("ok <think>x</think>")
    assert not r.split_thinking(inner).any()
    n = min(len(turn), len(inner))
    batch = np.stack([turn[:n], inner[:n]])
    np.testing.assert_array_equal(
        r.split_thinking(batch), np.stack([r.split_thinking(turn[:n]), r.split_thinking(inner[:n])])
    )
