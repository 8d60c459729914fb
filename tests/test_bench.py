"""Smoke test of `python -m tg_jax.bench`: the micro suite writes every figure, all finite."""

import json
import math
import os
import time

import pytest

from tg_jax.bench import __main__ as bench_main
from tg_jax.bench import e2e, suites

# Every figure the issue asks for, as flattened keys of the JSON's "figures".
REQUIRED = (
    "peak/gflop_s",
    "peak/xla_gflop_s",
    "peak/torch_gflop_s",
    "sampler/b8/tg_jax_tok_s",
    "sampler/b8/tg_jax_1dev_tok_s",
    "sampler/b8/hf_tok_s",
    "sampler/b8/speedup",
    "sampler/b8/speedup_min",
    "sampler/b8/speedup_max",
    "sampler/b8/speedup_unpaired",
    "sampler/b8/decode_gflop_s",
    "sampler/b8/decode_frac_of_peak",
    "train/default/tg_jax_tok_s",
    "train/default/mfu",
    "train/default/hf_tok_s",
    "train/default/speedup",
    "train/mid/tg_jax_tok_s",
    "train/mid/mfu",
    "train/mid/hf_tok_s",
    "train/mid/hf_mfu",
    "train/mid/speedup",
    "train/default/unroll_speedup",
    "rl/grpo_step_s",
    "rl/tg_step_s",
    "rl/tg_over_grpo",
    "rl/tg_over_grpo_50pct",
    "rl/tg_over_grpo_10pct",
    "rl/tg_full_over_grpo",
    "rl/teacher_flops_saved",
    "rl/teacher_flops_saved_10pct",
    "kl/chunked_mib",
    "kl/naive_mib",
    "kl/chunked_over_naive",
    "overlap/sampling_s",
    "overlap/training_s",
    "overlap/async_step_s",
    "overlap/async_over_sequential",
    "overlap/async_over_max",
    "e2e/metrics_span_s",
    "e2e/rl_wall_s/tg",
)


def _fake_workdir(path) -> str:
    """A finished-looking main-job workdir: two metric lines 90 s apart and a TG summary."""
    os.makedirs(path / "rl_tg_0", exist_ok=True)
    now = time.time()
    with open(path / "metrics.jsonl", "w") as f:
        for t in (now - 90.0, now):
            f.write(json.dumps({"step": 0, "stage": "sft", "time": t}) + "\n")
    with open(path / "rl_tg_0" / "rl_summary.json", "w") as f:
        json.dump({"arm": "tg", "costs": {"wall_time_s": 42.0}}, f)
    return str(path)


@pytest.mark.slow
def test_micro_suite_writes_every_figure(tmp_path, capsys):
    out = tmp_path / "bench.json"
    workdir = _fake_workdir(tmp_path / "wd")
    bench_main.main(["--suite", "micro", "--out", str(out), "--workdir", workdir])
    result = json.loads(out.read_text())
    figures = result["figures"]
    missing = [k for k in REQUIRED if k not in figures]
    assert not missing, f"missing figures: {missing}"
    bad = {k: v for k, v in figures.items() if not math.isfinite(v)}
    assert not bad, f"non-finite figures: {bad}"
    peak = max(figures["peak/xla_gflop_s"], figures["peak/torch_gflop_s"])
    assert figures["peak/gflop_s"] == peak  # the faster of the two matmuls
    assert figures["sampler/b8/devices"] in (1.0, 2.0)  # micro: 1 device or data-parallel on 2
    # The speed-up is the median of the paired rounds' ratios (micro: one round).
    assert figures["sampler/b8/speedup_min"] <= figures["sampler/b8/speedup"]
    assert figures["sampler/b8/speedup"] <= figures["sampler/b8/speedup_max"]
    tok_ratio = figures["sampler/b8/tg_jax_tok_s"] / figures["sampler/b8/hf_tok_s"]
    assert figures["sampler/b8/speedup"] == pytest.approx(tok_ratio)
    assert figures["e2e/metrics_span_s"] == pytest.approx(90.0, abs=1.0)
    assert figures["e2e/rl_wall_s/tg"] == 42.0
    assert "| train/mid/mfu |" in capsys.readouterr().out  # the table was printed


@pytest.mark.slow
def test_sampler_timing_in_a_child_process_with_more_devices():
    """More devices than this process has: a child process with that many host devices."""
    import jax

    from tg_jax import config_lib
    from tg_jax.bench import throughput
    from tg_jax.models import ModelConfig

    devices = 2 * jax.local_device_count()
    cfg = ModelConfig.from_config(config_lib.tiny_model_config())
    prompts = throughput.sampler_prompts(devices, 4, cfg.vocab_size)
    t = throughput.sampler_timing_devices(cfg, prompts, new_tokens=4, repeats=1, devices=devices)
    assert len(t.times) == 1 and t.median > 0 and t.cpu > 0


@pytest.mark.slow
def test_sampler_worker_failure_is_a_clear_error():
    """A child process that fails (here: empty prompts) raises with its stderr, never hangs."""
    import jax
    import numpy as np

    from tg_jax import config_lib
    from tg_jax.bench import throughput
    from tg_jax.models import ModelConfig

    cfg = ModelConfig.from_config(config_lib.tiny_model_config())
    devices = 2 * jax.local_device_count()
    empty = np.zeros((devices, 0), np.int64)
    with pytest.raises(RuntimeError, match=r"sampler worker .* failed:(.|\n)*non-empty prompts"):
        throughput.sampler_timing_devices(cfg, empty, new_tokens=4, repeats=1, devices=devices)


def test_e2e_not_measured_without_workdir(tmp_path):
    assert e2e.read_workdir(None) == {}
    assert e2e.read_workdir(str(tmp_path)) == {}


def test_engines_other_than_builtin_and_vllm_are_refused():
    for engines in (("sglang",), ("vllm",), ()):
        with pytest.raises(ValueError, match="--engines: builtin or builtin,vllm"):
            suites.run_suite(suites.SUITES["micro"], engines=engines)
    with pytest.raises(ValueError, match="got 'builtin,sglang'"):  # the command line's flag
        bench_main.main(["--suite", "micro", "--sections", "agentic", "--engines=builtin,sglang"])


def test_the_engines_smallest_bucket_reaches_the_agentic_section(monkeypatch):
    """--engine_min_bucket N: the agentic section's engine gets min_bucket N (0: its own)."""
    from tg_jax.bench import agentic

    seen = []
    monkeypatch.setattr(agentic, "agentic_section",
                        lambda **kw: seen.append(kw.get("engine_options")) or {})  # fmt: skip
    for flag, want in (("--engine_min_bucket=1", {"min_bucket": 1}), (None, None)):
        argv = ["--suite", "micro", "--sections", "agentic", "--no_hugepages"]
        bench_main.main(argv + ([flag] if flag else []))
        assert seen[-1] == want
    with pytest.raises(ValueError, match="--engine_min_bucket must be >= 0"):
        suites.run_suite(suites.SUITES["micro"], sections=("agentic",), engine_min_bucket=-1)


def test_decode_flops_counts_prefill_and_average_context():
    from tg_jax import config_lib
    from tg_jax.bench import throughput
    from tg_jax.models import ModelConfig

    cfg = ModelConfig.from_config(config_lib.tiny_model_config())
    got = throughput.decode_flops(cfg, batch=2, prompt_len=4, new_tokens=6)
    # Decode token i (0..5) sees 4 + i + 1 keys; like flops_per_token, count half the diagonal.
    per_key = 2 * 2 * cfg.num_heads * cfg.head_dim * cfg.num_layers
    base = cfg.flops_per_token(0)
    decode = sum(base + per_key * (4 + i + 0.5) for i in range(6))
    prefill = 4 * cfg.flops_per_token(4)
    assert got == pytest.approx(2 * (prefill + decode))


def test_suites_flatten_keeps_numbers_only():
    assert suites.flatten({"a": {"b": 1, "c": "x", "d": {"e": 2.5}}, "f": True}) == {
        "a/b": 1.0,
        "a/d/e": 2.5,
    }


@pytest.mark.slow
def test_unrolled_layer_loop_matches_scan():
    """`scan_unroll` (the CPU speed-up the benchmark measures) changes no number."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tg_jax import config_lib
    from tg_jax.models import ModelConfig, Transformer, forward, init_params

    base = config_lib.tiny_model_config().to_dict()
    scanned = Transformer(ModelConfig.from_config(base))
    unrolled = Transformer(ModelConfig.from_config({**base, "scan_unroll": base["num_layers"]}))
    params = init_params(scanned, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 272, (2, 16)), jnp.int32)

    def loss(model, p):
        return jnp.mean(forward(model, p, tokens) ** 2)

    logits = [jax.jit(lambda p, m=m: forward(m, p, tokens))(params) for m in (unrolled, scanned)]
    np.testing.assert_allclose(*logits, rtol=1e-6, atol=1e-6)
    models = (unrolled, scanned)
    g_unroll, g_scan = [jax.jit(jax.grad(lambda p, m=m: loss(m, p)))(params) for m in models]
    for a, b in zip(jax.tree.leaves(g_unroll), jax.tree.leaves(g_scan), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _fake_worker(body: str) -> list[str]:
    """A `CallWorker` command: Python that runs `body` (it sees `job`, `serve_calls`)."""
    import sys

    prelude = (
        "import json, sys, time\n"
        "from tg_jax.bench.measure import serve_calls\n"
        "job = json.loads(sys.stdin.readline())\n"
    )
    return [sys.executable, "-c", prelude + body]


@pytest.mark.slow
def test_paired_timings_alternate_calls_and_keep_idle_workers_stopped(tmp_path):
    from tg_jax.bench import measure

    log = tmp_path / "calls.log"
    body = (
        "def run():\n"
        "    time.sleep(job['sleep'])\n"
        "    open(job['log'], 'a').write(job['name'] + '\\n')\n"
        "serve_calls(run, warmup=0)\n"
    )
    jobs = {"fast": 0.01, "slow": 0.05}
    workers = {
        name: measure.CallWorker(_fake_worker(body), {"sleep": s, "log": str(log), "name": name})
        for name, s in jobs.items()
    }
    try:
        assert [measure.process_state(w.pid) for w in workers.values()] == [
            "T",
            "T",
        ]  # stopped when idle
        t = measure.paired_timings(workers, rounds=3)
        assert [measure.process_state(w.pid) for w in workers.values()] == ["T", "T"]
    finally:
        for w in workers.values():
            w.close()
    # Round 0 fast then slow, round 1 reversed, round 2 as round 0.
    assert log.read_text().split() == ["fast", "slow", "slow", "fast", "fast", "slow"]
    assert len(t["fast"].times) == len(t["slow"].times) == 3
    assert min(t["slow"].times) >= 0.05 and min(t["fast"].times) >= 0.01
    ratios = measure.round_ratios(t["slow"], t["fast"])
    expected = [s / f for s, f in zip(t["slow"].times, t["fast"].times, strict=True)]
    assert ratios == pytest.approx(expected)  # round r of one side over round r of the other
    for w in workers.values():  # closed: no process left behind
        with pytest.raises(ProcessLookupError):
            os.kill(w.pid, 0)


@pytest.mark.slow
def test_call_worker_failures_are_clear_errors():
    from tg_jax.bench import measure

    crash = _fake_worker("raise SystemExit('cannot build the model: bad job')")
    with pytest.raises(RuntimeError, match=r"exited with code 1(.|\n)*bad job"):
        measure.CallWorker(crash, {})
    chatter = _fake_worker("print('hello'); serve_calls(lambda: None)")
    with pytest.raises(RuntimeError, match="unexpected output b'hello'"):
        measure.CallWorker(chatter, {})
    start = time.monotonic()
    hang = _fake_worker("time.sleep(600)")
    with pytest.raises(RuntimeError, match="no reply within 2 s"):
        measure.CallWorker(hang, {}, timeout_s=2)
    assert time.monotonic() - start < 30
    slow_call = _fake_worker("serve_calls(lambda: time.sleep(600), warmup=0)")
    with measure.CallWorker(slow_call, {}) as w:  # its start (imports) may be slow under load
        w.timeout_s = 2
        with pytest.raises(RuntimeError, match="no reply within 2 s"):
            w.call()
    with pytest.raises(ProcessLookupError):
        os.kill(w.pid, 0)


def test_serve_calls_times_each_request_and_rejects_other_input():
    import io

    from tg_jax.bench import measure

    calls = []
    out = io.StringIO()
    measure.serve_calls(
        lambda: calls.append(1), warmup=2, stdin=io.StringIO("run\nrun\n"), stdout=out
    )
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[0] == {"ready": True} and len(calls) == 4  # 2 warm-up calls + 2 timed
    assert [sorted(r) for r in lines[1:]] == [["cpu", "wall"], ["cpu", "wall"]]
    with pytest.raises(ValueError, match="expected 'run', got 'stop'"):
        measure.serve_calls(lambda: None, stdin=io.StringIO("stop\n"), stdout=io.StringIO())


@pytest.mark.slow
def test_accelerator_bench_tiny_figures_follow_from_their_timings(tmp_path):
    """`python -m tg_jax.bench.accelerator --tiny` (any backend): every section's figures,
    and each MFU / rate is its FLOPs or tokens over its own timing and the run's peak."""
    from tg_jax.bench import accelerator, throughput  # noqa: PLC0415
    from tg_jax.models import ModelConfig  # noqa: PLC0415

    out = tmp_path / "acc.json"
    accelerator.main(["--tiny", "--sections", "train,engine", "--decode_steps", "1,4",
                      "--out", str(out)])  # fmt: skip
    res = json.loads(out.read_text())
    peak = res["sections"]["peak"]["tflops"] * 1e12
    train = res["sections"]["train"]
    cfg = ModelConfig.from_config(accelerator.config_lib.model_config(**accelerator.TINY))
    flops = throughput.train_flops(cfg, train["batch"], train["seq_len"])
    assert flops == 3 * cfg.flops_per_token(128) * 4 * 128
    assert math.isclose(train["mfu"], flops / train["step_s"] / peak, rel_tol=1e-9)
    assert math.isclose(train["tok_s"], 4 * 128 / train["step_s"], rel_tol=1e-9)
    engine = res["sections"]["engine"]
    for k in (1, 4):
        ratio = engine[f"engine_k{k}_tok_s"] / engine["sampler_tok_s"]
        assert math.isclose(engine[f"engine_k{k}_over_sampler"], ratio, rel_tol=1e-9)
        assert engine[f"engine_k{k}_tok_s"] > 0
    assert res["platform"] == "cpu" and "weight_read_share" not in str(engine)
