"""Privilege-drift guard: does an assistant turn reproduce the text of a hint?

The teacher sees hints the student never sees. If distillation moves the hint's own words
into the student's turns (e.g. "Reminder: put code in a ```python block." written into an
answer), the student has learned to imitate the privileged context, not the behaviour. A
turn *leaks* when it contains a word n-gram of a reference hint text:

* words: lowercased runs of letters, digits and underscores (`\\w+`); punctuation, markup
  and whitespace are dropped, so the measure does not depend on the tokenizer (the byte
  tokenizer and Qwen's BPE give the same number) nor on formatting;
* n = `NGRAM_WORDS` = 6 words: long enough that a compliant answer does not match by
  chance (the behaviour itself, a ```python fence or a <tool_call>, is 1-3 words), short
  enough to catch a copied sentence. A hint shorter than n words counts as one n-gram of
  its full length (its every word, in order);
* references per turn: the hint texts the teacher was shown for that turn (imperfect
  feedback: the picked correct, irrelevant or wrong text) and every requirement's own hint
  text (what an un-hinted turn could only have learned from the teacher).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

NGRAM_WORDS = 6
_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """The lowercased words of `text` (see the module docstring)."""
    return _WORD.findall(text.lower())


def ngrams(ws: Sequence[str], n: int = NGRAM_WORDS) -> set[tuple[str, ...]]:
    """Every n-gram of `ws`; fewer than n words (but some): the whole sequence as one."""
    if not ws:
        return set()
    if len(ws) < n:
        return {tuple(ws)}
    return {tuple(ws[i : i + n]) for i in range(len(ws) - n + 1)}


def reference_ngrams(hints: Iterable[str], n: int = NGRAM_WORDS) -> set[tuple[str, ...]]:
    """The n-grams of every hint text (a multi-line hint message: of each line too)."""
    out: set[tuple[str, ...]] = set()
    for h in hints:
        for part in [h, *h.splitlines()]:
            out |= ngrams(words(part), n)
    return out


def contains_ngram(ws: Sequence[str], grams: set[tuple[str, ...]]) -> bool:
    """Whether the word sequence `ws` contains any of `grams` contiguously."""
    for size in {len(g) for g in grams}:
        if any(tuple(ws[i : i + size]) in grams for i in range(len(ws) - size + 1)):
            return True
    return False


def leaks(text: str, hints: Iterable[str], n: int = NGRAM_WORDS) -> bool:
    """Whether `text` reproduces a word n-gram of one of `hints`."""
    grams = reference_ngrams(hints, n)
    return bool(grams) and contains_ngram(words(text), grams)


def leaking_turns(
    turn_texts: Sequence[str],
    shared_hints: Iterable[str],
    turn_hints: Sequence[Iterable[str]] | None = None,
    n: int = NGRAM_WORDS,
) -> int:
    """How many turns reproduce a hint n-gram.

    Args:
      turn_texts: the assistant turns' texts (thinking included).
      shared_hints: references for every turn (the requirements' own hint texts).
      turn_hints: per turn, the extra hint texts the teacher was shown for it (None: none).
      n: n-gram length in words.
    """
    shared = reference_ngrams(shared_hints, n)
    count = 0
    for k, text in enumerate(turn_texts):
        grams = shared
        if turn_hints is not None and k < len(turn_hints):
            grams = shared | reference_ngrams(turn_hints[k], n)
        count += bool(grams) and contains_ngram(words(text), grams)
    return count
