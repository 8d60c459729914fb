"""The byte tokenizer as a Hugging Face tokenizer directory (tokenizer.json and friends).

`write_byte_tokenizer(out_dir)` writes files with which `HFTokenizer.from_dir(out_dir)` and
`transformers.AutoTokenizer.from_pretrained(out_dir)` encode and decode exactly as
`ByteTokenizer` does: byte b is id b, `BYTE_SPECIAL_TOKENS[i]` is id 256 + i. The model is a BPE
with an empty merge list over the 256 ByteLevel characters (GPT-2's byte-to-unicode map) in
byte order, after a ByteLevel pre-tokenizer that neither splits nor adds a prefix space, and a
ByteLevel decoder; the specials are added tokens, matched in text before anything else. The
chat template is Qwen3's, so a checkpoint of the embedded default model speaks the Qwen3 format.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from tg_jax.text.template import qwen3_chat_template
from tg_jax.text.tokenizer import BYTE_SPECIAL_TOKENS


def byte_level_alphabet() -> list[str]:
    """The character ByteLevel maps each byte 0..255 to (GPT-2's `bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def byte_level_tokenizer(
    vocab: dict[str, int],
    merges: Sequence[tuple[str, str]],
    special_tokens: Sequence[str],
    *,
    use_regex: bool,
    added_tokens: Sequence[str] = (),
):
    """A ByteLevel BPE `tokenizers.Tokenizer` over `vocab` and `merges` (ByteLevel
    pre-tokenizer and decoder), the specials added as special tokens at ids 256 + i and
    `added_tokens` as plain added tokens.

    Raises:
      ValueError: a special does not land at its id 256 + i.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special_tokens])
    if added_tokens:
        tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in added_tokens])
    for i, s in enumerate(special_tokens):
        if tok.token_to_id(s) != 256 + i:
            raise ValueError(f"special token {s!r} got id {tok.token_to_id(s)}, not {256 + i}")
    return tok


def byte_hf_tokenizer(special_tokens: Sequence[str] = BYTE_SPECIAL_TOKENS):
    """A `tokenizers.Tokenizer` with ByteTokenizer's ids (specials at 256 + i)."""
    vocab = {c: b for b, c in enumerate(byte_level_alphabet())}
    return byte_level_tokenizer(vocab, [], special_tokens, use_regex=False)


def write_byte_tokenizer(
    out_dir: str,
    *,
    special_tokens: Sequence[str] = BYTE_SPECIAL_TOKENS,
    model_max_length: int = 4096,
) -> None:
    """Writes `ByteTokenizer(special_tokens)` as a Hugging Face tokenizer into `out_dir`.

    The files are those of `write_tokenizer_dir`. The model's vocab_size (ByteTokenizer's,
    padded to a multiple of 8) belongs in its config.json; the tokenizer itself knows
    256 + len(special_tokens) ids.

    Args:
      out_dir: the directory (created if needed).
      special_tokens: the byte tokenizer's specials, in id order.
      model_max_length: the longest sequence the model takes, in tokens.
    """
    tok = byte_hf_tokenizer(special_tokens)
    write_tokenizer_dir(
        out_dir, tok, special_tokens=special_tokens, model_max_length=model_max_length
    )


def write_tokenizer_dir(
    out_dir: str,
    tok,
    *,
    special_tokens: Sequence[str] = BYTE_SPECIAL_TOKENS,
    model_max_length: int = 4096,
) -> None:
    """Writes the `tokenizers.Tokenizer` `tok` and the chat files into `out_dir`.

    Files: tokenizer.json; tokenizer_config.json (eos and pad tokens: ByteTokenizer's, i.e.
    <|endoftext|> and <|pad|> (<|endoftext|> without one); `model_max_length`);
    chat_template.jinja (Qwen3's template); generation_config.json (`eos_token_id`:
    <|im_end|> and <|endoftext|>, the ids that end a turn, and `pad_token_id`).

    Args:
      out_dir: the directory (created if needed).
      tok: a tokenizer whose added special tokens are `special_tokens`.
      special_tokens: the chat specials (each a single id of `tok`).
      model_max_length: the longest sequence the model takes, in tokens.
    """
    ids = {s: tok.token_to_id(s) for s in special_tokens}
    pad = "<|pad|>" if "<|pad|>" in ids else "<|endoftext|>"
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(ids[s]): {
                "content": s,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for s in special_tokens
        },
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": pad,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    turn_ends = [ids[s] for s in ("<|im_end|>", "<|endoftext|>")]
    generation = {"eos_token_id": turn_ends, "pad_token_id": ids[pad]}
    files = {
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
        "chat_template.jinja": qwen3_chat_template(),
        "generation_config.json": json.dumps(generation, indent=2) + "\n",
    }
    for filename, text in files.items():
        with open(os.path.join(out_dir, filename), "w") as f:
            f.write(text)
