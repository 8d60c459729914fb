"""The rollout engine: continuous batching of requests over a paged KV pool.

One scheduling iteration (`Engine.step`), driven by ONE thread (any thread may `submit`):

  1. admit: waiting requests (FIFO; preempted ones are requeued at the front) take free
     decode slots while the pool can hold them. A request's context is matched against the
     live pages (`pages.PrefixIndex`): pages holding the same prefix (an identical prompt of
     a GRPO group, the finished turn a `continue_from` request extends) are shared by
     refcount, so only the rest is prefilled. At least the last context token is always
     fed again: its logits draw the first new token. Skipped for now (later ones may pass
     them): requests waiting for a weights version (`Request.policy_version`), and requests
     whose prefix a running sequence is still prefilling (a GRPO group's G - 1 followers
     wait for the leader's pages instead of prefilling the same prompt G times).
  2. prefill: up to `prefill_rows` sequences in their prefill phase run one chunk of
     `prefill_chunk` tokens each (one jitted call); a context's last token is left to 3.
  3. decode: every sequence in its decode phase (one jitted call) feeds its last
     token, draws the next one (per-request random streams; up to `decode_steps` tokens a
     call) and finishes on a stop id or its token budget; its slot is free for the next
     step's admissions.

Pages are allocated when a write needs them (a sequence holds pages only for its written
tokens); a write into a shared page copies it first (copy-on-write). When the pool is empty,
finished sequences kept for continuation lose their pages first (least recently finished
first; their tokens are kept, a continuation then re-prefills), then the most recently
admitted running sequence is preempted: its pages are freed and it is requeued at the front,
to re-prefill its context and generated tokens later (its draws continue at the same indices,
so it samples what it would have sampled). A request whose context plus max_new_tokens
exceeds the per-sequence limit (max_pages_per_seq * page_size) or the pool completes at once
with finish_reason "error".

Shapes (`warmup` compiles them all up front; nothing compiles in steady state, and
`num_traces` counts traces): decode [rows] with rows the power-of-two bucket of the decoding
sequences (`slot_buckets`, from MIN_BUCKET to max_slots), prefill [prefill_rows,
prefill_chunk], page tables [., width] with width the power-of-two bucket of the longest row's
pages (`page_buckets`, from MIN_BUCKET to max_pages_per_seq). Limits: host scheduling
between calls (each step waits for its drawn tokens: with decode_steps 1, one host round trip
per token); a step's attention reads `width` pages of every row, the longest row's bucket;
`update_weights` applies from the next step on (sequences in flight keep their keys and
values from the older weights, and no new request shares them;
`Completion.first_policy_version` tells).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Hashable, Iterable
from typing import Any

import jax
import numpy as np

from tg_jax.engine import paged
from tg_jax.engine.batches import decode_arrays, prefill_arrays, take_draws
from tg_jax.engine.paged import TRACES, copy_jit, decode_jit, prefill_jit, routes_jit, weights_jit
from tg_jax.engine.pages import PageAllocator, PageTable, PrefixIndex
from tg_jax.engine.placement import Placement, for_sampler
from tg_jax.engine.requests import Completion, Request, Sequence, error_completion
from tg_jax.models.qwen3 import Transformer
from tg_jax.sampling.trajectory import aligned_routes

# Smallest rows / page-table-width bucket: each bucket pair compiles the whole model, and a
# smaller call padded costs little more (16, the smallest batch vLLM's TPU runner pads to).
MIN_BUCKET = 16


class Engine:
    """Continuous-batching generation over a paged KV pool (module docstring)."""

    def __init__(
        self,
        model: Transformer,
        params: Any,
        *,
        max_slots: int = 8,
        page_size: int = 16,
        max_pages_per_seq: int = 16,
        num_pages: int | None = None,
        prefill_chunk: int = 32,
        prefill_rows: int = 2,
        rng: jax.Array | None = None,
        version: int = 0,
        prefix_sharing: bool = True,
        max_kept: int = 1024,
        pad_id: int = 0,
        bucket_pages: bool = True,
        bucket_slots: bool = True,
        min_bucket: int = MIN_BUCKET,
        decode_steps: int = 1,
        stop_width: int = 4,
        record_routes: bool = False,
        mesh: Any = None,
    ):
        """Args:
        max_slots: sequences decoded per step.
        page_size, max_pages_per_seq: page geometry; a sequence's context and generated tokens
          fit in max_pages_per_seq * page_size positions.
        num_pages: pool size including the scratch page (default: every slot at full length).
        prefill_chunk, prefill_rows: the prefill call's [rows, chunk] block.
        rng: PRNG key of the requests' random streams (default key(0)).
        version: the weights' version (`Completion.policy_version`).
        prefix_sharing: match new contexts against live pages (off: only `continue_from`).
        max_kept: finished requests remembered for `continue_from` (oldest forgotten first).
        bucket_pages: a call's page tables are as wide as the longest row needs, rounded up to
          a power of two (`page_buckets`: one compilation each; `warmup` compiles them all);
          off: always max_pages_per_seq wide (one compilation, every step reads all pages).
        bucket_slots: a decode call has as many rows as sequences decode, rounded up to a
          power of two (`slot_buckets`; off: max_slots rows). min_bucket: both's smallest.
        decode_steps: tokens a decode call draws per row at most (`paged.sample_steps`): one
          host round trip per K tokens instead of per token; a row that stops early idles for
          the rest of the call, and admissions wait for the call's end.
        stop_width: stop ids per request checked on the device (more are checked on the
          host; the row then draws past its stop, which is dropped).
        record_routes: MoE: every completion carries the experts each layer routed each of its
          tokens to (`Completion.routed_experts`, for router replay in the trainer).
        mesh: the devices the engine runs on as one replica (`placement`: weights and the
          pool's KV heads split over "tensor", rows over "data"; a sampler's ("data", "tensor")
          mesh as it is, another (a trainer's) remade by `placement.engine_mesh`); None or one
          device: the default device (or wherever the params are).
        """
        if min(decode_steps, stop_width) < 1:
            raise ValueError(f"decode_steps, stop_width must be >= 1: {decode_steps}, {stop_width}")
        self.model, self.max_pages_per_seq = model, int(max_pages_per_seq)
        self.max_slots, self.page_size = int(max_slots), int(page_size)
        self.num_pages = num_pages or self.max_slots * self.max_pages_per_seq + 1
        self.chunk, self.prefill_rows = int(prefill_chunk), int(prefill_rows)
        self.rng = jax.random.key(0) if rng is None else rng
        self.prefix_sharing, self.max_kept, self.pad_id = prefix_sharing, max_kept, pad_id
        self.bucket_pages, self.bucket_slots = bucket_pages, bucket_slots
        self.min_bucket = int(min_bucket)
        self.decode_steps, self.stop_width = int(decode_steps), int(stop_width)
        self.num_traces = 0  # traces (compilations) this engine's calls caused
        mesh = for_sampler(mesh, model.config.num_kv_heads)
        self.placement = None if mesh is None else Placement(model, mesh)
        self.pool = paged.init_pool(
            model, self.num_pages, self.page_size, record_routes, self.placement
        )
        self.pages = PageTable(self.num_pages, self.page_size)
        self._slots: list[Sequence | None] = [None] * self.max_slots
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._kept: collections.OrderedDict[Hashable, Sequence] = collections.OrderedDict()
        self._results: dict[Hashable, Completion] = {}
        self._cond = threading.Condition()
        self._step_lock = threading.RLock()
        self._paused = False
        self._order = 0
        self._counts = collections.Counter()
        self._occupancy_sum = 0.0
        self.update_weights(params, version)

    def _call(self, fn, *args):
        """A jitted function of this module, counting the traces the call caused."""
        before = TRACES[0]
        if self.placement is not None:
            args = self.placement.host(args)
        out = fn(self.model, *args)
        self.num_traces += TRACES[0] - before
        return out

    # --- public API -----------------------------------------------------------------------

    @property
    def max_context(self) -> int:
        """Positions one sequence may use (context + generated tokens)."""
        return self.max_pages_per_seq * self.page_size

    @property
    def allocator(self) -> PageAllocator:
        return self.pages.allocator

    @property
    def index(self) -> PrefixIndex:
        return self.pages.index

    def update_weights(self, params: Any, version: int) -> None:
        """New weights from the next step on (call between steps: it takes the step lock)."""
        with self._step_lock:
            if self.placement is not None:
                params = self.placement.params(params)
            self._weights = paged.with_params(self.model, self._call(weights_jit, params), params)
            self.version = int(version)
            # Pages written so far hold the old weights' keys and values: no new request may
            # share them (running and kept sequences keep their own).
            self.pages.forget_contents()
            for seq in [*self._slots, *self._kept.values()]:
                if seq is not None:
                    seq.shareable = False

    def wait_weights(self) -> None:
        """Blocks until the weights of the last `update_weights` are computed (its sync time)."""
        jax.block_until_ready(self._weights)

    def pause(self) -> None:
        """`step` does nothing until `resume` (requests may still be submitted)."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    def submit(self, request: Request) -> None:
        """Queues a request (thread-safe); it is checked when admitted (errors complete it)."""
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        with self._cond:
            self._waiting.append(Sequence(request))

    def release(self, request_id: Hashable) -> None:
        """Forgets a finished request kept for `continue_from` (frees its pages)."""
        with self._step_lock:
            seq = self._kept.pop(request_id, None)
            if seq is not None:
                self.pages.free(seq)

    def result(self, request_id: Hashable, timeout: float | None = None) -> Completion:
        """Waits for (and removes) a request's completion; TimeoutError after `timeout`."""
        with self._cond:
            if not self._cond.wait_for(lambda: request_id in self._results, timeout):
                raise TimeoutError(f"request {request_id!r} did not complete in {timeout}s")
            return self._results.pop(request_id)

    def has_work(self) -> bool:
        """Whether a step can make progress (running sequences, or admissible waiting ones)."""
        with self._cond:
            waiting = any(not self._blocked(s) for s in self._waiting)
        return waiting or any(s is not None for s in self._slots)

    def run_until_done(self) -> list[Completion]:
        """Steps until nothing is running or admissible; returns the completions, in order
        (handed over: `result` no longer holds them)."""
        done = []
        while not self._paused and self.has_work():
            done.extend(self.step())
        with self._cond:
            for c in done:
                self._results.pop(c.request_id, None)
        return done

    def generate(self, requests: Iterable[Request]) -> list[Completion]:
        """Submits the requests, runs until done; their completions in the requests' order."""
        requests = list(requests)
        for r in requests:
            self.submit(r)
        by_id = {c.request_id: c for c in self.run_until_done()}
        with self._cond:  # any that an earlier `step` finished
            for r in requests:
                if r.request_id not in by_id and r.request_id in self._results:
                    by_id[r.request_id] = self._results.pop(r.request_id)
        return [by_id[r.request_id] for r in requests]

    def cached_tokens(self) -> int:
        """Tokens whose keys and values are in pages (running and kept sequences)."""
        live = [s for s in self._slots if s is not None] + list(self._kept.values())
        return sum(s.cached for s in live)

    @property
    def stats(self) -> dict[str, float]:
        """Counters: preemptions, evictions, prefill_tokens, decode_steps, decode_tokens,
        prefill_calls, cow_copies, shared_tokens, steps, slot_occupancy (mean fraction of
        slots holding a sequence per step), decode_occupancy (mean fraction of slots decoding
        per decode step), peak_pages_used, pages_used, pages_total."""
        c = self._counts
        out = {
            k: float(c[k])
            for k in (
                "preemptions",
                "evictions",
                "prefill_tokens",
                "decode_steps",
                "decode_tokens",
                "prefill_calls",
                "cow_copies",
                "shared_tokens",
                "steps",
                "errors",
            )
        }
        out["slot_occupancy"] = self._occupancy_sum / max(c["steps"], 1)
        out["decode_occupancy"] = c["decode_tokens"] / max(c["decode_steps"] * self.max_slots, 1)
        out["peak_pages_used"] = float(self.allocator.peak_used)
        out["pages_used"] = float(self.allocator.num_used)
        out["pages_total"] = float(self.allocator.capacity)
        return out

    def step(self) -> list[Completion]:
        """One scheduling iteration (module docstring); returns the requests it finished,
        which `result` also holds until taken (a caller that only steps should take them, or
        use `run_until_done`)."""
        with self._step_lock:
            if self._paused:
                return []
            finished: list[Completion] = []
            self._admit(finished)
            self._counts["steps"] += 1
            self._occupancy_sum += sum(s is not None for s in self._slots) / self.max_slots
            self._run_prefill()
            self._run_decode(finished)
            if finished:
                with self._cond:
                    self._results.update((c.request_id, c) for c in finished)
                    self._cond.notify_all()
            return finished

    # --- admission --------------------------------------------------------------------------

    def _blocked(self, seq: Sequence) -> bool:
        v = seq.request.policy_version
        return v is not None and v > self.version

    def _resolve(self, seq: Sequence) -> str | None:
        """Sets the sequence's context; returns an error message when it cannot run."""
        r = seq.request
        if any(s is not None and s.request.request_id == r.request_id for s in self._slots):
            return f"request id {r.request_id!r} is already running"
        context = list(r.prompt_ids)
        if r.continue_from is not None:
            parent = self._kept.get(r.continue_from)
            if parent is None:
                return f"continue_from {r.continue_from!r}: no finished request kept by that id"
            context = parent.tokens + context
        if not context:
            return "empty prompt"
        total = len(context) + r.max_new_tokens
        if total > self.max_context:
            return (
                f"context {len(context)} + max_new_tokens {r.max_new_tokens} = {total} "
                f"exceeds the per-sequence limit {self.max_context}"
            )
        if -(-total // self.page_size) > self.allocator.capacity:
            return (
                f"needs {-(-total // self.page_size)} pages, the pool has {self.allocator.capacity}"
            )
        seq.tokens, seq.prompt_len, seq.resolved = context, len(context), True
        return None

    def _admit(self, finished: list[Completion]) -> None:
        """Moves waiting requests into free slots, in queue order, while the pool can take
        them. Skipped for now: requests waiting for a weights version, and requests whose
        prefix a running sequence is still prefilling (they share its pages once written)."""
        with self._cond:
            queue = list(self._waiting)
        for seq in queue:
            if None not in self._slots:
                return
            if self._blocked(seq):
                continue
            if not seq.resolved:
                message = self._resolve(seq)
                if message is not None:
                    self._dequeue(seq)
                    self._counts["errors"] += 1
                    finished.append(error_completion(seq.request, message))
                    continue
            pages, matched = self._match(seq)
            if self._defer(seq, matched):
                continue
            need = -(-len(seq.tokens) // self.page_size) - matched // self.page_size + 1
            running = any(s is not None for s in self._slots)
            if running and need > self.allocator.num_free + self._reclaimable():
                return  # wait for pages (admission stays in queue order)
            self._dequeue(seq)
            self._start(seq, pages, matched)

    def _dequeue(self, seq: Sequence) -> None:
        with self._cond:
            self._waiting.remove(seq)

    def _start(self, seq: Sequence, pages: list[int], matched: int) -> None:
        """Puts an admitted sequence in a free slot, holding its matched pages."""
        for page in pages:
            self.allocator.incref(page)
        seq.pages, seq.cached, seq.keys = pages, matched, []
        self._counts["shared_tokens"] += matched
        parent = seq.request.continue_from
        if parent is not None and parent in self._kept:
            self.release(parent)  # its pages now belong to this turn
        seq.slot = self._slots.index(None)
        self._slots[seq.slot] = seq
        self._order += 1
        seq.order = self._order

    def _defer(self, seq: Sequence, matched: int) -> bool:
        """Whether a running sequence still prefills more of this context's prefix than the
        live pages hold (it waits to share them)."""
        if not self.prefix_sharing:
            return False
        ctx = np.asarray(seq.tokens[: len(seq.tokens) - 1])
        for other in self._slots:
            if other is None or other.cached >= len(other.tokens) - 1:
                continue
            theirs = np.asarray(other.tokens[: len(ctx)])
            diff = np.flatnonzero(theirs != ctx[: len(theirs)])
            common = int(diff[0]) if diff.size else len(theirs)
            if common > matched and other.cached < common:
                return True
        return False

    def _match(self, seq: Sequence) -> tuple[list[int], int]:
        """Live pages holding a prefix of the context (all but its last token): the longer of
        the prefix index's match (with prefix sharing) and the `continue_from` parent's own
        pages (which a continuation takes over even across weight updates)."""
        limit = len(seq.tokens) - 1
        pages, matched = self.index.match(seq.tokens, limit) if self.prefix_sharing else ([], 0)
        seq.shareable = True
        parent = self._kept.get(seq.request.continue_from)
        if parent is not None and min(parent.cached, limit) > matched:
            matched = min(parent.cached, limit)
            pages = parent.pages[: -(-matched // self.page_size)]
            seq.shareable = parent.shareable
        return pages, matched

    def _reclaimable(self) -> int:
        """Pages that evicting every kept sequence would free."""
        rc = self.allocator.refcount
        return sum(1 for s in self._kept.values() for p in s.pages if rc[p] == 1)

    def _alloc(self, seq: Sequence) -> int | None:
        """A free page for `seq`: evicts kept sequences, then preempts the most recently
        admitted running one (None when that was `seq`)."""
        page = self.allocator.alloc()
        while page is None:
            if any(s.pages for s in self._kept.values()):
                victim = next(s for s in self._kept.values() if s.pages)
                self.pages.free(victim)
                self._counts["evictions"] += 1
            else:
                victim = max((s for s in self._slots if s is not None), key=lambda s: s.order)
                self._preempt(victim)
                if victim is seq:
                    return None
            page = self.allocator.alloc()
        return page

    def _preempt(self, seq: Sequence) -> None:
        """Frees a running sequence's pages and requeues it at the front of the queue."""
        self.pages.free(seq)
        self._slots[seq.slot] = None
        seq.slot = None
        seq.preemptions += 1
        self._counts["preemptions"] += 1
        with self._cond:
            self._waiting.appendleft(seq)

    def page_buckets(self) -> list[int]:
        """Page-table widths a call may get (`paged.buckets` of max_pages_per_seq)."""
        return paged.buckets(self.max_pages_per_seq, self.bucket_pages, self.min_bucket)

    def _table(self, seqs: list[Sequence | None]) -> np.ndarray:
        """A call's page tables (`PageTable.table`: the smallest bucket holding every row's
        pages; attention reads width pages a row)."""
        return self.pages.table(seqs, self.page_buckets())

    def _prepare_write(self, seq: Sequence, n: int) -> bool:
        return self.pages.prepare_write(seq, n, self._alloc, self._copy_page)

    def _copy_page(self, old: int, new: int) -> None:
        self.pool = self._call(copy_jit, self.pool, np.int32(old), np.int32(new))
        self._counts["cow_copies"] += 1

    def warmup(self) -> None:
        """Compiles every call shape (each page-table bucket of prefill and decode, the page
        copy) on padding rows, which write only the scratch page."""
        with self._step_lock:
            b, c = self.prefill_rows, self.chunk
            zeros_b = np.zeros((b,), np.int32)
            for width in self.page_buckets():
                table = np.zeros((b, width), np.int32)
                tokens = np.zeros((b, c), np.int32)
                self.pool = self._call(
                    prefill_jit, self._weights, self.pool, tokens, zeros_b, zeros_b, table
                )
                for rows in self.slot_buckets():
                    batch = self._decode_batch([], size=rows)
                    batch["table"] = np.zeros((rows, width), np.int32)
                    _, self.pool = self._call(
                        decode_jit, self._weights, self.pool, self.rng, batch, self.decode_steps
                    )
                if self.pool.routes is not None:
                    self._call(routes_jit, self.pool.routes, np.zeros((width,), np.int32))
            self.pool = self._call(copy_jit, self.pool, np.int32(0), np.int32(0))
            jax.block_until_ready(self.pool)

    def _running(self, prefill: bool) -> list[Sequence]:
        """Running sequences in their prefill (or decode) phase, oldest first."""
        seqs = [s for s in self._slots if s is not None]
        seqs = [s for s in seqs if (len(s.tokens) - s.cached > 1) == prefill]
        return sorted(seqs, key=lambda s: s.order)

    def _run_prefill(self) -> None:
        """One chunk for up to `prefill_rows` sequences in their prefill phase."""
        rows: list[tuple[Sequence, int]] = []
        for seq in self._running(prefill=True):
            if len(rows) == self.prefill_rows:
                break
            if seq.slot is None:  # preempted for an older row's pages
                continue
            n = min(self.chunk, len(seq.tokens) - 1 - seq.cached)
            if self._prepare_write(seq, n):
                rows.append((seq, n))
        if not rows:
            return
        b = self.prefill_rows
        tokens, start, lengths = prefill_arrays(rows, b, self.chunk, self.pad_id)
        table = self._table([s for s, _ in rows] + [None] * (b - len(rows)))
        self.pool = self._call(prefill_jit, self._weights, self.pool, tokens, start, lengths, table)
        self._counts["prefill_calls"] += 1
        for seq, n in rows:
            self.pages.record_write(seq, n)
            seq.prefill_tokens += n
            self._counts["prefill_tokens"] += n

    def slot_buckets(self) -> list[int]:
        """Decode batch sizes (`paged.buckets` of max_slots)."""
        return paged.buckets(self.max_slots, self.bucket_slots, self.min_bucket)

    def _draws(self, seq: Sequence) -> int:
        """Tokens the sequence draws in this decode call at most (its budget's rest)."""
        return min(self.decode_steps, seq.request.max_new_tokens - seq.generated)

    def _decode_batch(self, rows: list[Sequence], size: int = 0) -> dict[str, np.ndarray]:
        """The decode call's arrays: row i is rows[i], padded to a `slot_buckets` size (or
        to `size` rows)."""
        b = size or next(n for n in self.slot_buckets() if n >= max(len(rows), 1))
        steps = [self._draws(s) for s in rows]
        batch = decode_arrays(rows, b, steps, self.stop_width, self.pad_id)
        batch["table"] = self._table(rows + [None] * (b - len(rows)))
        return batch

    def _run_decode(self, finished: list[Completion]) -> None:
        """One decode call (<= decode_steps tokens a row) of every sequence in its decode phase;
        finishes the done ones."""
        rows = []
        for seq in self._running(prefill=False):
            if seq.slot is not None and self._prepare_write(seq, self._draws(seq)):
                rows.append(seq)
        rows = [s for s in rows if s.slot is not None]
        if not rows:
            return
        batch = self._decode_batch(rows)
        args = (self._weights, self.pool, self.rng, batch, self.decode_steps)
        outs, self.pool = self._call(decode_jit, *args)
        tok, lp, raw, drawn = jax.device_get(outs)
        self._counts["decode_steps"] += int(batch["steps"].max())
        for i, seq in enumerate(rows):
            first = int(seq.generated == 0 and drawn[i, 0])  # the context's last token fed
            self._counts["prefill_tokens"] += first
            seq.prefill_tokens += first
            n, reason = take_draws(seq, tok[i], lp[i], raw[i], drawn[i], self.version)
            self.pages.record_write(seq, n)  # the n tokens fed (the last drawn: by the next call)
            self._counts["decode_tokens"] += n
            if reason is not None:
                finished.append(self._finish(seq, reason))

    def _finish(self, seq: Sequence, reason: str) -> Completion:
        """Frees the slot; the sequence (and its pages) is kept for `continue_from`."""
        self._slots[seq.slot] = None
        seq.slot = None
        rid = seq.request.request_id
        self.release(rid)  # an older request of the same id
        self._kept[rid] = seq
        while len(self._kept) > self.max_kept:
            _, old = self._kept.popitem(last=False)
            self.pages.free(old)
        return seq.completion(reason, self._routes(seq))

    def _routes(self, seq: Sequence) -> np.ndarray | None:
        """The routing record of the sequence's tokens from `Request.routes_from` on [n, L, J]
        (None without one): its fed tokens' (positions < cached) read from the pages holding
        them (a bucket of them: no new compilation), -1 for the rest (its last token)."""
        if self.pool.routes is None:
            return None
        start = min(max(int(seq.request.routes_from), 0), len(seq.tokens))
        first = start // self.page_size  # the first page holding the window
        pages = list(seq.pages[first:])
        width = next(b for b in self.page_buckets() if b >= max(len(pages), 1))
        table = np.asarray(pages + [0] * (width - len(pages)), np.int32)  # 0: scratch page
        fed = np.asarray(self._call(routes_jit, self.pool.routes, table))
        offset = first * self.page_size
        fed = fed[: max(seq.cached - offset, 0)]
        return aligned_routes(fed, len(seq.tokens) - offset)[start - offset :]


__all__ = ["Engine"]
