"""Host-side bookkeeping of the paged KV pool: the page allocator and the prefix index.

The device pool (`tg_jax.engine.paged`) is `num_pages` pages of `page_size` token slots per
layer; this module only decides which page holds what, in numpy / Python, between the jitted
calls. Page 0 is reserved: it is the scratch page that padding rows and padding tokens write
to, and the entry of every unused page-table column (what it holds is never attended to, the
attention masks by length). Pages 1..num_pages-1 are handed out.

  PageAllocator  free list (LIFO) + a refcount per page; `alloc` returns None when the pool is
                 empty (the engine then evicts finished sequences or preempts a running one).
  PageTable      a sequence's pages: the allocator and the index together, writes that
                 allocate pages (and copy a shared partial page first: copy-on-write), the
                 index's record of what each write put where, page tables of a call.
  PrefixIndex    which live page holds which tokens: page j of a context is keyed by a hash
                 chain over the context's tokens before it (blake2b of the previous key and
                 the previous page's tokens, so a key names the whole prefix), and the index
                 remembers the tokens written into each page so far. `match` walks a new
                 context page by page and returns the pages whose written tokens agree with
                 it: full pages, and at most one partially matching last page (its slots past
                 the match hold someone else's tokens; the sharer masks them by length and
                 copies the page before its first write into it: copy-on-write).

A page's tokens are the engine's record of what its slots hold: a write at offset o of a
page truncates the record to o first (so a stale, longer record cannot be matched), and a
freed page leaves the index. Limits: keys are 16-byte blake2b digests (a collision would share
a wrong prefix; at 2^-64 per pair it is ignored); matching costs one hash per page of the
context, on the host.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

SCRATCH_PAGE = 0  # never allocated: padding writes land here, unused table columns point here
_ROOT = b"tg_jax.engine.prefix"


class PageAllocator:
    """Free list and refcounts of pages 1..num_pages-1 (page 0 is `SCRATCH_PAGE`)."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"need at least 2 pages (one is the scratch page), got {num_pages}")
        self.num_pages = num_pages
        self.refcount = np.zeros((num_pages,), np.int32)
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out page 1 first
        self.peak_used = 0

    @property
    def capacity(self) -> int:
        """Pages that can be handed out (all but the scratch page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def alloc(self) -> int | None:
        """A fresh page with refcount 1, or None when none is free."""
        if not self._free:
            return None
        page = self._free.pop()
        self.refcount[page] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return page

    def incref(self, page: int) -> None:
        if self.refcount[page] < 1:
            raise ValueError(f"page {page} is not allocated")
        self.refcount[page] += 1

    def decref(self, page: int) -> bool:
        """Drops one reference; True when the page became free."""
        if self.refcount[page] < 1:
            raise ValueError(f"page {page} is not allocated")
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            self._free.append(page)
            return True
        return False


def chain_key(prev: bytes, tokens: Sequence[int]) -> bytes:
    """Key of the page after a full page holding `tokens`, whose own key is `prev`."""
    data = np.asarray(tokens, np.int64).tobytes()
    return hashlib.blake2b(prev + data, digest_size=16).digest()


class PrefixIndex:
    """Live pages by the hash of the context before them, with the tokens each holds."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._pages_by_key: dict[bytes, set[int]] = {}
        self._key: dict[int, bytes] = {}
        self._tokens: dict[int, list[int]] = {}

    @staticmethod
    def root() -> bytes:
        return _ROOT

    def register(self, page: int, key: bytes, tokens: Sequence[int] = ()) -> None:
        """Page `page` now starts a context whose tokens before it hash to `key`."""
        self.forget(page)
        self._key[page] = key
        self._tokens[page] = list(tokens)
        self._pages_by_key.setdefault(key, set()).add(page)

    def write(self, page: int, offset: int, tokens: Sequence[int]) -> None:
        """Records tokens written at slots offset.. of `page` (slots past them are stale)."""
        if page not in self._tokens:
            return
        if len(self._tokens[page]) < offset:  # slots before `offset` unknown: not matchable
            self.forget(page)
            return
        self._tokens[page] = self._tokens[page][:offset] + list(tokens)

    def tokens(self, page: int) -> list[int]:
        return list(self._tokens.get(page, ()))

    def forget(self, page: int) -> None:
        """The page was freed (or re-registered): it leaves the index."""
        key = self._key.pop(page, None)
        self._tokens.pop(page, None)
        if key is not None:
            pages = self._pages_by_key[key]
            pages.discard(page)
            if not pages:
                del self._pages_by_key[key]

    def match(self, context: Sequence[int], limit: int) -> tuple[list[int], int]:
        """Live pages holding the longest prefix of context[:limit] (limit <= len(context)).

        Returns (pages, matched tokens): full pages first, the last one possibly partial
        (matched tokens not a multiple of the page size).
        """
        ps = self.page_size
        key, pages, matched = _ROOT, [], 0
        while matched < limit:
            want = list(context[matched : min(matched + ps, limit)])
            best, best_n = None, 0
            for page in sorted(self._pages_by_key.get(key, ())):
                n = _common_prefix(self._tokens[page], want)
                if n > best_n:
                    best, best_n = page, n
            if best is None:
                break
            pages.append(best)
            matched += best_n
            if best_n < ps:
                break
            key = chain_key(key, want)
        return pages, matched


class PageTable:
    """The pages of the engine's sequences (`tg_jax.engine.requests.Sequence`: its `tokens`,
    `pages`, `cached` positions written, `keys` and `shareable`) in a pool of `num_pages`.

    Which page to take when none is free, and what to do then, is the engine's: `write`
    takes its `alloc(seq)` (None: `seq` itself had to give its pages up) and its
    `copy(old, new)` of a page's device contents."""

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.index = PrefixIndex(page_size)

    def forget_contents(self) -> None:
        """No page may be matched from now on (they hold older weights' keys and values)."""
        self.index = PrefixIndex(self.page_size)

    def page_key(self, seq: Any, j: int) -> bytes:
        """Prefix key of the sequence's page j (its tokens before position j * page_size)."""
        if not seq.keys:
            seq.keys.append(self.index.root())
        while len(seq.keys) <= j:
            i = len(seq.keys)
            seq.keys.append(
                chain_key(seq.keys[-1], seq.tokens[(i - 1) * self.page_size : i * self.page_size])
            )
        return seq.keys[j]

    def prepare_write(
        self,
        seq: Any,
        n: int,
        alloc: Callable[[Any], int | None],
        copy: Callable[[int, int], None],
    ) -> bool:
        """Pages for writing positions cached..cached+n-1: copies a shared partial page first,
        allocates new ones. False when `seq` itself had to be preempted for them."""
        ps, start = self.page_size, seq.cached
        if start % ps and self.allocator.refcount[seq.pages[start // ps]] > 1:
            old = seq.pages[start // ps]
            new = alloc(seq)
            if new is None:
                return False
            copy(old, new)
            known = self.index.tokens(old)
            if seq.shareable and len(known) >= start % ps:
                self.index.register(new, self.page_key(seq, start // ps), known[: start % ps])
            seq.pages[start // ps] = new
            self.decref(old)
        while len(seq.pages) * ps < start + n:
            new = alloc(seq)
            if new is None:
                return False
            if seq.shareable:
                self.index.register(new, self.page_key(seq, len(seq.pages)))
            seq.pages.append(new)
        return True

    def record_write(self, seq: Any, n: int) -> None:
        """After a call wrote positions cached..cached+n-1: the index learns their tokens."""
        ps = self.page_size
        pos = seq.cached
        while pos < seq.cached + n:
            end = min((pos // ps + 1) * ps, seq.cached + n)
            self.index.write(seq.pages[pos // ps], pos % ps, seq.tokens[pos:end])
            pos = end
        seq.cached += n

    def decref(self, page: int) -> None:
        if self.allocator.decref(page):
            self.index.forget(page)

    def free(self, seq: Any) -> None:
        """Drops the sequence's pages (its tokens stay: it re-prefills if it runs again)."""
        for page in seq.pages:
            self.decref(page)
        seq.pages, seq.cached = [], 0

    def table(self, seqs: Sequence[Any], widths: Sequence[int]) -> np.ndarray:
        """[len(seqs), width] page tables (unused columns and None rows: the scratch page);
        the width is the smallest of `widths` holding every row's pages."""
        held = max((len(s.pages) for s in seqs if s is not None), default=1)
        width = next(w for w in widths if w >= held)
        table = np.full((len(seqs), width), SCRATCH_PAGE, np.int32)
        for i, s in enumerate(seqs):
            if s is not None:
                table[i, : len(s.pages)] = s.pages
        return table


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


__all__ = ["SCRATCH_PAGE", "PageAllocator", "PageTable", "PrefixIndex", "chain_key"]
