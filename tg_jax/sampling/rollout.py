"""Multi-turn rollouts: the sampler and the environments, turn by turn, token-in/token-out.

An episode's tokens grow append-only; nothing is ever re-rendered. Every piece is what the
model's chat template writes for it (`tg_jax.text.ChatRenderer`), e.g. for Qwen3:

    render_with_roles([user prompt], tools)                            PROMPT
    [hint message]  (hinted evaluation only)                           HINT
    assistant header "<|im_start|>assistant\\n"                         PROMPT   <- turn_starts[k]
    sampled turn, up to and including its stop token                   THINK / ANSWER
    separator "\\n" (what the template writes after the stop token)     PROMPT
    observation message (rendered as `observation_role`)               ENV
    [hint] + header + next sampled turn ...

The prompt lists the environment's tools through the template's `tools` argument when the
environment has `tool_schemas`; the environment reads the model's calls in its tool format.

Every turn of every live episode is sampled in one batched `Sampler.sample` call. The
episodes' keys and values stay on the device between turns (`tg_jax.sampling.turn_cache`): a
turn prefills only what was appended since the last one (observation, hint, header; with
`hide_thinking` its whole visible context), and the G rollouts of a prompt prefill it once
(info["prefill_tokens"]). The turn text (sampled tokens minus the stop token, thinking
included) goes to `env.step` in a thread pool.

Limits:
  * A turn that reaches its token budget without a stop token is still recorded and sent to the
    environment (which answers a malformed turn with an observation); a stop token (`<|im_end|>`)
    the policy did NOT sample closes it (role PROMPT, turn id -1, behaviour log-prob 0: never
    trained on; counted in info["truncated_turns"]).
  * The context limit `max_total_tokens` (never exceeded): a turn's budget is min(max_new_tokens,
    room left - 1), the one slot kept for closing a cut turn; when not even `min_turn_tokens`
    fit before the next turn, the episode ends with termination "max_tokens" (the observation
    is not appended) and its rewards are computed from the environment's summary, task 0.
  * `max_turns` (0 = the environment's) ends an episode with "max_turns", as does an
    environment's own turn limit; any other end of the environment is "done".
  * A prompt that leaves no room for a turn raises ValueError naming the task (never dropped).
  * An environment (or tool) that raises in its step ends that episode only: termination
    "env_error", every reward 0, the error in info["env_error"] and a warning; the other
    episodes of the batch go on, and the group keeps its size.

Here: the lock-step turn loop (`play_episodes`) and the batches built on it, GRPO groups
(`rollout_groups`) and held-out evaluation (`evaluate`). The episodes' state and a turn's
tokens: `tg_jax.sampling.bookkeeping`; the environment's step and the episode's end:
`tg_jax.sampling.env_step`; the records: `tg_jax.sampling.records` (the agent loops on the
rollout engine, `tg_jax.sampling.agent_loop`, share all three).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from tg_jax.envs.base import Environment
from tg_jax.sampling.bookkeeping import (
    TERMINATIONS,
    Episode,
    RolloutConfig,
    _check_room,
    _start_episodes,
    record_tokens,
    task_id_of,
    visible,
)
from tg_jax.sampling.env_step import _after_turn, _step
from tg_jax.sampling.episode import EpisodeRecord
from tg_jax.sampling.records import (
    evaluation_records,
    group_trajectories,
    requirement_hint_tokens,
    to_trajectory,
)
from tg_jax.sampling.sampler import Sampler
from tg_jax.sampling.trajectory import Role, Trajectory
from tg_jax.sampling.turn_cache import TurnCache
from tg_jax.text import ChatRenderer, hint_message


def play_episodes(
    sampler: Sampler,
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
    """Plays one episode per entry of `tasks`, all live episodes batched turn by turn.

    Args:
      sampler: the batched sampler of the policy.
      params: policy params (on the sampler's devices).
      renderer: chat renderer of the policy's tokenizer.
      env_factory: makes a fresh environment (one per episode: environments are stateful).
      tasks: one task per episode (repeat a task G times for a GRPO group).
      config: limits and sampling settings.
      rng: sampling key (turn t uses fold_in(rng, t)).
      group_ids: per episode; default 0..len(tasks)-1.
      hint_before_every_turn: insert a hint message for every requirement right before every
        assistant turn (the "hinted" evaluation; its tokens are in `tokens` with Role.HINT).
      stream_ids: per episode, the id of its random stream (`Sampler.sample`'s row_ids): its
        turns sample the same whichever episodes share the batch (another host, another chunk
        of `config.max_rows`). None: by position among the live episodes (in chunks: in
        `tasks`).
    Returns:
      The finished episodes, in the order of `tasks`.
    """
    if config.think_budget:  # a turn in parts: only the agent loops (tg_jax.sampling.agent_loop)
        raise ValueError("rl_loop.think_budget needs rl_loop.rollout_engine 'builtin' or 'vllm'")
    if config.max_rows and len(tasks) > config.max_rows:
        return _play_in_chunks(
            sampler,
            params,
            renderer,
            env_factory,
            tasks,
            config=config,
            rng=rng,
            group_ids=group_ids,
            hint_before_every_turn=hint_before_every_turn,
            stream_ids=stream_ids,
        )
    episodes = _start_episodes(renderer, env_factory, tasks, group_ids, stream_ids)
    hint_ids = _every_requirement_hint(renderer, episodes) if hint_before_every_turn else []
    turns = _LockStep(sampler, params, renderer, config, rng, hint_ids, stream_ids is not None)
    _check_room(episodes, turns.room, config)
    live = list(episodes)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, config.env_workers)) as pool:
        while live:
            texts = turns.sample(live)
            results = list(pool.map(_step, live, texts))
            live = [
                ep
                for ep, text, res in zip(live, texts, results, strict=True)
                if _after_turn(ep, text, res, renderer, config, turns.room)
            ]
    return episodes


def _every_requirement_hint(renderer: ChatRenderer, episodes: Sequence[Episode]) -> list[int]:
    """The hinted evaluation's message before every turn: a hint for every requirement."""
    if not episodes:
        return []
    every = [r.name for r in episodes[0].env.requirements]
    return renderer.render_message(hint_message(episodes[0].env.hint(every)))


@dataclasses.dataclass
class _LockStep:
    """The turns of one `play_episodes` call: turn t of every live episode in one
    `Sampler.sample` call, drawn with fold_in(rng, t), each row from its episode's random
    stream when `by_stream` (else by position among the live episodes)."""

    sampler: Sampler
    params: Any
    renderer: ChatRenderer
    config: RolloutConfig
    rng: jax.Array
    hint_ids: list[int]  # before every turn (hinted evaluation), else []
    by_stream: bool
    turn: int = 0  # the next turn (its draws: fold_in(rng, turn))
    # The live episodes' keys and values between turns, keyed by id(): the episodes outlive it.
    cache: TurnCache = dataclasses.field(default_factory=TurnCache)
    header: list[int] = dataclasses.field(init=False)  # the assistant header of every turn

    def __post_init__(self):
        self.header = self.renderer.assistant_header()

    def room(self, ep: Episode) -> int:
        """Tokens the next turn may sample (one slot is kept for closing a cut turn)."""
        extra = len(self.hint_ids) + len(self.header) + 1
        return self.config.max_total_tokens - len(ep.tokens) - extra

    def sample(self, live: Sequence[Episode]) -> list[str]:
        """Opens the next turn of every live episode ([hint] + header), samples them all in one
        call and records them (`record_tokens`); returns the turns' texts for the environment."""
        config = self.config
        budgets = [min(config.max_new_tokens, self.room(ep)) for ep in live]
        starts = [0 if ep.routes is None else len(ep.routes) - 1 for ep in live]  # not fed
        for ep in live:
            ep.append(self.hint_ids, Role.HINT)
            ep.turn_starts.append(len(ep.tokens))
            ep.append(self.header, Role.PROMPT)
        hide = config.hide_thinking  # each turn's visible context, prefilled afresh
        out = self.sampler.sample(
            self.params,
            [visible(ep) if hide else ep.tokens for ep in live],
            max_new_tokens=budgets,
            stop_ids=self.renderer.end_of_turn_ids,
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=config.top_p,
            rng=jax.random.fold_in(self.rng, self.turn),
            row_ids=[ep.stream_id for ep in live] if self.by_stream else None,
            cache=None if hide else self.cache,
            keys=[id(ep) for ep in live],
            routes_from=starts,
        )
        self.turn += 1
        pre = [None] * len(live) if out.prefill_tokens is None else out.prefill_tokens
        routes = [None] * len(live) if out.routes is None else out.routes
        return [
            record_tokens(
                ep,
                self.renderer,
                out.tokens[k],
                out.logprobs[k],
                out.stopped[k],
                pre[k],
                routes[k],
                starts[k],
            )
            for k, ep in enumerate(live)
        ]


def _play_in_chunks(
    sampler,
    params,
    renderer,
    env_factory,
    tasks,
    *,
    config,
    rng,
    group_ids,
    hint_before_every_turn,
    stream_ids,
) -> list[Episode]:
    """`play_episodes` in chunks of `config.max_rows` episodes, one after the other; turn t of
    every chunk draws with fold_in(rng, t), stream ids by position in `tasks` by default."""
    rows, n = config.max_rows, len(tasks)
    gids = list(range(n)) if group_ids is None else list(group_ids)
    streams = list(range(n)) if stream_ids is None else list(stream_ids)
    one = dataclasses.replace(config, max_rows=0)
    chunks = []
    for lo in range(0, n, rows):
        chunks += play_episodes(
            sampler,
            params,
            renderer,
            env_factory,
            tasks[lo : lo + rows],
            config=one,
            rng=rng,
            group_ids=gids[lo : lo + rows],
            hint_before_every_turn=hint_before_every_turn,
            stream_ids=streams[lo : lo + rows],
        )
    return chunks


def rollout_groups(
    sampler: Sampler,
    params: Any,
    renderer: ChatRenderer,
    env_factory: Callable[[], Environment],
    tasks: Sequence[Any],
    *,
    rollouts_per_task: int,
    config: RolloutConfig,
    rng: jax.Array,
    policy_version: int,
    first_group_id: int = 0,
    hint_picker: Callable[[str, int], str] | None = None,
    play: Callable[..., list[Episode]] | None = None,
) -> list[Trajectory]:
    """G rollouts of each of N tasks (GRPO groups), as Trajectory records.

    Args:
      tasks: the N tasks; task n's rollouts get group id `first_group_id + n`.
      rollouts_per_task: G.
      policy_version: version of `params`, recorded in every trajectory.
      hint_picker: (requirement name, group id) -> hint text for the teacher (e.g. imperfect
        feedback via tg_jax.envs.hints.pick_hint); default: the environment's own hint. Called
        once per assistant turn and requirement judged on it (`pick_turn_hints`), episode by
        episode; the texts are recorded per turn in info["turn_hint_texts"] and the tokens in
        `Trajectory.turn_hint_tokens`. info["hint_leaking_turns"]: turns that reproduce a
        hint n-gram (`hint_leaking_turns`).
      play: `play_episodes` (default) or `agent_loop.play_episodes` (sampler: its runner).
      (others: see `play_episodes`.)
    Returns:
      N * G trajectories, grouped task by task. Rollout g of group id k samples from its own
      stream k * G + g (`play_episodes`' stream_ids), independent of the call's other groups:
      hosts that each roll out a share of a batch's groups sample what one host would."""
    g = rollouts_per_task
    flat = [t for t in tasks for _ in range(g)]
    gids = [first_group_id + n for n in range(len(tasks)) for _ in range(g)]
    streams = [k * g + r % g for r, k in enumerate(gids)]
    episodes = (play or play_episodes)(
        sampler,
        params,
        renderer,
        env_factory,
        flat,
        config=config,
        rng=rng,
        group_ids=gids,
        stream_ids=streams,
    )
    return group_trajectories(episodes, renderer, policy_version, hint_picker)


def evaluate(
    sampler: Sampler,
    params: Any,
    renderer: ChatRenderer,
    env_factory: Callable[[], Environment],
    tasks: Sequence[Any],
    *,
    config: RolloutConfig,
    rng: jax.Array,
    condition: str = "plain",
    samples_per_task: int = 1,
    play: Callable[..., list[Episode]] | None = None,
    first_stream: int = 0,
) -> tuple[list[EpisodeRecord], list[Trajectory]]:
    """Held-out evaluation: episodes -> per-episode compliance, task success and actions.

    Args:
      tasks: held-out tasks.
      config: limits and sampling (temperature 0 = greedy).
      condition: "plain" (prompts as in training: "does by default") or "hinted" (a hint for
        every requirement right before every assistant turn: "can do when reminded").
      samples_per_task: episodes per task (sample index s uses fold_in(rng, s); episode i
        draws from random stream i, whatever the chunks of `config.max_rows`).
      play: as in `rollout_groups`.
      first_stream: task n's episodes use stream first_stream + n (`heldout.split_episodes`).
    Returns:
      (EpisodeRecords for tg_jax.evaluation.stats, the Trajectories, policy_version -1).
      Task success: the "task" reward is 1 (all hidden tests pass); compliance per
      requirement: >= 1 judged turn and all judged turns passed; joint: both.
    """
    if condition not in ("plain", "hinted"):
        raise ValueError(f"condition must be 'plain' or 'hinted', got {condition!r}")
    records, trajectories = [], []
    for s in range(samples_per_task):
        episodes = (play or play_episodes)(
            sampler,
            params,
            renderer,
            env_factory,
            tasks,
            config=config,
            rng=jax.random.fold_in(rng, s),
            hint_before_every_turn=condition == "hinted",
            stream_ids=range(first_stream, first_stream + len(tasks)),
        )
        recs, trajs = evaluation_records(episodes, renderer, condition, s)
        records += recs
        trajectories += trajs
    return records, trajectories


# Importable from here too: the episodes' state and records (bookkeeping.py, records.py).
__all__ = [
    "TERMINATIONS",
    "Episode",
    "RolloutConfig",
    "evaluate",
    "play_episodes",
    "requirement_hint_tokens",
    "rollout_groups",
    "task_id_of",
    "to_trajectory",
]
