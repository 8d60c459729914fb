"""Host-side state of the episodes being played, and what a turn does to it.

Both ways of playing episodes keep their episodes here: the lock-step rollouts
(`tg_jax.sampling.rollout.play_episodes`, every live episode's turn in one sampler call) and the
agent loops on the rollout engine (`tg_jax.sampling.agent_loop`). An `Episode`'s tokens, roles,
turn ids and behaviour log-probs grow together, append-only (the layout and the limits:
`tg_jax.sampling.rollout`):

  _start_episodes    a fresh environment and the rendered user prompt per task
  _check_room        every prompt leaves room for a turn of `min_turn_tokens`
  visible            a turn's context under `hide_thinking` (no earlier <think> block)
  record_tokens      a sampled turn appended (a turn cut at its budget closed by a stop token
                     the policy did not sample); its text goes to the environment

What the environment's step does to the episode is `tg_jax.sampling.env_step`; the finished
episode's record, `tg_jax.sampling.records`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tg_jax.envs.base import Environment
from tg_jax.sampling.trajectory import Role, visible_context
from tg_jax.text import ChatRenderer

TERMINATIONS = ("done", "max_turns", "max_tokens", "env_error", "engine_error")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Episode limits and sampling settings of a batch of rollouts.

    Attributes:
      max_new_tokens: token budget of one assistant turn.
      max_total_tokens: context limit of an episode (prompt, turns, observations).
      max_turns: assistant turns per episode; 0 = until the environment ends the episode.
      min_turn_tokens: a turn is started only if at least this many tokens fit.
      temperature, top_k, top_p: sampling distribution (see tg_jax.sampling.sampler).
      observation_role: chat role of environment observations ("tool" or "user").
      env_workers: threads that run `env.step` calls of one turn in parallel.
      max_rows: most episodes one sampler call holds (0 = all of them); more are played in
        chunks of this many, one after the other, each from its own random streams (the
        episodes of one call, `play_episodes`): it bounds the sampler's memory (keys, values).
      hide_thinking: turns see no earlier <think> block (`visible`; re-prefilled).
      think_budget: most sampled tokens of a <think> block (engines only: `agent_loop`).
    """

    max_new_tokens: int = 128
    max_total_tokens: int = 512
    max_turns: int = 0
    min_turn_tokens: int = 8
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    observation_role: str = "tool"
    env_workers: int = 2
    max_rows: int = 0
    hide_thinking: bool = False
    think_budget: int = 0

    def __post_init__(self):
        if self.max_rows < 0:  # a negative chunk size would play no episode at all
            raise ValueError(f"sampler_mesh.max_rows must be >= 0 (0 = all), got {self.max_rows}")


@dataclasses.dataclass
class Episode:
    """Host-side state of one episode while it is being played (`to_trajectory` makes the record):
    `tokens`, `roles`, `turn_ids`, `logprobs` grow together (see `Trajectory` for their
    meaning); `verdicts` and `step_infos` get one entry per assistant turn."""

    task: Any
    task_id: str
    env: Environment
    group_id: int
    tokens: list[int]
    roles: list[int]
    turn_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    turn_starts: list[int] = dataclasses.field(default_factory=list)
    verdicts: list[dict[str, bool | None]] = dataclasses.field(default_factory=list)
    breaks: list[dict[str, int]] = dataclasses.field(default_factory=list)  # Trajectory.turn_breaks
    rewards: dict[str, float] | None = None
    termination: str = ""
    truncated_turns: int = 0
    prefill_tokens: float = 0.0
    step_infos: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    stream_id: int = 0  # its random stream (play_episodes' stream_ids)
    texts: list[str] = dataclasses.field(default_factory=list)  # per turn, as sent to the env
    error: str = ""  # the environment error that ended it (termination "env_error")
    weight_sync_s: float = 0.0  # the rollout engine's weight sync before its call (seconds)
    request_ids: list[str] = dataclasses.field(default_factory=list)  # engine requests, per turn
    call_times: dict[str, Any] | None = None  # the engine call's engine and tool-wait seconds
    routes: Any = None  # the rollout's routing record of its tokens (Trajectory.routed_experts)

    def append(self, ids: Sequence[int], role: Role, turn: int = -1, logprobs=None) -> None:
        self.tokens += [int(t) for t in ids]
        self.roles += [int(role)] * len(ids)
        self.turn_ids += [turn] * len(ids)
        self.logprobs += [0.0] * len(ids) if logprobs is None else [float(x) for x in logprobs]


def task_id_of(task: Any) -> str:
    """A task's id: its `task_id` attribute or key, else its str()."""
    if isinstance(task, dict) and "task_id" in task:
        return str(task["task_id"])
    return str(getattr(task, "task_id", task))


def _start_episodes(
    renderer: ChatRenderer,
    env_factory: Callable[[], Environment],
    tasks: Sequence[Any],
    group_ids: Sequence[int] | None,
    stream_ids: Sequence[int] | None,
) -> list[Episode]:
    """One fresh episode per task: a new environment, the rendered user prompt."""
    episodes = []
    for i, task in enumerate(tasks):
        env = env_factory()
        prompt = [{"role": "user", "content": env.reset(task)}]
        ids, roles = renderer.render_with_roles(prompt, tools=env.tool_schemas)
        gid = i if group_ids is None else int(group_ids[i])
        ep = Episode(task, task_id_of(task), env, gid, list(ids), [int(r) for r in roles])
        ep.stream_id = i if stream_ids is None else int(stream_ids[i])
        ep.turn_ids, ep.logprobs = [-1] * len(ids), [0.0] * len(ids)
        episodes.append(ep)
    return episodes


def _check_room(
    episodes: Sequence[Episode], room: Callable[[Episode], int], config: RolloutConfig
) -> None:
    """Raises unless every prompt leaves room for a turn of config.min_turn_tokens."""
    for ep in episodes:
        if room(ep) < config.min_turn_tokens:
            raise ValueError(
                f"task {ep.task_id}: prompt of {len(ep.tokens)} tokens leaves no room for a "
                f"turn of {config.min_turn_tokens}+ tokens within max_total_tokens="
                f"{config.max_total_tokens}"
            )


def visible(ep: Episode) -> list[int]:
    """The context of the turn `ep` is about to sample under `RolloutConfig.hide_thinking`
    (`trajectory.visible_context`, the rule the trainer's rows follow)."""
    keep = visible_context(ep.roles, ep.turn_ids, len(ep.turn_starts) - 1)
    return [t for t, k in zip(ep.tokens, keep, strict=True) if k]


def record_tokens(
    ep: Episode,
    renderer: ChatRenderer,
    tokens,
    logprobs,
    stopped: bool,
    prefill_tokens: float | None = None,
    routes=None,
    routes_from: int = 0,
) -> str:
    """Appends a sampled turn to `ep` (its stop token last if `stopped`; a turn cut at its
    budget is closed by an `<|im_end|>` the policy did not sample); returns its text. routes:
    the routing record of the context and turn from position `routes_from` on."""
    if prefill_tokens is not None:
        ep.prefill_tokens += float(prefill_tokens)
    if routes is not None:
        ep.routes = routes if not routes_from else np.concatenate([ep.routes[:routes_from], routes])
    header = renderer.assistant_header()
    k_turn = len(ep.turn_starts) - 1
    new = [int(t) for t in tokens]
    think = renderer.split_thinking(header + new)[len(header) :]
    for t, lp, is_think in zip(new, logprobs, think, strict=True):
        ep.append([t], Role.THINK if is_think else Role.ANSWER, k_turn, [lp])
    if stopped:
        new = new[:-1]
    else:
        ep.truncated_turns += 1
        ep.append([renderer.end_of_turn_ids[0]], Role.PROMPT)  # not sampled: closes the turn
    ep.texts.append(renderer.tokenizer.decode(new))
    return ep.texts[-1]
