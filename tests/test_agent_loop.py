"""Per-episode agent loops on the rollout engine (tg_jax.sampling.agent_loop) against the
lock-step rollouts (tg_jax.sampling.rollout): same trajectories, failures and cut turns, and
the main job's RL stage with rl_loop.rollout_engine = "builtin"."""

import dataclasses
import json
import os
import subprocess
import sys
import time

import jax
import ml_collections
import numpy as np
import pytest

from tg_jax import config_lib
from tg_jax import engine as engine_api
from tg_jax.envs.coding import CodingEnv, CodingEnvConfig
from tg_jax.envs.tasks import generate_tasks
from tg_jax.models import ModelConfig, Transformer, init_params
from tg_jax.sampling import agent_loop
from tg_jax.sampling.rollout import RolloutConfig, evaluate, rollout_groups
from tg_jax.sampling.sampler import Sampler, sequence_logprobs
from tg_jax.text import ByteTokenizer, ChatRenderer, Role

ROOT = os.path.join(os.path.dirname(__file__), "..")
RENDERER = ChatRenderer(ByteTokenizer())
TASKS = generate_tasks("heldout", 2, seed=0)
MAX_TOTAL = 192


@pytest.fixture(scope="module")
def setup():
    """A tiny model with peaked next-token distributions (no greedy near-ties), its sampler,
    and one engine runner for every test (its calls compile once)."""
    model = Transformer(ModelConfig.from_config(config_lib.tiny_model_config()))
    params = init_params(model, jax.random.key(0))
    params = jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x, params)
    sampler = Sampler(model, pad_id=RENDERER.tokenizer.pad_id)
    runner = agent_loop.EngineRunner(
        engine_api, model, slots=4, max_total_tokens=MAX_TOTAL, pad_id=RENDERER.tokenizer.pad_id
    )
    return model, params, sampler, runner


def _env():
    return CodingEnv(CodingEnvConfig(max_turns=3))


class _BrokenOnSecondTurn(CodingEnv):
    def step(self, text):
        if self.summary().turns >= 1:
            raise ConnectionError("tool server went away")
        return super().step(text)


def _both(setup, env_factory, config, tasks=TASKS, g=2):
    """(lock-step trajectories, engine trajectories) of the same groups."""
    _, params, sampler, runner = setup
    kw = dict(rollouts_per_task=g, config=config, rng=jax.random.key(1), policy_version=3)
    lock = rollout_groups(sampler, params, RENDERER, env_factory, tasks, **kw)
    eng = rollout_groups(
        runner, params, RENDERER, env_factory, tasks, play=agent_loop.play_episodes, **kw
    )
    return lock, eng


def _assert_same(lock, eng):
    assert len(lock) == len(eng)
    for a, b in zip(lock, eng, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.roles, b.roles)
        np.testing.assert_array_equal(a.turn_ids, b.turn_ids)
        np.testing.assert_array_equal(a.turn_starts, b.turn_starts)
        np.testing.assert_allclose(a.behaviour_logprobs, b.behaviour_logprobs, atol=1e-5)
        assert a.turn_verdicts == b.turn_verdicts and a.rewards == b.rewards
        assert a.turn_breaks == b.turn_breaks and a.hint_tokens == b.hint_tokens
        assert (a.group_id, a.task_id, a.policy_version) == (b.group_id, b.task_id, 3)
        for key in ("termination", "turns", "truncated_turns", "steps", "num_tokens"):
            assert a.info[key] == b.info[key], key


@pytest.mark.slow
def test_greedy_episodes_equal_the_lockstep_path_token_for_token(setup):
    """Multi-turn greedy episodes (turns cut at their budget, closed by an unsampled
    <|im_end|>, observations appended): the engine's trajectories are the lock-step ones."""
    config = RolloutConfig(max_new_tokens=12, max_total_tokens=MAX_TOTAL, temperature=0.0)
    lock, eng = _both(setup, _env, config)
    _assert_same(lock, eng)
    assert [t.group_id for t in eng] == [0, 0, 1, 1]
    for t in eng:
        assert t.num_turns == 2 and t.info["termination"] == "max_tokens"
        ends = [np.flatnonzero(t.turn_ids == k)[-1] + 1 for k in range(2)]
        cut = [k for k in range(2) if (t.turn_ids == k).sum() == 12]  # turns at their budget
        assert t.info["truncated_turns"] == len(cut) >= 1
        assert all(t.tokens[ends[k]] == RENDERER.end_of_turn_ids[0] for k in cut)
        assert all(t.roles[ends[k]] == Role.PROMPT for k in cut)
        assert all(t.behaviour_logprobs[ends[k]] == 0.0 for k in cut)
        assert (t.roles == Role.ENV).sum() > 0
        # Turns after the first prefill only what was appended (the shared prompt once).
        assert 0 < t.info["prefill_tokens"] < t.info["num_tokens"]


def test_a_turn_that_hits_its_context_budget_is_closed_as_lockstep(setup):
    """The context limit cuts the first turn short and ends the episode "max_tokens"."""
    prompt = RENDERER.render_with_roles([{"role": "user", "content": TASKS[0].prompt}])[0]
    limit = len(prompt) + len(RENDERER.assistant_header()) + 10
    config = RolloutConfig(
        max_new_tokens=64, max_total_tokens=limit, min_turn_tokens=4, temperature=0.0
    )
    lock, eng = _both(setup, _env, config, TASKS[:1], g=1)
    _assert_same(lock, eng)
    (t,) = eng
    assert t.info["termination"] == "max_tokens" and t.num_turns == 1
    assert (t.turn_ids == 0).sum() == 9 and len(t.tokens) == limit
    assert t.tokens[-1] == RENDERER.end_of_turn_ids[0] and t.info["truncated_turns"] == 1


@pytest.mark.slow
def test_an_environment_that_raises_ends_only_its_episode(setup):
    made = []

    def env_factory():
        env = (_BrokenOnSecondTurn if len(made) % 2 == 0 else CodingEnv)(
            CodingEnvConfig(max_turns=3)
        )
        made.append(env)
        return env

    config = RolloutConfig(max_new_tokens=12, max_total_tokens=MAX_TOTAL, temperature=0.0)
    lock, eng = _both(setup, env_factory, config, TASKS[:1])
    _assert_same(lock, eng)
    broken, fine = eng
    assert broken.info["termination"] == "env_error" and broken.num_turns == 2
    assert broken.info["env_error"] == "ConnectionError: tool server went away"
    assert broken.rewards == {"task": 0.0, "fence": 0.0, "tool_json": 0.0}
    assert fine.info["termination"] == "max_tokens" and fine.num_turns == 2


class _SlowTools(CodingEnv):
    """Each tool call takes 0.25 s (the engine has nothing else to run meanwhile)."""

    def step(self, text):
        time.sleep(0.25)
        return super().step(text)


def test_an_engine_call_splits_its_time_into_engine_work_and_waiting_on_tools(setup):
    from tg_jax.train.rl_rollouts import rollout_metrics

    _, params, _, runner = setup
    config = RolloutConfig(max_new_tokens=12, max_total_tokens=MAX_TOTAL, temperature=0.0)
    t0 = time.perf_counter()
    slow = lambda: _SlowTools(CodingEnvConfig(max_turns=2))  # noqa: E731
    trajs = rollout_groups(runner, params, RENDERER, slow, TASKS[:1], rollouts_per_task=2,
                           config=config, rng=jax.random.key(1), policy_version=0,
                           play=agent_loop.play_episodes)  # fmt: skip
    wall = time.perf_counter() - t0
    (call,) = {json.dumps(t.info["rollout_call"], sort_keys=True) for t in trajs}  # one call
    call = json.loads(call)
    # Two episodes of two 0.25 s tool calls each: the last round at least with the engine idle;
    # engine work and tool waits never overlap, so they fit in the wall.
    assert wall >= 0.5 and 0.25 <= call["tool_wait_s"] and 0 < call["engine_s"]
    assert call["engine_s"] + call["tool_wait_s"] <= wall
    m = rollout_metrics(trajs)
    assert (m["time/rollout_engine_s"], m["time/rollout_tool_wait_s"]) == (
        call["engine_s"], call["tool_wait_s"])  # fmt: skip


def test_sampled_turns_carry_the_policy_s_logprobs_and_hinted_evaluation_runs(setup):
    """Temperature 1: the behaviour log-probs are the model's (a full forward recomputes
    them), an episode samples the same whatever shares its call (its stream ids), and the
    hinted evaluation puts the hint before every turn, as lock-step."""
    model, params, sampler, runner = setup
    config = RolloutConfig(max_new_tokens=12, max_total_tokens=MAX_TOTAL, temperature=1.0)
    kw = dict(config=config, rng=jax.random.key(5), policy_version=0)
    trajs = rollout_groups(runner, params, RENDERER, _env, TASKS, rollouts_per_task=2,
                           play=agent_loop.play_episodes, **kw)  # fmt: skip
    tokens = np.zeros((len(trajs), MAX_TOTAL), np.int32)
    for i, t in enumerate(trajs):
        tokens[i, : len(t.tokens)] = t.tokens
    recomputed = np.asarray(jax.jit(sequence_logprobs, static_argnums=0)(model, params, tokens))
    for i, t in enumerate(trajs):
        sampled = t.turn_ids >= 0
        np.testing.assert_allclose(
            t.behaviour_logprobs[sampled], recomputed[i, : len(t.tokens)][sampled], atol=2e-4
        )
    assert len({tuple(t.tokens) for t in trajs}) == 4  # each rollout its own stream
    second = rollout_groups(runner, params, RENDERER, _env, TASKS[1:], rollouts_per_task=2,
                            first_group_id=1, play=agent_loop.play_episodes, **kw)  # fmt: skip
    for a, b in zip(trajs[2:], second, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
    ev = dict(config=dataclasses.replace(config, temperature=0.0), rng=jax.random.key(0),
              condition="hinted")  # fmt: skip
    recs_l, lock = evaluate(sampler, params, RENDERER, _env, TASKS, **ev)
    recs_e, eng = evaluate(runner, params, RENDERER, _env, TASKS, play=agent_loop.play_episodes,
                           **ev)  # fmt: skip
    assert recs_l == recs_e
    for a, b in zip(lock, eng, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        assert (b.roles == Role.HINT).sum() > 0


def _runner(cfg, episodes, max_total):
    return agent_loop.runner_from_config(
        cfg, engine_api, None, episodes=episodes, max_total_tokens=max_total, pad_id=0
    )


def test_runner_from_config_defaults_to_the_builtin_engine():
    """The built-in engine by default; "lockstep" by name, and for a saved config that
    predates the field (a resumed older run keeps its rollouts)."""
    c = config_lib.loop_config()
    assert c.rollout_engine == "builtin"
    cfg = ml_collections.ConfigDict({"rl_loop": c})
    kw = dict(episodes=4, max_total_tokens=64, pad_id=0)
    assert isinstance(agent_loop.runner_from_config(cfg, engine_api, object(), **kw),
                      agent_loop.EngineRunner)  # fmt: skip
    cfg.rl_loop.rollout_engine = "lockstep"
    assert agent_loop.runner_from_config(cfg, engine_api, None, **kw) is None
    old = ml_collections.ConfigDict({"rl_loop": {"groups_per_step": 2}})
    assert agent_loop.engine_kind(old.rl_loop) == "lockstep"
    assert agent_loop.runner_from_config(old, engine_api, None, **kw) is None
    cfg.rl_loop.rollout_engine = "builtin"
    model = object()  # the engine is built at the first load: any model object here
    runner = agent_loop.runner_from_config(
        cfg, engine_api, model, episodes=6, max_total_tokens=100, pad_id=0
    )
    assert (runner.slots, runner.page_size, runner.max_pages) == (6, 16, 7)
    assert runner.decode_steps == 1 and runner.min_bucket == 0  # 0: the engine's MIN_BUCKET
    cfg.rl_loop.engine_min_bucket = 1
    one = agent_loop.runner_from_config(cfg, engine_api, model, episodes=6,
                                        max_total_tokens=100, pad_id=0)  # fmt: skip
    assert one.min_bucket == 1
    cfg.rl_loop.engine_decode_steps = 8
    runner = agent_loop.runner_from_config(
        cfg, engine_api, model, episodes=6, max_total_tokens=100, pad_id=0
    )
    assert runner.decode_steps == 8 and runner.num_pages == 6 * 7 + 1  # every slot's context
    cfg.rl_loop.engine_kv_tokens = 120  # 8 pages of 16 (+ the scratch page)
    runner = agent_loop.runner_from_config(
        cfg, engine_api, model, episodes=6, max_total_tokens=100, pad_id=0
    )
    assert runner.num_pages == 9
    cfg.rl_loop.engine_kv_tokens = 100  # less than one episode's 7 pages of 16
    with pytest.raises(ValueError, match="must be 0 .* or hold one episode's whole context .112"):
        agent_loop.runner_from_config(
            cfg, engine_api, model, episodes=6, max_total_tokens=100, pad_id=0
        )
    cfg.rl_loop.engine_kv_tokens = 0
    with pytest.raises(ValueError, match="needs the model's own sampler"):  # a wrapped sampler
        agent_loop.runner_from_config(
            cfg, engine_api, None, episodes=6, max_total_tokens=100, pad_id=0
        )
    cfg.rl_loop.rollout_engine = "sglang"
    with pytest.raises(ValueError, match="rollout_engine must be one of"):
        agent_loop.runner_from_config(
            cfg, engine_api, None, episodes=4, max_total_tokens=64, pad_id=0
        )
    cfg.rl_loop.rollout_engine = "vllm"  # serves a checkpoint directory: none here
    cfg.model = ml_collections.ConfigDict({"hf_checkpoint": ""})
    with pytest.raises(ValueError, match="set model.hf_checkpoint"):
        agent_loop.runner_from_config(
            cfg, engine_api, None, episodes=4, max_total_tokens=64, pad_id=0
        )


# Runs the main job, counting the episodes the engine's agent loops play (RL and held-out).
MAIN = """
import atexit, sys, runpy
from tg_jax.sampling import agent_loop
calls, play = [0], agent_loop.play_episodes
def counted(*a, **k):
    episodes = play(*a, **k)
    calls[0] += len(episodes)
    return episodes
agent_loop.play_episodes = counted
shapes, init = set(), agent_loop.EngineRunner.__init__
def recorded(self, *a, **k):
    init(self, *a, **k)
    shapes.add((self.slots, self.page_size, self.decode_steps))
agent_loop.EngineRunner.__init__ = recorded
atexit.register(lambda: print(f"agent loop episodes: {calls[0]}"))
atexit.register(lambda: print(f"engine slots, page size, decode steps: {sorted(shapes)}"))
sys.argv = ["tg_jax.main", *sys.argv[1:]]
runpy.run_module("tg_jax.main", run_name="__main__")
"""


@pytest.mark.e2e
def test_main_job_rl_stage_with_the_builtin_engine(tmp_path):
    """The tiny main job (SFT, then 2 RL steps of the tg arm, held-out evaluations) with
    rl_loop.rollout_engine=builtin: every rollout is played by the engine's agent loops, on
    the engine's slots, page size and tokens per decode call from the command line (fewer slots
    than episodes: the engine admits the rest as slots free)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-c", MAIN, "--config=configs/tiny.py",
           f"--workdir={tmp_path / 'w'}", "--config.stage=pipeline",
           "--config.pipeline.arms=('tg',)", "--config.rl_loop.rollout_engine=builtin",
           "--config.rl_loop.steps=2", "--config.rl_loop.engine_slots=3",
           "--config.rl_loop.engine_page_size=8",
           "--config.rl_loop.engine_decode_steps=4"]  # fmt: skip
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (metrics,) = (tmp_path / "w" / "runs").rglob("metrics.jsonl")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows if r["stage"] == "train"] == [1, 2]
    assert all(r["cost/sampled_tokens"] > 0 for r in rows if r["stage"] == "train")
    # 2 steps x 2 groups x 2 rollouts, 2 periodic evaluations of 4 tasks, the final 16 + 16.
    played = int(proc.stdout.rsplit("agent loop episodes: ", 1)[1].split()[0])
    assert played >= 8 + 8, proc.stdout[-2000:]
    assert "engine slots, page size, decode steps: [(3, 8, 4)]" in proc.stdout, proc.stdout[-2000:]
    print(f"main job with the builtin engine: {time.time() - start:.1f}s, {played} episodes")


def test_unusable_engine_output_ends_the_episode_and_drops_its_group(setup):
    """An "invalid" completion (a non-finite log-prob from the engine, made here on the
    second turn of one episode): that episode ends "engine_error" with its first turn only
    and rewards 0, the others are the unbroken run's, and the training rollouts drop its
    group (counted)."""
    from tg_jax.train.rl_rollouts import drop_engine_errors, rollout_metrics

    _, params, _, runner = setup
    config = RolloutConfig(max_new_tokens=12, max_total_tokens=MAX_TOTAL, temperature=0.0)
    kw = dict(rollouts_per_task=2, config=config, rng=jax.random.key(1), policy_version=3,
              play=agent_loop.play_episodes)  # fmt: skip
    want = rollout_groups(runner, params, RENDERER, _env, TASKS, **kw)
    engine = runner.load(params)
    step = engine.step

    def corrupting_step():
        out = step()
        for i, c in enumerate(out):
            if c.request_id[1:] == (2, 1):  # episode 2 (group 1), its second turn
                lps = c.logprobs.copy()
                lps[0] = np.nan
                out[i] = dataclasses.replace(
                    c,
                    logprobs=lps,
                    finish_reason="invalid",
                    message="vLLM returned a non-finite log-prob",
                )
        return out

    engine.step = corrupting_step
    try:
        got = rollout_groups(runner, params, RENDERER, _env, TASKS, **kw)
    finally:
        del engine.step
    bad = got[2]
    assert bad.info["termination"] == "engine_error" and "non-finite" in bad.info["env_error"]
    assert bad.num_turns == 1 and all(v == 0.0 for v in bad.rewards.values())
    # Its tokens: the unbroken episode's up to its second turn's header (taken back).
    np.testing.assert_array_equal(bad.tokens, want[2].tokens[: want[2].turn_starts[1]])
    assert np.isfinite(bad.behaviour_logprobs).all()
    for i in (0, 1, 3):
        np.testing.assert_array_equal(got[i].tokens, want[i].tokens)
    kept = drop_engine_errors(got)
    assert [t.group_id for t in kept] == [0, 0] and kept[0].info["engine_error_groups"] == 1
    (dropped,) = kept[0].info["dropped_groups"]  # lineage: the group and why
    assert dropped["group_id"] == 1 and dropped["task_ids"] == sorted(
        {got[2].task_id, got[3].task_id}
    )
    assert dropped["why"].startswith("engine_error: ") and "non-finite" in dropped["why"]
    # Each turn's engine request (the failed episode's too: its taken-back turn's request last),
    # and the process that sampled it.
    assert [len(t.info["request_ids"]) for t in got] == [2, 2, 2, 2]
    assert [t.num_turns for t in got] == [2, 2, 1, 2]
    assert {t.info["sampler_process"] for t in got} == {0}
    assert rollout_metrics(kept)["rollout/engine_error_groups"] == 1.0
    assert rollout_metrics(kept)["rollout/end/engine_error"] == 0.0
    with pytest.raises(RuntimeError, match="every rollout group"):
        drop_engine_errors([t for t in got if t.group_id == 1])


def test_the_vllm_engine_without_vllm_installed_is_one_clear_error(monkeypatch):
    """rl_loop.rollout_engine "vllm" where vLLM is not installed: ImportError with the line
    that installs it (sys.modules["vllm"] = None makes `import vllm` fail as if absent)."""
    from tg_jax.engine import vllm_engine

    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"pip install -c constraints.txt -e '\.\[vllm\]'"):
        vllm_engine.import_vllm()


def test_the_runners_engine_takes_its_smallest_bucket(setup):
    """rl_loop.engine_min_bucket reaches the engine: 0 keeps the engine's MIN_BUCKET (16: a
    4-slot engine has one rows bucket), 1 every power of two."""
    model, params, _, runner = setup
    engine = runner.load(params)
    assert engine.slot_buckets() == [4] and engine.page_buckets() == [MAX_TOTAL // 16]
    fine = agent_loop.EngineRunner(engine_api, model, slots=4, max_total_tokens=MAX_TOTAL,
                                   pad_id=RENDERER.tokenizer.pad_id, min_bucket=1)  # fmt: skip
    engine = fine.load(params)
    assert engine.slot_buckets() == [1, 2, 4] and engine.page_buckets() == [1, 2, 4, 8, 12]
