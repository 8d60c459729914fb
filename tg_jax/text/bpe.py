"""A small byte-level BPE trained on chat transcripts, as a Hugging Face tokenizer.

`train_bpe(texts, vocab_size)` extends the byte tokenizer (`tg_jax.text.byte_hf`) rather than
replacing it:

  ids 0..255      the 256 bytes (GPT-2's ByteLevel characters, in byte order), so any text
                  round-trips, non-ASCII and invalid UTF-8 included;
  256..           the chat specials of `BYTE_SPECIAL_TOKENS`, at ByteTokenizer's ids;
  then            the merges HF `tokenizers`' BPE trainer learns on `texts`, in its order;
  last            the code fences `FENCE_TOKENS` ("```python", "```") as added tokens: one
                  token wherever they occur, whatever the merges.

Pre-tokenization is GPT-2's ByteLevel regex: a merge never crosses from a word into
punctuation, a number or whitespace. Rendering a conversation message by message
(`ChatRenderer`, pieces meet at specials or after a header's newline) therefore gives the
ids of tokenizing its whole text, which `check_chat_template` verifies. The trainer sees the
texts with the specials and fences cut out, as encoding sees them; training is deterministic
(same texts and vocab_size, same tokenizer.json).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence

from tg_jax.text.byte_hf import byte_level_alphabet, byte_level_tokenizer, write_tokenizer_dir
from tg_jax.text.tokenizer import BYTE_SPECIAL_TOKENS

# Added (not special) tokens: transformers' skip_special_tokens keeps them in decoded text.
FENCE_TOKENS: tuple[str, ...] = ("```python", "```")


def _plain_pieces(texts: Iterable[str], literals: Sequence[str]) -> Iterator[str]:
    """The parts of each text between occurrences of `literals` (the added tokens)."""
    alternation = "|".join(re.escape(s) for s in sorted(literals, key=len, reverse=True))
    split = re.compile(f"(?:{alternation})")
    for text in texts:
        yield from (piece for piece in split.split(text) if piece)


def _learned_merges(texts: Iterable[str], num_merges: int, literals: Sequence[str]):
    """The first `num_merges` merges HF's BPE trainer learns on `texts` (pairs of tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    scratch = Tokenizer(models.BPE())
    scratch.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=256 + num_merges,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    scratch.train_from_iterator(_plain_pieces(texts, literals), trainer)
    merges = json.loads(scratch.to_str())["model"]["merges"]
    pairs = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]
    return pairs[:num_merges]


def train_bpe(
    texts: Iterable[str], vocab_size: int, *, special_tokens: Sequence[str] = BYTE_SPECIAL_TOKENS
):
    """A `tokenizers.Tokenizer` of at most `vocab_size` ids trained on `texts` (see above).

    Args:
      texts: training text (e.g. rendered SFT transcripts); specials in it are cut out.
      vocab_size: ids at most: 256 bytes + specials + fences + merges (fewer merges when the
        texts have no more pairs to merge).
      special_tokens: the chat specials, at ids 256 + i.

    Returns:
      The tokenizer (ByteLevel pre-tokenizer and decoder, specials and fences added).
    """
    base = 256 + len(special_tokens)
    num_merges = vocab_size - base - len(FENCE_TOKENS)
    if num_merges < 0:
        raise ValueError(f"bpe vocab_size {vocab_size} < {base + len(FENCE_TOKENS)} fixed ids")
    merges = _learned_merges(texts, num_merges, (*special_tokens, *FENCE_TOKENS))
    vocab = {c: b for b, c in enumerate(byte_level_alphabet())}
    vocab.update({s: 256 + i for i, s in enumerate(special_tokens)})
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return byte_level_tokenizer(
        vocab, merges, special_tokens, use_regex=True, added_tokens=FENCE_TOKENS
    )


def write_bpe_tokenizer(
    out_dir: str,
    texts: Iterable[str],
    vocab_size: int,
    *,
    special_tokens: Sequence[str] = BYTE_SPECIAL_TOKENS,
    model_max_length: int = 4096,
) -> None:
    """Trains `train_bpe(texts, vocab_size)` and writes it as a Hugging Face tokenizer
    directory (the files of `byte_hf.write_tokenizer_dir`) into `out_dir`."""
    tok = train_bpe(texts, vocab_size, special_tokens=special_tokens)
    write_tokenizer_dir(
        out_dir, tok, special_tokens=special_tokens, model_max_length=model_max_length
    )
