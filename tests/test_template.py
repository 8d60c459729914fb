"""Chat templates rendered as transformers renders them; templates that cannot serve a rollout
refused with the first difference; the byte tokenizer written as a Hugging Face directory."""

import json
import os
import random

import pytest

from tg_jax.text import ByteTokenizer, ChatRenderer, HFTokenizer, check_chat_template, hint_message
from tg_jax.text.byte_hf import byte_level_alphabet, write_byte_tokenizer
from tg_jax.text.template import TemplateError, qwen3_chat_template, render_template

TEMPLATE_PATH = os.path.join(os.path.dirname(__file__), "data", "qwen3_chat_template.jinja")
# Qwen3's added tokens: the first three are special, the tags are plain added tokens.
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

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


def _call(code: str, name: str = "run_tests") -> dict:
    return {"type": "function", "function": {"name": name, "arguments": {"code": code}}}


SYSTEM = {"role": "system", "content": "You are a careful coding agent."}
USER = {"role": "user", "content": "Write f(x) with f(1)=2, f(2)=4. Héllo ünïcode ✓ 数学."}
HINT = hint_message("Call run_tests with <tool_call> JSON before answering.")
A1 = {
    "role": "assistant",
    "reasoning_content": "Looks like doubling.",
    "content": "Let me test it.",
    "tool_calls": [_call("def f(x):\n    return 2 * x")],
}
A2 = {
    "role": "assistant",
    "reasoning_content": "\nf(0) fails; try 2**x.\n",
    "content": "",
    "tool_calls": [_call("def f(x):\n    return 2 ** x")],
}
A3 = {"role": "assistant", "reasoning_content": "All pass.", "content": "```python\nf\n```"}
TOOL1 = {"role": "tool", "content": "1/2 tests passed"}
TOOL2 = {"role": "tool", "content": "2/2 tests passed"}
EPISODE = [SYSTEM, USER, A1, TOOL1, A2, TOOL2, A3]

# Conversations (hints as user messages, as the teacher sees them) and template arguments.
CONVERSATIONS = {
    "prompt": dict(messages=[SYSTEM, USER], tools=TOOLS),
    "prompt_no_thinking": dict(messages=[USER], enable_thinking=False),
    "tool_episode": dict(messages=EPISODE, tools=TOOLS),
    "tool_episode_no_tools_listed": dict(messages=EPISODE),
    "hinted_episode": dict(messages=[SYSTEM, USER, HINT, A1, TOOL1, A2, TOOL2, A3], tools=TOOLS),
    "hint_before_a_later_turn": dict(messages=[SYSTEM, USER, A1, TOOL1, HINT, A2], tools=TOOLS),
    "think_in_content_and_string_args": dict(
        messages=[
            USER,
            {
                "role": "assistant",
                "content": "<think>\nhmm\n</think>\n\nok",
                "tool_calls": [
                    {"function": {"name": "run_tests", "arguments": '{"code": "x"}'}},
                    _call("y", name="submit"),
                ],
            },
            {"role": "tool", "content": "a"},
            {"role": "tool", "content": "b"},
            {"role": "assistant", "content": None, "reasoning": "via the old field name"},
        ],
        enable_thinking=True,
    ),
}


def _hf_messages(messages, hf_ref=None):
    """The messages transformers renders: a hint as a user message; where the installed
    transformers does not alias the reasoning fields itself (5.19, the version vLLM 0.32
    supports, does not; 5.24 does), the aliases our renderer applies (checked by hand in
    test_reasoning_is_aliased_under_all_its_names)."""
    out = [{**m, "role": "user"} if m["role"] == "hint" else m for m in messages]
    if hf_ref is not None and not _hf_aliases_reasoning(hf_ref):
        out = [_alias(m) for m in out]
    return out


def _alias(m):
    r = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if m.get(k)), None)
    return m if r is None else {"thinking": r, **m, "reasoning_content": r}


def _hf_aliases_reasoning(hf_ref) -> bool:
    probe = [{"role": "assistant", "content": "", "thinking": "p"}]
    return (
        hf_ref.apply_chat_template(
            probe, chat_template="{{ messages[0].reasoning_content }}", tokenize=False
        )
        == "p"
    )


def test_reasoning_is_aliased_under_all_its_names():
    """`reasoning` / `thinking` / `reasoning_content`: a template reads any of them."""
    template = "{% for m in messages %}{{ m.reasoning_content }}|{{ m.thinking }};{% endfor %}"
    messages = [{"role": "assistant", "content": "", "reasoning": "a"},
                {"role": "assistant", "content": "", "thinking": "b"},
                {"role": "assistant", "content": "", "reasoning_content": "c"}]  # fmt: skip
    assert render_template(template, messages) == "a|a;b|b;c|c;"


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """A tiny byte-level BPE tokenizer with Qwen3's added tokens and official chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [json.dumps(m, ensure_ascii=False) for m in EPISODE] * 20
    corpus += ["def f(x):\n    return x + 1\n", "tests passed, assistant user system\n\n"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    path = tmp_path_factory.mktemp("qwen3_tok")
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with open(TEMPLATE_PATH) as f:
        (path / "chat_template.jinja").write_text(f.read())
    return str(path)


@pytest.fixture(scope="module")
def hf_ref(qwen_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_dir)


@pytest.fixture(scope="module")
def hf_tok(qwen_dir):
    return HFTokenizer.from_dir(qwen_dir)


@pytest.fixture(scope="module")
def byte_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("byte_tok"))
    write_byte_tokenizer(path)
    return path


def test_packaged_template_is_the_fixture(hf_tok):
    with open(TEMPLATE_PATH) as f:
        assert qwen3_chat_template() == f.read()
    assert hf_tok.chat_template == qwen3_chat_template()  # Read from chat_template.jinja.


# render_template vs transformers.


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_template_matches_transformers(hf_ref, hf_tok, name, add_generation_prompt):
    case = dict(CONVERSATIONS[name])
    messages = _hf_messages(case.pop("messages"), hf_ref)
    kwargs = dict(case, add_generation_prompt=add_generation_prompt)
    want = hf_ref.apply_chat_template(messages, tokenize=False, **kwargs)
    text = render_template(qwen3_chat_template(), messages, **kwargs)
    assert text == want
    want_ids = hf_ref.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    assert hf_tok.encode(text) == list(want_ids)


def test_render_template_environment_matches_transformers(hf_ref):
    """Filters, globals and extensions of transformers' sandbox, on a template that uses them."""
    template = (
        "{%- set ns = namespace(n=0) %}"
        "{%- for m in messages %}{%- if m.role == 'stop' %}{%- break %}{%- endif %}"
        "{%- set ns.n = ns.n + 1 %}"
        "{% generation %}{{ m | tojson(indent=2, sort_keys=true) }}{% endgeneration %}\n"
        "{%- endfor %}{{ ns.n }} {{ tools | tojson(separators=(',', ':')) }} "
        "{{ dict(a=1) | tojson }} {{ strftime_now('%Y') }} {{ extra }} {{ '<é>' | tojson }}"
        "{%- if add_generation_prompt %}{{ raise_exception('no prompts: ' + extra) }}{%- endif %}"
    )
    messages = [USER, {"role": "assistant", "content": "x", "thinking": "t"}, {"role": "stop"}]
    kwargs = dict(tools=TOOLS, extra="ë")
    hf_messages = _hf_messages(messages, hf_ref)
    want = hf_ref.apply_chat_template(hf_messages, chat_template=template, tokenize=False, **kwargs)
    assert render_template(template, messages, **kwargs) == want
    assert '"reasoning_content": "t"' in want
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="no prompts: ë"):
        render_template(template, messages, add_generation_prompt=True, **kwargs)
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_template("{% set ns = namespace(_x=1) %}", messages)


# check_chat_template.


def _check(tok, template, **kw):
    check_chat_template(ChatRenderer(tok, template, **kw))


@pytest.mark.parametrize("hint_role", ["user", "system"])
def test_check_passes_on_qwen3(hf_tok, hint_role):
    _check(hf_tok, qwen3_chat_template(), hint_role=hint_role)
    _check(ByteTokenizer(), qwen3_chat_template(), hint_role=hint_role)


def test_check_fails_on_a_template_that_reorders(hf_tok):
    """Messages rendered in role order: appending an assistant turn moves it before the user's."""
    template = qwen3_chat_template().replace(
        "{%- for message in messages %}", "{%- for message in messages|sort(attribute='role') %}"
    )
    with pytest.raises(TemplateError, match="not append-only for an assistant message") as info:
        _check(hf_tok, template)
    assert "'<|im_start|>assistant" in str(info.value)  # the window shows the moved turn


def test_a_template_that_drops_earlier_thinking_keeps_what_was_sampled(hf_tok):
    """Dropping the thinking of every turn but the last re-renders history: the rollout keeps
    the sampled thinking, the appended parts render identically, and find_drift says where."""
    template = qwen3_chat_template().replace(
        "{%- if loop.last or (not loop.last and reasoning_content) %}", "{%- if loop.last %}"
    )
    assert template != qwen3_chat_template()
    renderer = ChatRenderer(hf_tok, template)
    check_chat_template(renderer)
    drift = renderer.find_drift(EPISODE, tools=TOOLS)
    assert drift is not None and drift.message_index == 2  # A1's thinking, dropped later


def test_check_fails_when_the_appended_part_renders_differently(hf_tok):
    """A template that writes tool results differently after a tool call than after a user
    message: the rollout's observation is not what the template renders there."""
    template = qwen3_chat_template().replace(
        "{{- '\\n<tool_response>\\n' }}",
        "{{- '\\n<tool_response>\\n' if messages[loop.index0 - 1].role == 'user' "
        "else '\\n<tool_response>\\n>> ' }}",
    )
    assert template != qwen3_chat_template()
    with pytest.raises(TemplateError) as info:
        _check(hf_tok, template)
    message = str(info.value)
    assert "'tool episode'" in message and "message 3 (tool)" in message and ">> " in message


def test_check_fails_on_another_format(hf_tok):
    """Llama 3's markers are not tokens of this tokenizer: no stop token ends a turn."""
    llama = (
        "{{- bos_token }}{%- for m in messages %}"
        "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim }}"
        "{{- '<|eot_id|>' }}{%- endfor %}"
        "{%- if add_generation_prompt %}"
        "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
    )
    with pytest.raises(TemplateError, match="does not start with a special token") as info:
        _check(hf_tok, llama)
    assert "'<|eot_id|>'" in str(info.value)


def test_check_fails_on_a_template_without_tool_calls(hf_tok):
    """A ChatML template that ignores tool_calls: no format reads back what it writes."""
    chatml = (
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + "
        "'<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    renderer = ChatRenderer(hf_tok, chatml)
    assert renderer.tool_format is None
    with pytest.raises(TemplateError, match="no registered tool-call format reads back"):
        check_chat_template(renderer)


def test_check_reports_template_failures(hf_tok):
    strict = "{%- for m in messages %}{{ raise_exception('Only user and assistant roles') }}"
    strict += "{%- endfor %}"
    with pytest.raises(TemplateError, match="fails on a user message.*Only user and assistant"):
        _check(hf_tok, strict)
    with pytest.raises(TemplateError, match="does not compile"):
        _check(hf_tok, "{% for m in messages %}")


class _MergingTokenizer(ByteTokenizer):
    """Byte ids, except that "\\n<|im_start|>" becomes one id (a merge across messages)."""

    MERGED = 270  # A padding id of ByteTokenizer.

    def encode(self, text):
        ids, out = super().encode(text), []
        for t in ids:
            if t == self.special_id("<|im_start|>") and out and out[-1] == 10:
                out[-1] = self.MERGED
            else:
                out.append(t)
        return out

    def decode(self, ids):
        out, run = [], []
        for t in [*ids, None]:
            if t is None or t == self.MERGED:
                out.append(super().decode(run))
                out.append("" if t is None else "\n<|im_start|>")
                run = []
            else:
                run.append(t)
        return "".join(out)


def test_check_fails_when_the_tokenizer_merges_across_messages():
    with pytest.raises(TemplateError, match="merges text across a piece boundary") as info:
        _check(_MergingTokenizer(), qwen3_chat_template())
    message = str(info.value)
    assert "'prompt (user)'" in message
    assert "at token 60: [270," in message  # 60 ids of the user message, then "\n<|im_start|>".


# The byte tokenizer as a Hugging Face directory.


def test_byte_level_alphabet_is_tokenizers():
    from tokenizers import pre_tokenizers

    alphabet = byte_level_alphabet()
    assert len(set(alphabet)) == 256
    assert sorted(alphabet) == sorted(pre_tokenizers.ByteLevel.alphabet())
    assert alphabet[ord("A")] == "A" and alphabet[ord(" ")] == "Ġ" and alphabet[10] == "Ċ"


def _texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    specials = ["<|im_start|>", "<|im_end|>", "<think>", "</tool_call>", "<|pad|>", "<|endoftext|>"]
    pool = ["a", " ", "\n", "é", "✓", "数", "🙂", "\t", "<", "|", ">", "think", "  "] + specials
    return ["".join(rng.choice(pool) for _ in range(rng.randrange(40))) for _ in range(n)] + [
        "plain ASCII, with punctuation!?",
        "Héllo ünïcode ✓ 数学 🙂",
        "<|im_start|>user\nhi",
    ]


def test_byte_dir_matches_byte_tokenizer(byte_dir):
    byte = ByteTokenizer()
    hf = HFTokenizer.from_dir(byte_dir, vocab_size=byte.vocab_size)
    assert (hf.vocab_size, hf.pad_id, hf.eos_id) == (byte.vocab_size, byte.pad_id, byte.eos_id)
    for s in ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]:
        assert hf.special_id(s) == byte.special_id(s)
    for text in _texts(0, 300):
        ids = byte.encode(text)
        assert hf.encode(text) == ids, text
        assert hf.decode(ids) == byte.decode(ids) == text
    rng = random.Random(1)
    for _ in range(300):  # Random bytes, invalid UTF-8 included, mixed with specials.
        ids = [rng.randrange(256 + 10) for _ in range(rng.randrange(40))]
        assert hf.decode(ids) == byte.decode(ids), ids
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
        text = raw.decode("utf-8", errors="replace")
        assert hf.encode(text) == byte.encode(text)
    assert hf.decode(list(range(266, 272))) == byte.decode(list(range(266, 272))) == ""


def test_byte_dir_files(byte_dir):
    with open(os.path.join(byte_dir, "tokenizer_config.json")) as f:
        config = json.load(f)
    assert config["eos_token"] == "<|endoftext|>" and config["pad_token"] == "<|pad|>"
    with open(os.path.join(byte_dir, "generation_config.json")) as f:
        generation = json.load(f)
    byte = ByteTokenizer()
    ends = [byte.special_id("<|im_end|>"), byte.special_id("<|endoftext|>")]
    assert generation["eos_token_id"] == ends and generation["pad_token_id"] == byte.pad_id
    with open(os.path.join(byte_dir, "chat_template.jinja")) as f:
        assert f.read() == qwen3_chat_template()


def test_byte_dir_loads_in_transformers(byte_dir):
    from transformers import AutoTokenizer

    ref, byte = AutoTokenizer.from_pretrained(byte_dir), ByteTokenizer()
    assert (ref.eos_token, ref.pad_token) == ("<|endoftext|>", "<|pad|>")
    assert len(ref) == 266
    for text in _texts(2, 100):
        ids = byte.encode(text)
        assert ref.encode(text, add_special_tokens=False) == ids
        assert ref.decode(ids) == text
    messages = _hf_messages([SYSTEM, USER, HINT, A1, TOOL1])
    text = ref.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert text == render_template(
        qwen3_chat_template(), messages, tools=TOOLS, add_generation_prompt=True
    )
    ids = ref.apply_chat_template(
        messages, tools=TOOLS, tokenize=True, return_dict=False, add_generation_prompt=True
    )
    assert list(ids) == byte.encode(text)


def test_check_passes_on_the_byte_dir(byte_dir):
    hf = HFTokenizer.from_dir(byte_dir, vocab_size=ByteTokenizer().vocab_size)
    check_chat_template(ChatRenderer(hf, hf.chat_template))
