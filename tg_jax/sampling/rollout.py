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
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from tg_jax import faults
from tg_jax.envs import leakage
from tg_jax.envs.base import Environment, EpisodeSummary, StepResult, join_hints
from tg_jax.envs.hints import pick_turn_hints
from tg_jax.sampling.episode import EpisodeRecord, episode_compliance
from tg_jax.sampling.sampler import Sampler
from tg_jax.sampling.trajectory import Role, Trajectory, aligned_routes, hint_key, visible_context
from tg_jax.sampling.turn_cache import TurnCache
from tg_jax.text import ChatRenderer, hint_message
from tg_jax.text.tokenizer import token_at_char

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


def _final_rewards(env: Environment) -> dict[str, float]:
    """Rewards of an episode the rollout cut short: task 0, requirement rewards so far."""
    mode = getattr(getattr(env, "config", None), "requirement_reward", "fraction")
    summary = env.summary()
    return {
        "task": 0.0,
        **{
            r.name: summary.requirement_reward(r.name, mode, r.conditional)
            for r in env.requirements
        },
    }


def _termination(env: Environment) -> str:
    return "max_turns" if env.summary().end_reason == "max_turns" else "done"


def _step(ep: Episode, text: str) -> StepResult | Exception:
    """`ep.env.step(text)`, or the exception it raised (the episode fails, the batch goes on)."""
    try:
        faults.check("env.step")
        faults.pause("env.slow")  # a slow tool (the pod rehearsal's fault)
        return ep.env.step(text)
    except Exception as e:  # noqa: BLE001 (any environment or tool error ends its episode only)
        return e


def _fail(ep: Episode, text: str, error: Exception) -> None:
    """Ends `ep` on an environment error: termination "env_error", every reward 0, the error
    in its step info and `Episode.error` (the rollout metric `rollout/end/env_error`)."""
    ep.error = f"{type(error).__name__}: {error}"
    logging.warning("task %s: environment error, episode failed: %s", ep.task_id, ep.error)
    try:
        verdicts = dict(ep.env.judge(text))
    except Exception:  # noqa: BLE001 (a broken environment may fail to judge too)
        verdicts = {}
    ep.verdicts.append(verdicts)
    ep.breaks.append({})
    ep.step_infos.append({"error": ep.error})
    ep.rewards = {"task": 0.0, **{r.name: 0.0 for r in ep.env.requirements}}
    ep.termination = "env_error"


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


def break_tokens(ep: Episode, tokenizer: Any, turn: int, offsets: dict[str, int]) -> dict[str, int]:
    """{name: index in ep.tokens of the token holding character `offsets[name]` of turn
    `turn`'s text (the decode of its sampled tokens)}; an offset at the end of the text maps to
    the token that closes the turn."""
    start = int(ep.turn_starts[turn])
    idx = [j for j in range(start, len(ep.tokens)) if ep.turn_ids[j] == turn]
    ids = [ep.tokens[j] for j in idx]
    out = {}
    for name, o in offsets.items():
        i = token_at_char(tokenizer, ids, o)
        out[name] = idx[i] if i < len(idx) else (idx[-1] + 1 if idx else start)
    return out


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
    header = renderer.assistant_header()
    episodes = _start_episodes(renderer, env_factory, tasks, group_ids, stream_ids)
    hint_ids: list[int] = []
    if hint_before_every_turn and episodes:
        every = [r.name for r in episodes[0].env.requirements]
        hint_ids = renderer.render_message(hint_message(episodes[0].env.hint(every)))

    def room(ep: Episode) -> int:
        """Tokens the next turn may sample (one slot is kept for closing a cut turn)."""
        return config.max_total_tokens - len(ep.tokens) - len(hint_ids) - len(header) - 1

    _check_room(episodes, room, config)

    live = list(episodes)
    turn = 0
    cache = TurnCache()  # keyed by id(): the episodes outlive it
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, config.env_workers)) as pool:
        while live:
            budgets = [min(config.max_new_tokens, room(ep)) for ep in live]
            starts = [0 if ep.routes is None else len(ep.routes) - 1 for ep in live]  # not fed
            for ep in live:
                ep.append(hint_ids, Role.HINT)
                ep.turn_starts.append(len(ep.tokens))
                ep.append(header, Role.PROMPT)
            hide = config.hide_thinking  # each turn's visible context, prefilled afresh
            out = sampler.sample(
                params,
                [visible(ep) if hide else ep.tokens for ep in live],
                max_new_tokens=budgets,
                stop_ids=renderer.end_of_turn_ids,
                temperature=config.temperature,
                top_k=config.top_k,
                top_p=config.top_p,
                rng=jax.random.fold_in(rng, turn),
                row_ids=None if stream_ids is None else [ep.stream_id for ep in live],
                cache=None if hide else cache,
                keys=[id(ep) for ep in live],
                routes_from=starts,
            )
            pre = [None] * len(live) if out.prefill_tokens is None else out.prefill_tokens
            routes = [None] * len(live) if out.routes is None else out.routes
            texts = [
                record_tokens(
                    ep,
                    renderer,
                    out.tokens[k],
                    out.logprobs[k],
                    out.stopped[k],
                    pre[k],
                    routes[k],
                    starts[k],
                )
                for k, ep in enumerate(live)
            ]
            results = list(pool.map(_step, live, texts))
            live = [
                ep
                for ep, text, res in zip(live, texts, results, strict=True)
                if _after_turn(ep, text, res, renderer, config, room)
            ]
            turn += 1
    return episodes


def visible(ep: Episode) -> list[int]:
    """The context of the turn `ep` is about to sample under `RolloutConfig.hide_thinking`
    (`trajectory.visible_context`, the rule the trainer's rows follow)."""
    keep = visible_context(ep.roles, ep.turn_ids, len(ep.turn_starts) - 1)
    return [t for t, k in zip(ep.tokens, keep, strict=True) if k]


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


def _after_turn(
    ep: Episode,
    text: str,
    res: Any,
    renderer: ChatRenderer,
    config: RolloutConfig,
    room: Callable[[Episode], int],
) -> bool:
    """Records the environment's step of one episode's turn (verdicts, breaks, info; the end
    and its rewards, or the observation appended); True while the episode goes on."""
    if isinstance(res, BaseException):
        _fail(ep, text, res)
        return False
    verdicts = res.info.get("verdicts")
    ep.verdicts.append(dict(verdicts if verdicts is not None else ep.env.judge(text)))
    offsets = ep.env.breaks(text, ep.verdicts[-1])
    turn = len(ep.turn_starts) - 1
    ep.breaks.append(break_tokens(ep, renderer.tokenizer, turn, offsets) if offsets else {})
    ep.step_infos.append({k: v for k, v in res.info.items() if k != "summary"})
    if res.done:
        ep.rewards, ep.termination = dict(res.rewards), _termination(ep.env)
        return False
    if config.max_turns and len(ep.turn_starts) >= config.max_turns:
        ep.rewards, ep.termination = _final_rewards(ep.env), "max_turns"
        return False
    obs = renderer.render_messages([{"role": config.observation_role, "content": res.observation}])
    if room(ep) - len(renderer.separator_ids) - len(obs) < config.min_turn_tokens:
        ep.rewards, ep.termination = _final_rewards(ep.env), "max_tokens"
        return False
    ep.append(renderer.separator_ids, Role.PROMPT)
    ep.append(obs, Role.ENV)
    return True


def requirement_hint_tokens(renderer: ChatRenderer, env: Environment) -> dict[str, list[int]]:
    """The hint messages the teacher sees: each requirement's own, and for every set of two
    or more requirements the one message that hints them all (key `hint_key`), as the hinted
    evaluation and the SFT transcripts show it."""
    names = [r.name for r in env.requirements]
    out = {n: renderer.render_message(hint_message(env.hint([n]))) for n in names}
    for subset in _joint_subsets(names):
        out[hint_key(subset)] = renderer.render_message(hint_message(env.hint(subset)))
    return out


def _joint_subsets(names: Sequence[str]) -> list[tuple[str, ...]]:
    """Every set of two or more of `names` (sorted): the turns that break several
    requirements at once, each hinted with one message (`hint_key`)."""
    names = sorted(names)
    return [s for k in range(2, len(names) + 1) for s in itertools.combinations(names, k)]


def hint_leaking_turns(ep: Episode, turn_hints: Sequence[Sequence[str]] | None = None) -> int:
    """Assistant turns of `ep` that reproduce a hint n-gram (tg_jax.envs.leakage): of any
    requirement's own hint, or of the texts in turn_hints[k] (the teacher's, turn k)."""
    own = [ep.env.hint([r.name]) for r in ep.env.requirements]
    return leakage.leaking_turns(ep.texts, own, turn_hints)


def _picked_hints(
    ep: Episode,
    renderer: ChatRenderer,
    picker: Callable[[str, int], str],
    cache: dict[str, list[int]],
) -> tuple[list[dict[str, list[int]]], list[dict[str, str]]]:
    """(per turn {name: hint message tokens}, per turn {name: text}): one pick
    `picker(name, ep.group_id)` per judged requirement of every turn (`pick_turn_hints`)."""
    texts = pick_turn_hints(ep.verdicts, lambda name: picker(name, ep.group_id))
    tokens = []
    for turn in texts:
        messages = dict(turn)  # each pick, and the picks of 2+ requirements as one message
        for subset in _joint_subsets(list(turn)):
            messages[hint_key(subset)] = join_hints({n: turn[n] for n in subset})
        for t in set(messages.values()) - set(cache):
            cache[t] = renderer.render_message(hint_message(t))
        tokens.append({key: cache[t] for key, t in messages.items()})
    return tokens, texts


def conditional_names(env: Environment) -> list[str]:
    """The environment's requirements met where they never applied (`Requirement.conditional`)."""
    return sorted(r.name for r in env.requirements if r.conditional)


def _summary(ep: Episode) -> EpisodeSummary:
    """The environment's summary of `ep`; after an environment error, what is known of it."""
    if not ep.error:
        return ep.env.summary()
    try:
        return ep.env.summary()
    except Exception:  # noqa: BLE001 (the environment already failed)
        return EpisodeSummary(verdicts={}, actions={}, turns=len(ep.turn_starts), end_reason="")


def to_trajectory(
    ep: Episode,
    hint_tokens: dict[str, list[int]],
    policy_version: int,
    extra_info: dict[str, Any] | None = None,
    turn_hint_tokens: list[dict[str, list[int]]] | None = None,
) -> Trajectory:
    """The Trajectory record of a finished episode (`turn_hint_tokens`: see Trajectory)."""
    summary = _summary(ep)
    info = {
        "termination": ep.termination,
        "end_reason": summary.end_reason,
        "actions": dict(summary.actions),
        "unjudged": dict(summary.unjudged),
        "rejected_turns": list(summary.rejected),  # not accepted: met there earns nothing
        "turns": len(ep.turn_starts),
        "truncated_turns": ep.truncated_turns,
        "num_tokens": len(ep.tokens),
        "sampled_tokens": int(sum(t >= 0 for t in ep.turn_ids)),
        "prefill_tokens": ep.prefill_tokens,
        "weight_sync_s": ep.weight_sync_s,
        "steps": ep.step_infos,
        # Requirements met where they never applied (`Requirement.conditional`).
        "conditional_requirements": conditional_names(ep.env),
        **({"env_error": ep.error} if ep.error else {}),
        **(extra_info or {}),
    }
    return Trajectory(
        tokens=np.asarray(ep.tokens, np.int32),
        roles=np.asarray(ep.roles, np.int8),
        turn_ids=np.asarray(ep.turn_ids, np.int32),
        turn_starts=np.asarray(ep.turn_starts, np.int32),
        behaviour_logprobs=np.asarray(ep.logprobs, np.float32),
        turn_verdicts=ep.verdicts,
        rewards=dict(ep.rewards or {}),
        hint_tokens=hint_tokens,
        group_id=ep.group_id,
        policy_version=int(policy_version),
        task_id=ep.task_id,
        info=info,
        turn_hint_tokens=turn_hint_tokens,
        turn_breaks=[dict(b) for b in ep.breaks],
        routed_experts=aligned_routes(ep.routes, len(ep.tokens)),
    )


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
    out = []
    default_hints = requirement_hint_tokens(renderer, episodes[0].env) if episodes else {}
    cache: dict[str, list[int]] = {}
    for ep in episodes:
        per_turn, extra = None, {"hint_leaking_turns": hint_leaking_turns(ep)}
        if hint_picker is not None:
            per_turn, texts = _picked_hints(ep, renderer, hint_picker, cache)
            shown = [list(t.values()) for t in texts]
            extra = {"hint_leaking_turns": hint_leaking_turns(ep, shown), "turn_hint_texts": texts}
        out.append(to_trajectory(ep, default_hints, policy_version, extra, per_turn))
    if out:
        terms = {t: sum(tr.info["termination"] == t for tr in out) for t in TERMINATIONS}
        logging.debug("rollouts: %d trajectories, terminations %s", len(out), terms)
    return out


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
        hints = requirement_hint_tokens(renderer, episodes[0].env) if episodes else {}
        for ep in episodes:
            names = [r.name for r in ep.env.requirements]
            verdicts = {n: [v.get(n) for v in ep.verdicts] for n in names}
            records.append(
                EpisodeRecord(
                    task_id=ep.task_id,
                    condition=condition,
                    sample=s,
                    task_success=bool((ep.rewards or {}).get("task", 0.0) >= 1.0),
                    compliance=episode_compliance(verdicts, conditional_names(ep.env)),
                    actions=dict(ep.env.summary().actions),
                    turns=len(ep.turn_starts),
                    hint_leaking_turns=hint_leaking_turns(ep),
                    unjudged=dict(_summary(ep).unjudged),
                )
            )
            trajectories.append(to_trajectory(ep, hints, -1, {"condition": condition}))
    return records, trajectories
