"""The environment's side of a turn: its step on the turn's text, and what that does to the
episode (`tg_jax.sampling.bookkeeping.Episode`).

  _step          `env.step(text)` (run in a thread pool): an exception is returned, not raised
  _after_turn    the step recorded: verdicts, breaks (`break_tokens`: the environment's offsets
                 in the turn's text as token indices) and info; then the episode ends (the
                 environment's end, `max_turns`, or no room for the observation and a turn of
                 `min_turn_tokens`: "max_tokens") or the observation is appended
  _fail          an environment (or tool) that raised ends its episode only: "env_error",
                 every reward 0

Shared by the lock-step rollouts (`tg_jax.sampling.rollout`) and the agent loops
(`tg_jax.sampling.agent_loop`), so both end their episodes the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tg_jax import faults
from tg_jax.envs.base import Environment, StepResult
from tg_jax.sampling.bookkeeping import Episode, RolloutConfig
from tg_jax.sampling.trajectory import Role
from tg_jax.text import ChatRenderer
from tg_jax.text.tokenizer import token_at_char


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
