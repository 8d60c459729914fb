"""The checkpoint's chat template is the renderer: for public templates of three chat formats, a
multi-turn tool episode built token-in/token-out gives transformers' `apply_chat_template`
tokens at every point a rollout passes through, and every tool call reads back."""

import json

import pytest

from tests.hf_checkpoints import chat_template
from tg_jax.text import ChatRenderer, HFTokenizer, check_chat_template, hint_message, tool_formats
from tg_jax.text.template import TemplateError

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# Qwen3's official template (Hermes JSON calls, thinking), Qwen3-Coder's public one (XML calls,
# no thinking), and Qwen3's writing nothing between messages.
TEMPLATES = ("qwen3", "qwen3_coder", "chatml_no_newline")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Create or overwrite a file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the visible tests.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]


def _call(name, **args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


EPISODE = [
    {"role": "system", "content": "You fix bugs in small repositories."},
    {"role": "user", "content": "Make add() in ops.py add. Héllo ✓ 数学."},
    {
        "role": "assistant",
        "reasoning_content": "The bug is a minus sign.",
        "content": "I will rewrite the file.",
        "tool_calls": [
            _call("write_file", path="ops.py", content="def add(a, b):\n    return a + b\n")
        ],
    },
    {"role": "tool", "content": "overwrote ops.py"},
    hint_message("Run the tests before you submit."),
    {
        "role": "assistant",
        "reasoning_content": "Check it.",
        "content": "",
        "tool_calls": [_call("run_tests")],
    },
    {"role": "tool", "content": "2 passed"},
    {"role": "assistant", "reasoning_content": "Done.", "content": "Fixed: ops.py adds now."},
]
HINT_AT = 4
# Templates that drop the thinking of earlier turns once a user message (the hint) arrives.
RERENDER_AT_HINT = ("qwen3", "chatml_no_newline")


def _points(messages):
    """(end, generation header): before each assistant turn (with the header), and after it."""
    points = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            points += [(i, True), (i + 1, False)]
    return points


def _tokenizer_dir(path, template):
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [json.dumps(m, ensure_ascii=False) for m in EPISODE] * 20
    corpus += [json.dumps(TOOLS), "<function=run_tests>\n<parameter=path>\n"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text(template)
    return str(path)


@pytest.fixture(scope="module", params=TEMPLATES)
def fmt(request, tmp_path_factory):
    """(name, our renderer, transformers' tokenizer) of one template."""
    from transformers import AutoTokenizer

    path = _tokenizer_dir(tmp_path_factory.mktemp(request.param), chat_template(request.param))
    tok = HFTokenizer.from_dir(path)
    return request.param, ChatRenderer(tok, tok.chat_template), AutoTokenizer.from_pretrained(path)


def _hf_ids(ref, messages, gen):
    hf = [{**m, "role": "user"} if m["role"] == "hint" else m for m in messages]
    out = ref.apply_chat_template(
        hf, tools=TOOLS, tokenize=True, add_generation_prompt=gen, return_dict=False
    )
    return list(out)


def test_the_format_is_read_from_the_template(fmt):
    name, renderer, _ = fmt
    want = {"qwen3": ("hermes", True, "\n"), "qwen3_coder": ("qwen3_coder", False, "\n")}
    want["chatml_no_newline"] = ("hermes", True, "")
    assert (renderer.tool_format.name, renderer.has_thinking, renderer.separator) == want[name]
    assert renderer.tokenizer.decode(renderer.assistant_header()) == "<|im_start|>assistant\n"
    stop = renderer.tokenizer.decode(renderer.end_of_turn_ids[:1])
    assert stop == "<|im_end|>"
    check_chat_template(renderer)


def test_every_rollout_point_is_apply_chat_template(fmt):
    """Exactly transformers' ids at every point; for Qwen3's templates, which drop the earlier
    thinking once the hint (a user message) arrives, exactly its ids up to the hint and, from
    there on, its ids end with what the rollout appended (the module policy of chat.py)."""
    name, renderer, ref = fmt
    previous = None
    for end, gen in _points(EPISODE):
        ours = renderer.render_with_roles(EPISODE[:end], gen, tools=TOOLS)[0]
        want = _hf_ids(ref, EPISODE[:end], gen)
        if name in RERENDER_AT_HINT and end > HINT_AT:
            added = ours[len(previous) :]
            assert ours[: len(previous)] == previous  # nothing sampled is re-rendered
            assert want[-len(added) :] == added, (end, gen)
            assert want != ours  # the template did drop the earlier thinking
        else:
            assert ours == want, (name, end, gen)
        previous = ours


def test_the_rollout_pieces_are_the_template_s(fmt):
    """The pieces a rollout appends (observation, hint, header) give the whole episode."""
    name, renderer, ref = fmt
    tok = renderer.tokenizer
    ids = renderer.render_with_roles(EPISODE[:2], tools=TOOLS)[0]
    for m in EPISODE[2:]:
        if m["role"] == "assistant":
            ids += renderer.assistant_header()
            sampled = tok.encode(renderer.turn_body(m)) + [renderer.end_of_turn_ids[0]]
            ids += sampled + renderer.separator_ids  # as the sampler drew it, then the separator
        else:
            ids += renderer.render_message(m)
    assert ids == renderer.render_with_roles(EPISODE, tools=TOOLS)[0]
    if name not in RERENDER_AT_HINT:
        assert ids == _hf_ids(ref, EPISODE, False)
    no_hint = [m for m in EPISODE if m["role"] != "hint"]
    assert renderer.render_with_roles(no_hint, tools=TOOLS)[0] == _hf_ids(ref, no_hint, False)


def test_each_written_call_reads_back(fmt):
    _, renderer, _ = fmt
    for m in EPISODE:
        for call in m.get("tool_calls", ()):
            text = renderer.turn_body({"role": "assistant", "content": "", "tool_calls": [call]})
            (got,) = renderer.tool_format.calls(text)
            assert (got.name, got.arguments) == (
                call["function"]["name"],
                call["function"]["arguments"],
            )
            assert got.canonical


def test_qwen3_coder_values_convert_by_schema():
    fmt = tool_formats.get("qwen3_coder")
    text = (
        "Reading.\n<tool_call>\n<function=read_file>\n<parameter=path>\npkg/a.py\n</parameter>\n"
        "<parameter=start>\n3\n</parameter>\n<parameter=flags>\n[1, 2]\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    schema = {
        "function": {
            "name": "read_file",
            "parameters": {
                "properties": {
                    "path": {"type": "string"},
                    "start": {"type": "integer"},
                    "flags": {"type": "array"},
                }
            },
        }
    }
    (block,) = fmt.blocks(text, {"read_file": schema})
    assert block.call.arguments == {"path": "pkg/a.py", "start": 3, "flags": [1, 2]}
    assert fmt.calls(text)[0].arguments["start"] == "3"  # no schema: text
    assert fmt.strip(text) == "Reading.\n"
    bad = fmt.blocks("<tool_call>\n<function=x>\nloose text\n</function>\n</tool_call>")
    assert bad[0].call is None and "outside <parameter>" in bad[0].error
    (unclosed,) = fmt.blocks("<tool_call>\n<function=x>")
    assert unclosed.end is None and "not closed" in unclosed.error


def test_hermes_reads_what_models_write():
    fmt = tool_formats.get("hermes")
    (a, b, c) = fmt.blocks(
        '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> and '
        '<tool_call>{"name": "g"}</tool_call><tool_call>{oops</tool_call>'
    )
    assert (a.call, a.error) == (tool_formats.Call("f", {"x": 1}, True), None)
    assert b.call == tool_formats.Call("g", {}, False)  # understood, not canonical
    assert c.call is None and c.error == "bad tool_call JSON"
    assert fmt.example() == '<tool_call>{"name": ...}</tool_call>'
    assert fmt.example(arguments=True) == '<tool_call>{"name": ..., "arguments": {...}}</tool_call>'


def test_registering_a_format():
    class Bracket(tool_formats.ToolFormat):
        name = "bracket_test"

        def parse_payload(self, payload, schema=None):
            fn, _, arg = payload.strip().partition(" ")
            return tool_formats.Call(fn, {"arg": arg} if arg else {})

        def example(self, name="...", *, arguments=False):
            return f"<tool_call>{name}</tool_call>"

    fmt = tool_formats.register(Bracket())
    assert tool_formats.get("bracket_test") is fmt
    assert (
        tool_formats.detect(
            "<tool_call>probe_tool x = 1</tool_call>",
            [tool_formats.Call("probe_tool", {"arg": "x = 1"})],
        )
        is fmt
    )
    with pytest.raises(ValueError, match="already registered"):
        tool_formats.register(Bracket())
    with pytest.raises(ValueError, match="unknown tool format 'nope'.*hermes"):
        tool_formats.get("nope")


def test_a_named_format_overrides_detection(fmt):
    name, renderer, _ = fmt
    if name != "qwen3_coder":
        pytest.skip("one template is enough")
    forced = ChatRenderer(renderer.tokenizer, renderer.template, tool_format="hermes")
    assert forced.tool_format.name == "hermes"
    with pytest.raises(TemplateError, match="do not read back through tool format 'hermes'"):
        check_chat_template(forced)
