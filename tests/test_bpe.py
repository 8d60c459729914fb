"""The byte-level BPE of sft.tokenizer = "bpe": ids, round trips, fences, the chat template,
and the main job in miniature with it."""

import json
import os
import random

import jax
import numpy as np
import pytest

from tests.test_pipeline import FAST_PIPELINE
from tg_jax import config_files, sharding
from tg_jax.models import hf_dir
from tg_jax.text import ByteTokenizer, ChatRenderer, HFTokenizer, bpe, check_chat_template
from tg_jax.text.tokenizer import BYTE_SPECIAL_TOKENS
from tg_jax.train import pipeline, sft, sft_data

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "configs")
BYTE = ByteTokenizer()


def _tiny_config(**overrides):
    config = config_files.load_config_file(os.path.join(CONFIG_DIR, "tiny.py"))
    return config_files.apply_overrides(config, {"sft.tokenizer": "bpe", **overrides})


@pytest.fixture(scope="module")
def corpus():
    config = _tiny_config(**{"sft.hint_requirements": ("fence", "tool_json")})
    transcripts = sft_data.make_sft_transcripts(config)
    return sft_data.transcript_texts(transcripts, ChatRenderer(BYTE))


@pytest.fixture(scope="module")
def bpe_dir(corpus, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("bpe_tok"))
    bpe.write_bpe_tokenizer(path, corpus, 512)
    return path


@pytest.fixture(scope="module")
def tok(bpe_dir):
    return HFTokenizer.from_dir(bpe_dir)


def _texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    pool = ["a", " ", "\n", "é", "✓", "数", "🙂", "\t", "`", "```", "```python", "def", "  "]
    pool += list(BYTE_SPECIAL_TOKENS)
    return ["".join(rng.choice(pool) for _ in range(rng.randrange(40))) for _ in range(n)] + [
        "plain ASCII, with punctuation!?",
        "Héllo ünïcode ✓ 数学 🙂 \x00\x7f",
        "````python\n```\n``` python ```",
    ]


def test_bpe_extends_the_byte_tokenizer(corpus, tok):
    assert BYTE.vocab_size < tok.vocab_size <= 512
    for s in BYTE_SPECIAL_TOKENS:
        assert tok.special_id(s) == BYTE.special_id(s)
        assert tok.encode(s) == [BYTE.special_id(s)]
    assert (tok.pad_id, tok.eos_id) == (BYTE.pad_id, BYTE.eos_id)
    # Ids 0..255 are the bytes, whatever the merges.
    assert [tok.decode([b]) for b in range(128)] == [chr(b) for b in range(128)]
    # It compresses the transcripts it was trained on.
    byte_len = sum(len(BYTE.encode(t)) for t in corpus)
    assert sum(len(tok.encode(t)) for t in corpus) < 0.7 * byte_len


def test_bpe_round_trips_any_text(corpus, tok):
    for text in _texts(0, 300) + corpus[:20]:
        assert tok.decode(tok.encode(text)) == text, text
    rng = random.Random(1)
    for _ in range(200):  # invalid UTF-8 becomes U+FFFD, as in the byte tokenizer
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
        text = raw.decode("utf-8", errors="replace")
        assert tok.decode(tok.encode(text)) == text
        assert tok.decode(list(raw)) == BYTE.decode(list(raw))


def test_code_fences_are_single_tokens(tok):
    fence, opening = tok.encode("```"), tok.encode("```python")
    assert len(fence) == 1 and len(opening) == 1 and fence != opening
    ids = tok.encode("Answer:\n```python\ndef f(x):\n    return x\n```\nx```y")
    assert ids.count(opening[0]) == 1 and ids.count(fence[0]) == 2
    assert tok.decode(opening) == "```python" and tok.decode(fence) == "```"


def test_training_is_deterministic(corpus, bpe_dir):
    again = bpe.train_bpe(corpus, 512)
    with open(os.path.join(bpe_dir, "tokenizer.json")) as f:
        assert json.loads(again.to_str()) == json.load(f)
    with pytest.raises(ValueError, match="fixed ids"):
        bpe.train_bpe(corpus, 260)


def test_chat_template_check_passes_with_the_bpe(tok):
    check_chat_template(ChatRenderer(tok, tok.chat_template))
    check_chat_template(ChatRenderer(tok, tok.chat_template, hint_role="system"))


def test_bpe_dir_loads_in_transformers(bpe_dir, tok):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(bpe_dir)
    assert (ref.eos_token, ref.pad_token) == ("<|endoftext|>", "<|pad|>")
    for text in _texts(2, 100):
        ids = tok.encode(text)
        assert ref.encode(text, add_special_tokens=False) == ids
        assert ref.decode(ids) == text
    # The fences are plain added tokens: skip_special_tokens keeps them.
    ids = tok.encode("<|im_start|>```python\nx\n```<|im_end|>")
    assert ref.decode(ids, skip_special_tokens=True) == "```python\nx\n```"


@pytest.mark.slow
def test_sft_with_bpe_trains_on_bpe_ids_and_resumes(tmp_path):
    config = _tiny_config(**{"sft.steps": 4, "sft.select.enabled": False})
    work = str(tmp_path)
    stopped = sft.run_sft(config, work, stop_after=2)
    assert int(stopped.step) == 2
    tok = sft.sft_tokenizer(config, work)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size % 8 == 0
    with open(os.path.join(sft.tokenizer_dir(work), "tokenizer.json")) as f:
        first = f.read()
    done = sft.run_sft(config, work)  # resumed: the stored BPE, not a new one
    with open(os.path.join(sft.tokenizer_dir(work), "tokenizer.json")) as f:
        assert f.read() == first
    assert done.params["embed"].shape[0] == tok.vocab_size
    cfg = sft.tokenized_config(config, tok)
    assert cfg.model.vocab_size == tok.vocab_size and config.model.vocab_size == 272
    model = sft.build_model(cfg, tok)
    mesh, rules = sharding.make_mesh(config.mesh), sharding.logical_rules(config.mesh)
    loaded = sft.load_sft_state(cfg, work, model, mesh, rules)
    for a, b in zip(jax.tree.leaves(done.params), jax.tree.leaves(loaded.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    rows, _ = sft_data.make_sft_rows(cfg, ChatRenderer(tok))
    assert rows.inputs.max() >= 272  # merged tokens in the SFT data
    with pytest.raises(FileNotFoundError, match="run the sft stage"):
        sft.sft_tokenizer(config, str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="sft.tokenizer"):
        sft.tokenizer_kind(_tiny_config(**{"sft.tokenizer": "word"}))


@pytest.mark.slow
def test_pipeline_runs_with_the_bpe(tmp_path):
    config = _tiny_config(**FAST_PIPELINE)
    workdir = str(tmp_path)
    res = pipeline.run_pipeline(config, workdir)
    assert set(res["arms"]) == {"grpo", "tg"}
    base = os.path.join(workdir, pipeline.BASE_MODEL_DIR)
    with (
        open(os.path.join(base, "tokenizer.json")) as f,
        open(os.path.join(sft.tokenizer_dir(workdir), "tokenizer.json")) as g,
    ):
        assert f.read() == g.read()
    md = hf_dir.open_model_dir(base)  # checks the chat template against the BPE renderer
    tok = sft.sft_tokenizer(config, workdir)
    assert md.architecture.vocab_size == tok.vocab_size > 272
    assert md.renderer.tokenizer.encode("```python\n```") == tok.encode("```python\n```")
    for arm in ("grpo", "tg"):
        assert os.path.exists(os.path.join(workdir, "runs", f"{arm}_seed0", "heldout.jsonl"))
        export = os.path.join(workdir, pipeline.EXPORT_DIR, f"{arm}_seed0", "tokenizer.json")
        with open(export) as f, open(os.path.join(base, "tokenizer.json")) as g:
            assert f.read() == g.read()
    assert os.path.exists(os.path.join(workdir, "report", "report.md"))
