"""What goes into and comes out of the engine: `Request`, `Completion`, and the engine's
per-sequence record `Sequence`.

A request's context is its prompt, or, with `continue_from`, the finished request's context
(its prompt and generated tokens) followed by `prompt_ids` (the next turn of an episode: the
tool's output and the next assistant header). Its random stream is `seed` (default: derived
from the request id), and draw i of the request uses uniform (rng, seed, i)
(`tg_jax.engine.paged.request_uniforms`), so what a request samples does not depend on the
slot, the step or the other requests: `Sampler.sample(..., row_ids=[seed])` draws the same
numbers for the same row.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Hashable
from collections.abc import Sequence as Seq

import numpy as np


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request.

    Attributes:
      request_id: unique among the engine's live and kept requests (any hashable).
      prompt_ids: tokens to append (the whole prompt, or with `continue_from` the tokens that
        follow the finished request's context); may be empty with `continue_from`.
      max_new_tokens: >= 1, tokens to generate at most.
      temperature, top_k, top_p: the sampling distribution (`tg_jax.sampling.methods`;
        temperature 0 is greedy).
      stop_ids: generation ends after drawing one of them (it is included).
      policy_version: if set, the request waits until the engine's weights have at least this
        version (`Engine.update_weights`).
      continue_from: id of a finished request whose context this one extends (multi-turn).
      seed: the request's random stream (default: from the request id).
      routes_from: with a routing record (router replay), the completion carries it from this
        position of the context on (a multi-turn episode's new window; 0 = all of it).
    """

    request_id: Hashable
    prompt_ids: Seq[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_ids: Seq[int] = ()
    policy_version: int | None = None
    continue_from: Hashable | None = None
    seed: int | None = None
    routes_from: int = 0

    def stream(self) -> int:
        """The int32 id of the request's random stream."""
        if self.seed is not None:
            return int(self.seed) & 0x7FFFFFFF
        if isinstance(self.request_id, int | np.integer):
            return int(self.request_id) & 0x7FFFFFFF
        return zlib.crc32(repr(self.request_id).encode()) & 0x7FFFFFFF


@dataclasses.dataclass
class Completion:
    """A finished request.

    Attributes:
      request_id: the request's id.
      token_ids: generated tokens (the stop token included when finish_reason is "stop").
      logprobs: [n] f32 log-probs of the tokens under the distribution they were drawn from
        (the sampler's `logprobs`: 0 for greedy draws).
      raw_logprobs: [n] f32 temperature-1 log-probs of the same tokens (the model's).
      finish_reason: "stop", "length", "error" (the request was refused) or "invalid" (the
        engine returned unusable output: a non-finite log-prob or an out-of-vocabulary token).
      policy_version: weights version that drew the last token (None on error).
      first_policy_version: weights version that drew the first token.
      message: why, for an "error".
      prefill_tokens: context tokens the engine prefilled for the request (re-prefills after
        a preemption included; shared and continued pages excluded).
      preemptions: times the request was preempted.
      routed_experts: with the engine's routing record (MoE router replay), [context +
        generated tokens - Request.routes_from, L, J] int16: the experts each layer routed
        each token from that position on to when it was fed (its context's too), -1 for a
        token not fed (the last one); else None.
    """

    request_id: Hashable
    token_ids: list[int]
    logprobs: np.ndarray
    raw_logprobs: np.ndarray
    finish_reason: str
    policy_version: int | None = None
    first_policy_version: int | None = None
    message: str = ""
    prefill_tokens: int = 0
    preemptions: int = 0
    routed_experts: np.ndarray | None = None


def error_completion(request: Request, message: str) -> Completion:
    empty = np.zeros((0,), np.float32)
    return Completion(request.request_id, [], empty, empty.copy(), "error", message=message)


@dataclasses.dataclass
class Sequence:
    """The engine's record of one request, from submission to completion.

    tokens = context (prompt_len tokens) + generated; `cached` of them have their keys and
    values in `pages` (pages[j] holds positions j * page_size..). While running, either
    cached < len(tokens) - 1 (prefill phase: chunks fill the context) or
    cached == len(tokens) - 1 (decode phase: the last token is fed next and the step draws).
    """

    request: Request
    order: int = 0  # admission counter (the most recent running sequence is preempted first)
    resolved: bool = False  # context known (continue_from looked up)
    tokens: list[int] = dataclasses.field(default_factory=list)
    prompt_len: int = 0
    logprobs: list[float] = dataclasses.field(default_factory=list)
    raw_logprobs: list[float] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    keys: list[bytes] = dataclasses.field(default_factory=list)  # prefix key of page j
    cached: int = 0
    slot: int | None = None
    versions: list[int] = dataclasses.field(default_factory=list)
    prefill_tokens: int = 0
    preemptions: int = 0
    shareable: bool = True  # its new pages enter the prefix index (not after a weight update)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def completion(self, finish_reason: str, routes: np.ndarray | None = None) -> Completion:
        gen = self.tokens[self.prompt_len :]
        return Completion(
            self.request.request_id,
            list(gen),
            np.asarray(self.logprobs, np.float32),
            np.asarray(self.raw_logprobs, np.float32),
            finish_reason,
            policy_version=self.versions[-1] if self.versions else None,
            first_policy_version=self.versions[0] if self.versions else None,
            prefill_tokens=self.prefill_tokens,
            preemptions=self.preemptions,
            routed_experts=routes,
        )


__all__ = ["Completion", "Request", "Sequence", "error_completion"]
