"""Judged requirements: a turn's verdict comes from a judge, not from a rule.

The protocol's tier of style norms that need judgment ("the reply is polite", "the report
explains the change to a reviewer") is judged by a model or by a user's function. A judge
takes a batch of turn texts and returns one verdict each: True (met), False (failed) or None
(it could not tell: the turn is *unjudged*, counted as a plug-in checker's that raised).
`judged_requirement` makes a `Requirement` of one:

    from tg_jax.envs import judge
    from tg_jax.engine.judge import ModelJudge          # a checkpoint served by the engine

    polite = judge.judged_requirement(                  # env.requirements=("my_rules:polite",)
        "polite", ModelJudge("gs://bucket/Qwen3-8B", RUBRIC), hint="Be polite.")

Made once, at module level (a plug-in requirement object), it is one judge for every
environment of the process: one cache, one batch queue (a factory that builds a new judge per
environment batches and caches nothing). A `ModelJudge` loads its checkpoint at its first
batch, not at import.

Batches: the environments judge a turn at a time, from several threads (`rl_loop.env_workers`,
the plug-in checkers' pool); a `BatchingJudge` queues the turns that wait at once and calls the
judge on them together from one worker thread (up to `batch_size`, after waiting `wait_s` for
more), so a model judge decodes them as one batch. Verdicts are cached by turn text (the judge
sees nothing else; a cached None is not asked again). A turn whose verdict is not back within
`timeout_s`, a judge that raises or returns the wrong number of verdicts: unjudged, logged
once per requirement.

`ScriptedJudge` is the built-in demonstration on models that cannot judge a rubric (the
embedded default's byte model): a rule's verdict flipped at declared false-positive and
false-negative rates, a fixed function of (seed, requirement, turn text) as the wrong training
judge (`tg_jax.envs.hints.VerdictNoise`). `tg_jax.evaluation.judge_agreement` measures any of
them against a user's labelled turns.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tg_jax.envs.base import Requirement, Unjudged
from tg_jax.envs.hints import VerdictNoise, noisy_verdict
from tg_jax.text.chat import THINK_END, THINK_START

Verdicts = Sequence[bool | None]
JudgeFn = Callable[[list[str]], Verdicts]
# An answer's first word, after any thinking block and leading punctuation or markup.
_THINK = re.compile(f"{re.escape(THINK_START)}.*?{re.escape(THINK_END)}", re.DOTALL)
_FIRST_WORD = re.compile(r"^[\W_]*(yes|no)\b", re.IGNORECASE)
_IDLE_S = 5.0  # a BatchingJudge's worker thread ends after this long without a turn


def parse_verdict(answer: str) -> bool | None:
    """A judge model's answer -> True ("yes"), False ("no") or None (anything else): its first
    word, case-insensitive, after a thinking block and leading punctuation ("**Yes**", "No.")."""
    m = _FIRST_WORD.match(_THINK.sub("", answer).strip())
    if m is None:
        return None
    return m.group(1).lower() == "yes"


class BatchingJudge:
    """Turn text -> verdict through `judge` called on batches, cached by text, with a timeout.

    Thread-safe: any thread calls `verdict`; the judge runs in this object's worker thread only
    (so a model judge's engine is driven by one thread). State under `_lock`: the cache, the
    queue of texts waiting for a batch, and their futures.

    Attributes:
      calls: judge calls made; judged: texts sent to the judge; hits: verdicts from the cache.
    """

    def __init__(
        self,
        judge: JudgeFn,
        *,
        name: str = "judge",
        batch_size: int = 64,
        wait_s: float = 0.02,
        timeout_s: float = 120.0,
    ):
        if batch_size < 1 or wait_s < 0 or timeout_s <= 0:
            raise ValueError(
                f"judge {name!r}: batch_size >= 1, wait_s >= 0, timeout_s > 0 needed, got "
                f"{batch_size}, {wait_s}, {timeout_s}"
            )
        self.judge, self.name = judge, name
        self.batch_size, self.wait_s, self.timeout_s = int(batch_size), wait_s, timeout_s
        self._lock = threading.Condition()
        self._cache: dict[str, bool | None] = {}
        self._futures: dict[str, concurrent.futures.Future] = {}
        self._queue: list[str] = []
        self._worker: threading.Thread | None = None
        self._warned = False
        self.calls = self.judged = self.hits = 0

    def verdict(self, text: str) -> bool:
        """The judge's verdict of `text`.

        Raises:
          Unjudged: the judge could not tell (None), raised, returned the wrong number of
            verdicts, or took longer than timeout_s.
        """
        with self._lock:
            if text in self._cache:
                self.hits += 1
                found = self._cache[text]
                if found is None:
                    raise Unjudged(f"{self.name}: the judge could not tell")
                return found
            future = self._futures.get(text)
            if future is None:
                future = self._futures[text] = concurrent.futures.Future()
                self._queue.append(text)
                self._start()
                self._lock.notify_all()
        try:
            found = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            self._warn(f"no verdict within {self.timeout_s:g} s")
            raise Unjudged(f"{self.name}: no verdict within {self.timeout_s:g} s") from None
        except Exception as e:  # noqa: BLE001 (the judge's own error, set by the worker)
            self._warn(f"the judge raised {type(e).__name__}: {e}")
            raise Unjudged(f"{self.name}: the judge raised {type(e).__name__}: {e}") from e
        if found is None:
            raise Unjudged(f"{self.name}: the judge could not tell")
        return found

    def __call__(self, texts: Sequence[str]) -> list[bool | None]:
        """Verdicts of several texts (None where unjudged): the judge's interface, batched."""
        out = []
        for text in texts:
            try:
                out.append(self.verdict(text))
            except Unjudged:
                out.append(None)
        return out

    def _start(self) -> None:
        if self._worker is None:  # under _lock
            self._worker = threading.Thread(
                target=self._run, name=f"judge-{self.name}", daemon=True
            )
            self._worker.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue:  # idle: the thread ends (the next verdict starts one)
                    if not self._lock.wait(_IDLE_S) and not self._queue:
                        self._worker = None
                        return
                deadline = time.monotonic() + self.wait_s
                while len(self._queue) < self.batch_size and time.monotonic() < deadline:
                    self._lock.wait(max(0.0, deadline - time.monotonic()))
                batch, self._queue = self._queue[: self.batch_size], self._queue[self.batch_size :]
                futures = [self._futures[t] for t in batch]
                self.calls, self.judged = self.calls + 1, self.judged + len(batch)
            try:
                found = [None if v is None else bool(v) for v in self.judge(list(batch))]
                if len(found) != len(batch):
                    raise ValueError(f"{len(found)} verdicts for {len(batch)} turns")
            except Exception as e:  # noqa: BLE001 (a user's or a model's judge)
                with self._lock:
                    for t in batch:
                        self._futures.pop(t, None)
                for f in futures:
                    f.set_exception(e)
                continue
            with self._lock:
                for t, v in zip(batch, found, strict=True):
                    self._cache[t] = v
                    self._futures.pop(t, None)
            for f, v in zip(futures, found, strict=True):
                f.set_result(v)

    def _warn(self, message: str) -> None:
        with self._lock:
            first, self._warned = not self._warned, True
        if first:
            logging.warning("judge %r: %s (such turns are counted unjudged)", self.name, message)


def judged_requirement(
    name: str,
    judge: JudgeFn | BatchingJudge,
    hint: str,
    *,
    applies: Callable[[str], bool] | None = None,
    conditional: bool = False,
    batch_size: int = 64,
    wait_s: float = 0.02,
    timeout_s: float = 120.0,
) -> Requirement:
    """A `Requirement` judged by `judge` (texts -> verdicts; wrapped in a `BatchingJudge`
    unless it is one). Named in `env.requirements` through a plug-in (module docstring); its
    check's timeout is the judge's plus a second, so the batch's own timeout decides."""
    batching = (
        judge
        if isinstance(judge, BatchingJudge)
        else BatchingJudge(
            judge, name=name, batch_size=batch_size, wait_s=wait_s, timeout_s=timeout_s
        )
    )
    kw: dict[str, Any] = {} if applies is None else {"applies": applies}
    return Requirement(
        name,
        batching.verdict,
        hint,
        conditional=conditional,
        timeout_s=batching.timeout_s + 1.0,
        **kw,
    )


class ScriptedJudge:
    """A rule's verdict, flipped at declared rates: the judge of a demonstration on a model
    that cannot judge a rubric. Deterministic in (seed, name, text), so its errors are the
    same turns whichever batch or process judges them.

    Attributes:
      rule: turn text -> the true verdict; noise: the declared false-positive / -negative rates.
    """

    def __init__(
        self,
        rule: Callable[[str], bool],
        *,
        name: str,
        false_positive: float = 0.0,
        false_negative: float = 0.0,
        seed: int = 0,
    ):
        self.rule, self.name, self.seed = rule, name, int(seed)
        self.noise = VerdictNoise(float(false_positive), float(false_negative))

    def __call__(self, texts: Sequence[str]) -> list[bool]:
        return [
            noisy_verdict(bool(self.rule(t)), self.noise, self.seed, self.name, t) for t in texts
        ]


__all__ = ["BatchingJudge", "JudgeFn", "ScriptedJudge", "judged_requirement", "parse_verdict"]
