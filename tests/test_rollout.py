"""Multi-turn rollouts against the real coding environment (scripted and random policies)."""

import dataclasses

import jax
import numpy as np
import pytest

from tg_jax import config_files, config_lib
from tg_jax.envs.coding import CodingEnv, CodingEnvConfig
from tg_jax.envs.tasks import generate_tasks
from tg_jax.models import ModelConfig, Transformer, init_params
from tg_jax.sampling.rollout import RolloutConfig, evaluate, rollout_groups
from tg_jax.sampling.sampler import Sampler, SampleResult, sequence_logprobs
from tg_jax.text import ByteTokenizer, ChatRenderer, Role
from tg_jax.train import rl_rollouts

RENDERER = ChatRenderer(ByteTokenizer())
TASKS = generate_tasks("heldout", 2, seed=0)
RUN = (
    '<think>lin</think>\n```python\ndef f(x): return x\n```\n<tool_call>{"name": "run_tests"}'
    "</tool_call>"
)
GARBAGE = "zzz ~~ not a tool call"
SUBMIT = "def f(x): return x\nCALL submit"


class ScriptedSampler:
    """Stands in for `Sampler`: turn k of every episode is `script(prompt_text, k)`.

    Records every prompt it was given; log-prob of each emitted token is -0.5.
    """

    def __init__(self, script):
        self.script = script
        self.prompts = []

    def sample(self, params, prompts, *, max_new_tokens, stop_ids, rng, **kw):
        del params, rng, kw
        self.prompts.append([list(p) for p in prompts])
        out_tokens, stopped = [], []
        budgets = np.broadcast_to(max_new_tokens, (len(prompts),))
        for p, budget in zip(prompts, budgets, strict=True):
            text = RENDERER.tokenizer.decode(p)
            turn = text.count("<|im_start|>assistant") - 1
            ids = RENDERER.tokenizer.encode(self.script(text, turn)) + [stop_ids[0]]
            out_tokens.append(np.asarray(ids[:budget], np.int32))
            stopped.append(len(ids) <= budget)
        lps = [np.full(len(t), -0.5, np.float32) for t in out_tokens]
        return SampleResult(out_tokens, lps, lps, np.asarray(stopped))


def _env():
    return CodingEnv(CodingEnvConfig(max_turns=3))


def test_scripted_rollout_is_append_only_with_roles_and_verdicts():
    sampler = ScriptedSampler(lambda text, turn: [RUN, GARBAGE, SUBMIT][turn])
    config = RolloutConfig(max_new_tokens=128, max_total_tokens=1024)
    trajs = rollout_groups(
        sampler, None, RENDERER, _env, TASKS, rollouts_per_task=2, config=config,
        rng=jax.random.key(0), policy_version=7, first_group_id=10,
    )  # fmt: skip
    assert [t.group_id for t in trajs] == [10, 10, 11, 11]
    assert {t.policy_version for t in trajs} == {7}
    traj = trajs[0]
    messages = [{"role": "user", "content": TASKS[0].prompt}]
    for turn, text in enumerate([RUN, GARBAGE, SUBMIT]):
        messages.append({"role": "assistant", "content": text})
        if turn < 2:
            messages.append({"role": "tool", "content": traj.info["steps"][turn]["tool_output"]})
    ids, roles = RENDERER.render_with_roles(messages)
    # Token-in/token-out: the trajectory is exactly the append-only rendering (which ends with
    # a separator after the last turn), and every prompt the sampler saw is a prefix of it.
    assert traj.tokens.tolist() == ids[:-1]
    assert traj.roles.tolist() == roles[:-1]
    for prompts in sampler.prompts:
        assert prompts[0] == traj.tokens[: len(prompts[0])].tolist()
    assert RENDERER.tokenizer.decode(traj.tokens).count("<tool_response>") == 2

    sampled = np.isin(traj.roles, [Role.THINK, Role.ANSWER])
    assert (traj.turn_ids >= 0).tolist() == sampled.tolist()
    np.testing.assert_array_equal(traj.behaviour_logprobs, np.where(sampled, -0.5, 0.0))
    assert sorted(set(traj.turn_ids[sampled].tolist())) == [0, 1, 2]
    header = RENDERER.assistant_header()
    for k in traj.turn_starts:
        assert traj.tokens[k : k + len(header)].tolist() == header
    assert (traj.roles == Role.THINK).sum() == 5  # <think> l i n </think>

    assert traj.turn_verdicts[0] == {"fence": True, "tool_json": True}
    assert traj.turn_verdicts[1] == {"fence": False, "tool_json": False}  # malformed
    assert traj.turn_verdicts[2] == {"fence": False, "tool_json": False}
    assert "error" in traj.info["steps"][1]["tool_output"]
    assert set(traj.rewards) == {"task", "fence", "tool_json"}
    assert traj.rewards["fence"] == pytest.approx(1 / 3) == traj.rewards["tool_json"]
    assert traj.info["termination"] == "done"
    assert traj.info["actions"] == {"run_tests": 1, "submit": 1, "malformed": 1}
    assert RENDERER.tokenizer.decode(traj.hint_tokens["fence"]) == (
        "<|im_start|>user\nReminder: put code in a ```python block.<|im_end|>\n"
    )


def test_limits_end_episodes_cleanly():
    long_turn = "x" * 200
    sampler = ScriptedSampler(lambda text, turn: long_turn)
    # A turn cut at its budget is recorded, closed by an unsampled <|im_end|>, and judged.
    cfg = RolloutConfig(max_new_tokens=16, max_total_tokens=1024, max_turns=2)
    (traj,) = rollout_groups(
        sampler, None, RENDERER, _env, TASKS[:1], rollouts_per_task=1, config=cfg,
        rng=jax.random.key(0), policy_version=0,
    )  # fmt: skip
    assert traj.info["termination"] == "max_turns" and traj.num_turns == 2
    assert traj.info["truncated_turns"] == 2
    assert (traj.turn_ids == 0).sum() == 16  # the budget, all sampled
    end = np.flatnonzero(traj.turn_ids == 0)[-1] + 1
    assert traj.tokens[end] == RENDERER.end_of_turn_ids[0] and traj.roles[end] == Role.PROMPT
    assert traj.behaviour_logprobs[end] == 0.0
    assert set(traj.rewards) == {"task", "fence", "tool_json"} and traj.rewards["task"] == 0.0
    # The environment's own turn limit.
    cfg = RolloutConfig(max_new_tokens=16, max_total_tokens=1024)
    (traj,) = rollout_groups(
        sampler, None, RENDERER, _env, TASKS[:1], rollouts_per_task=1, config=cfg,
        rng=jax.random.key(0), policy_version=0,
    )  # fmt: skip
    assert traj.info["termination"] == "max_turns" and traj.num_turns == 3
    # The context limit: the first turn's budget shrinks to what is left, then no room.
    prompt_len = len(RENDERER.render_with_roles([{"role": "user", "content": TASKS[0].prompt}])[0])
    limit = prompt_len + len(RENDERER.assistant_header()) + 12
    cfg = RolloutConfig(max_new_tokens=64, max_total_tokens=limit, min_turn_tokens=4)
    (traj,) = rollout_groups(
        sampler, None, RENDERER, _env, TASKS[:1], rollouts_per_task=1, config=cfg,
        rng=jax.random.key(0), policy_version=0,
    )  # fmt: skip
    assert traj.info["termination"] == "max_tokens" and traj.num_turns == 1
    assert (traj.turn_ids == 0).sum() == 11 and len(traj.tokens) == limit  # + <|im_end|>
    cfg = RolloutConfig(max_total_tokens=prompt_len + 5)
    with pytest.raises(ValueError, match=TASKS[0].task_id):
        rollout_groups(
            sampler, None, RENDERER, _env, TASKS[:1], rollouts_per_task=1, config=cfg,
            rng=jax.random.key(0), policy_version=0,
        )  # fmt: skip


@pytest.mark.slow
def test_random_model_rollout_logprobs_match_recompute():
    cfg = ModelConfig.from_config(config_lib.tiny_model_config())
    model = Transformer(cfg)
    params = init_params(model, jax.random.key(0))
    sampler = Sampler(model, pad_id=RENDERER.tokenizer.pad_id)
    config = RolloutConfig(max_new_tokens=12, max_total_tokens=160)
    trajs = rollout_groups(
        sampler, params, RENDERER, _env, TASKS, rollouts_per_task=2, config=config,
        rng=jax.random.key(1), policy_version=3,
    )  # fmt: skip
    width = 160
    tokens = np.zeros((len(trajs), width), np.int32)
    for i, t in enumerate(trajs):
        tokens[i, : len(t.tokens)] = t.tokens
        assert t.info["termination"] in ("done", "max_turns", "max_tokens")
        assert len(t.turn_verdicts) == t.num_turns >= 1 and "task" in t.rewards
    recomputed = np.asarray(jax.jit(sequence_logprobs, static_argnums=0)(model, params, tokens))
    for i, t in enumerate(trajs):
        sampled = t.turn_ids >= 0
        assert sampled.sum() > 0
        np.testing.assert_allclose(
            t.behaviour_logprobs[sampled], recomputed[i, : len(t.tokens)][sampled], atol=2e-5
        )


def test_evaluate_plain_vs_hinted():
    hint = "Reminder: put code in a ```python block."

    def script(text, turn):  # complies only when reminded
        code = "def f(x): return x"
        body = f"```python\n{code}\n```" if hint in text else code
        return body + '\n<tool_call>{"name": "submit"}</tool_call>'

    def env():
        return CodingEnv(CodingEnvConfig(requirements=("fence", "tool_json")))

    config = RolloutConfig(max_new_tokens=128, max_total_tokens=1024, temperature=0.0)
    results = {}
    for condition in ("plain", "hinted"):
        records, trajs = evaluate(
            ScriptedSampler(script), None, RENDERER, env, TASKS, config=config,
            rng=jax.random.key(0), condition=condition,
        )  # fmt: skip
        results[condition] = records
        assert [r.task_id for r in records] == [t.task_id for t in TASKS]
        assert all(r.turns == 1 and r.actions["submit"] == 1 for r in records)
        assert ((trajs[0].roles == Role.HINT).sum() > 0) == (condition == "hinted")
    assert [r.compliance for r in results["plain"]] == [{"fence": False, "tool_json": True}] * 2
    assert [r.compliance for r in results["hinted"]] == [{"fence": True, "tool_json": True}] * 2
    success = [all(x == y for x, y in task.hidden) for task in TASKS]
    assert [r.task_success for r in results["hinted"]] == success
    assert all(r.joint == r.task_success for r in results["hinted"])
    assert not any(r.joint for r in results["plain"])


class Reprefill:
    """The reference: the sampler without the rollout's TurnCache, so that every turn
    re-prefills every episode's whole context."""

    def __init__(self, sampler):
        self.sampler = sampler

    def sample(self, params, prompts, *, cache=None, keys=None, **kw):
        del cache, keys
        return self.sampler.sample(params, prompts, **kw)


def _expected_prefill(traj, group_size):
    """Tokens a rollout with the kept cache prefills: the prompt once per group, then what each
    turn appended (starting with the previous turn's last sampled token, never fed)."""
    header = len(RENDERER.assistant_header())
    contexts = [int(k) + header for k in traj.turn_starts]
    sampled = [int((traj.turn_ids == k).sum()) for k in range(len(contexts))]
    later = [c - (p + n - 1) for c, p, n in zip(contexts[1:], contexts, sampled, strict=False)]
    return contexts[0] / group_size + sum(later), sum(contexts)


@pytest.mark.slow
def test_rollout_with_kept_cache_samples_what_reprefill_samples():
    """Multi-turn episodes of a random model (turns cut at their budgets, episodes ending at
    different turns on the context limit): the kept KV cache gives the re-prefill's tokens,
    log-probs to float rounding, and prefills only the appended tokens; so does the hinted
    held-out evaluation."""
    cfg = ModelConfig.from_config(config_lib.tiny_model_config())
    model = Transformer(cfg)
    params = init_params(model, jax.random.key(0))
    sampler = Sampler(model, pad_id=RENDERER.tokenizer.pad_id, segment=8)
    # 256 tokens: the third turns get per-row budgets, and one group ends on the limit.
    config = RolloutConfig(max_new_tokens=24, max_total_tokens=256, min_turn_tokens=4)
    kw = dict(rollouts_per_task=3, config=config, rng=jax.random.key(1), policy_version=0)
    ref = rollout_groups(Reprefill(sampler), params, RENDERER, _env, TASKS, **kw)
    out = rollout_groups(sampler, params, RENDERER, _env, TASKS, **kw)
    assert {t.info["termination"] for t in out} == {"max_tokens", "max_turns"}
    assert {t.num_turns for t in out} == {2, 3}
    assert any(t.info["truncated_turns"] < t.num_turns for t in out)  # turns ended on <|im_end|>
    for r, t in zip(ref, out, strict=True):
        np.testing.assert_array_equal(r.tokens, t.tokens)
        np.testing.assert_array_equal(r.roles, t.roles)
        np.testing.assert_allclose(r.behaviour_logprobs, t.behaviour_logprobs, atol=1e-5)
        cached, reprefill = _expected_prefill(t, 3)
        assert t.info["prefill_tokens"] == pytest.approx(cached)
        assert r.info["prefill_tokens"] == reprefill
    metrics = rl_rollouts.rollout_metrics(out)
    assert metrics["rollout/prefill_tokens"] == pytest.approx(
        np.mean([_expected_prefill(t, 3)[0] for t in out])
    )
    assert (
        metrics["rollout/prefill_tokens"]
        < 0.5 * rl_rollouts.rollout_metrics(ref)["rollout/prefill_tokens"]
    )
    config = RolloutConfig(max_new_tokens=24, max_total_tokens=512)  # room for the hints
    eval_kw = dict(config=config, rng=jax.random.key(2), condition="hinted")
    _, ref_eval = evaluate(Reprefill(sampler), params, RENDERER, _env, TASKS, **eval_kw)
    _, out_eval = evaluate(sampler, params, RENDERER, _env, TASKS, **eval_kw)
    for r, t in zip(ref_eval, out_eval, strict=True):
        assert t.num_turns > 1 and (t.roles == Role.HINT).sum() > 0
        np.testing.assert_array_equal(r.tokens, t.tokens)
        np.testing.assert_allclose(r.behaviour_logprobs, t.behaviour_logprobs, atol=1e-5)


def test_env_workers_set_the_tool_call_threads_and_change_no_outcome(monkeypatch):
    """eval.env_workers is the pool that runs a turn's env.step calls; any size plays the same
    episodes (each environment is its own)."""
    import concurrent.futures

    from configs import tiny
    from tg_jax.evaluation import heldout
    from tg_jax.sampling import rollout

    sizes = []
    real_pool = concurrent.futures.ThreadPoolExecutor

    def pool(max_workers=None, **kw):
        sizes.append(max_workers)
        return real_pool(max_workers=max_workers, **kw)

    monkeypatch.setattr(rollout.concurrent.futures, "ThreadPoolExecutor", pool)
    base = tiny.get_config()
    params = init_params(Transformer(ModelConfig.from_config(base.model)), jax.random.key(0))
    tasks = generate_tasks("heldout", 4, seed=0)
    records = {}
    for workers in (1, 3):
        config = config_files.apply_overrides(base, {"eval.env_workers": workers})
        sizes.clear()
        records[workers] = heldout.evaluate_heldout(config, params, tasks, renderer=RENDERER)
        assert sizes and set(sizes) == {workers}
    assert records[1] == records[3] and len(records[1]) == 2 * len(tasks)  # plain + hinted


class _BrokenOnSecondTurn(CodingEnv):
    """A coding environment whose tool raises on its second step (a broken plug-in)."""

    def step(self, text):
        if self.summary().turns >= 1:
            raise ConnectionError("tool server went away")
        return super().step(text)


def test_an_environment_that_raises_fails_its_episode_only(caplog):
    """Episode 0's environment raises on turn 2; episode 1 (same group) plays on: the failed
    one ends "env_error" with every reward 0 and the error recorded; the group keeps its size;
    the rollout metrics count it."""
    made = []

    def env_factory():
        env = (_BrokenOnSecondTurn if not made else CodingEnv)(CodingEnvConfig(max_turns=3))
        made.append(env)
        return env

    sampler = ScriptedSampler(lambda text, turn: [RUN, GARBAGE, SUBMIT][turn])
    config = RolloutConfig(max_new_tokens=128, max_total_tokens=1024)
    with caplog.at_level("WARNING"):
        trajs = rollout_groups(
            sampler, None, RENDERER, env_factory, TASKS[:1], rollouts_per_task=2, config=config,
            rng=jax.random.key(0), policy_version=0,
        )  # fmt: skip
    broken, fine = trajs
    assert broken.info["termination"] == "env_error" and broken.num_turns == 2
    assert broken.info["env_error"] == "ConnectionError: tool server went away"
    assert broken.rewards == {"task": 0.0, "fence": 0.0, "tool_json": 0.0}
    assert broken.info["steps"][1] == {"error": "ConnectionError: tool server went away"}
    assert fine.info["termination"] == "done" and fine.num_turns == 3
    assert "tool server went away" in caplog.text
    m = rl_rollouts.rollout_metrics(trajs)
    assert m["rollout/end/env_error"] == 0.5 and m["rollout/end/done"] == 0.5


def test_a_rollout_in_qwen3_coder_s_format():
    """The Qwen3-Coder template renders the episode: its tools block lists the environment's
    tools, the environment reads the policy's XML calls with the qwen3_coder parser, and the
    hint of "tool_json" shows that format."""
    from tests.hf_checkpoints import chat_template
    from tg_jax.text.tool_formats import QWEN3_CODER

    coder = ChatRenderer(ByteTokenizer(), chat_template("qwen3_coder"))
    assert coder.tool_format is QWEN3_CODER
    xml_run = "```python\ndef f(x): return x\n```\n"
    xml_run += "<tool_call>\n<function=run_tests>\n</function>\n</tool_call>"
    json_run = RUN.split("</think>\n")[1]  # Hermes JSON: not this model's format
    sampler = ScriptedSampler(lambda text, turn: [xml_run, json_run, SUBMIT][turn])
    env = lambda: CodingEnv(CodingEnvConfig(max_turns=3, tools_in_prompt=True), QWEN3_CODER)  # noqa: E731
    (traj,) = rollout_groups(
        sampler, None, coder, env, TASKS[:1], rollouts_per_task=1,
        config=RolloutConfig(max_new_tokens=128, max_total_tokens=2048),
        rng=jax.random.key(0), policy_version=0,
    )  # fmt: skip
    prompt = coder.tokenizer.decode(sampler.prompts[0][0])
    assert "<tools>\n<function>\n<name>run_tests</name>" in prompt
    assert "<function=example_function_name>" in prompt  # the template's own instructions
    assert traj.turn_verdicts[0] == {"fence": True, "tool_json": True}
    assert traj.turn_verdicts[1]["tool_json"] is False  # JSON is not the XML format
    assert "passed" in traj.info["steps"][0]["tool_output"]
    assert "error: tool_call needs <function=NAME>" in traj.info["steps"][1]["tool_output"]
    assert coder.tokenizer.decode(traj.hint_tokens["tool_json"]) == (
        "<|im_start|>user\nReminder: use <tool_call>\n<function=...>\n</function>\n</tool_call>."
        "<|im_end|>\n"
    )


class RowCounter:
    """The sampler, recording how many rows each call holds."""

    def __init__(self, sampler):
        self.sampler, self.rows = sampler, []

    def sample(self, params, prompts, **kw):
        self.rows.append(len(prompts))
        return self.sampler.sample(params, prompts, **kw)


@pytest.mark.slow
def test_rows_above_max_rows_give_the_rollouts_of_one_call():
    """`max_rows` = 4 of 3 groups x 3 rollouts (9 episodes, ending at different turns): chunks
    of 4, 4 and 1 episodes, played one after the other; the trajectories are those of one call
    (tokens, roles, rewards; log-probs to float rounding); so is a sampled held-out evaluation."""
    cfg = ModelConfig.from_config(config_lib.tiny_model_config())
    model = Transformer(cfg)
    params = init_params(model, jax.random.key(0))
    sampler = Sampler(model, pad_id=RENDERER.tokenizer.pad_id, segment=8)
    tasks = generate_tasks("heldout", 3, seed=1)
    config = RolloutConfig(max_new_tokens=24, max_total_tokens=256, min_turn_tokens=4)
    kw = dict(rollouts_per_task=3, rng=jax.random.key(1), policy_version=0, first_group_id=5)
    one = RowCounter(sampler)
    ref = rollout_groups(one, params, RENDERER, _env, tasks, config=config, **kw)
    chunked = RowCounter(sampler)
    small = dataclasses.replace(config, max_rows=4)
    out = rollout_groups(chunked, params, RENDERER, _env, tasks, config=small, **kw)
    assert one.rows[0] == 9 and max(chunked.rows) == 4 and chunked.rows[0] == 4
    assert len(chunked.rows) > len(one.rows)  # the chunks are played one after another
    assert len({t.num_turns for t in out}) > 1
    for r, t in zip(ref, out, strict=True):
        assert (r.task_id, r.group_id) == (t.task_id, t.group_id)
        np.testing.assert_array_equal(r.tokens, t.tokens)
        np.testing.assert_array_equal(r.roles, t.roles)
        assert r.rewards == t.rewards and r.turn_verdicts == t.turn_verdicts
        np.testing.assert_allclose(r.behaviour_logprobs, t.behaviour_logprobs, atol=1e-5)
    eval_kw = dict(rng=jax.random.key(2), condition="plain")
    config = RolloutConfig(max_new_tokens=24, max_total_tokens=256, temperature=1.0)
    recs, ref_eval = evaluate(sampler, params, RENDERER, _env, tasks, config=config, **eval_kw)
    small = dataclasses.replace(config, max_rows=2)
    chunked = RowCounter(sampler)
    recs2, out_eval = evaluate(chunked, params, RENDERER, _env, tasks, config=small, **eval_kw)
    assert max(chunked.rows) == 2 and recs == recs2
    for r, t in zip(ref_eval, out_eval, strict=True):
        np.testing.assert_array_equal(r.tokens, t.tokens)
