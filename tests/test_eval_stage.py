"""`--config.stage=eval`: a checkpoint directory's held-out evaluation with traces, no training.

The acceptance test runs the tiny main job (one arm), then the eval stage on its export as a
user runs it: the same episodes token for token, the same figures, and one more read in the
held-out read ledger."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.test_pipeline import FAST_PIPELINE, _config
from tg_jax import config_files
from tg_jax.errors import ConfigError
from tg_jax.evaluation import heldout_reads
from tg_jax.sampling.episode import EpisodeRecord
from tg_jax.sampling.trajectory import Trajectory
from tg_jax.text import ByteTokenizer, ChatRenderer
from tg_jax.text.chat import Role
from tg_jax.tpu.distributed import cpu_devices_env
from tg_jax.train import eval_stage

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_names_of_checkpoint_directories():
    assert eval_stage.eval_name("W/export/tg_seed2/") == "tg_seed2"
    assert eval_stage.eval_name("W/runs/tg_seed0/export/step_4") == "tg_seed0_step_4"
    assert eval_stage.eval_name("/ckpts/Qwen3-1.7B") == "Qwen3-1.7B"
    assert eval_stage.arm_and_seed("tg_seed2") == ("tg", 2)
    assert eval_stage.arm_and_seed("grpo_task_only_seed1_step_4") == ("grpo_task_only", 1)
    assert eval_stage.arm_and_seed("mine_seed3") == (None, 3)  # not an arm: the config as is
    assert eval_stage.arm_and_seed("Qwen3-1.7B") == (None, 0)


def test_eval_stage_needs_a_checkpoint_directory(tmp_path):
    config = config_files.apply_overrides(_config(), {"stage": "eval"})
    with pytest.raises(ConfigError, match="set --config.model.hf_checkpoint"):
        eval_stage.run(config, str(tmp_path))
    assert os.listdir(tmp_path) == []  # nothing read, nothing written


def test_an_evaluation_only_read_is_a_look(tmp_path):
    w = str(tmp_path)
    # The first read of a workdir's held-out tasks: no earlier look to repeat.
    assert heldout_reads.check_read(w, heldout_reads.EVAL_ONLY, "mine") is False
    heldout_reads.record_read(w, heldout_reads.FINAL, "tg_seed0", tasks=2)
    with pytest.raises(heldout_reads.HeldoutReadError, match="evaluating mine on them is another"):
        heldout_reads.check_read(w, heldout_reads.EVAL_ONLY, "mine")
    assert heldout_reads.check_read(w, heldout_reads.EVAL_ONLY, "mine", again=True) is True
    # The final evaluation of another run is not refused by the look of an evaluation.
    heldout_reads.record_read(w, heldout_reads.EVAL_ONLY, "mine", tasks=2, asked=True)
    assert heldout_reads.check_read(w, heldout_reads.FINAL, "grpo_seed0") is False
    s = heldout_reads.summary(w)
    assert [(r["purpose"], r["run"]) for r in s["extra"]] == [("evaluation only", "mine")]
    assert "**1 more read(s)**: evaluation only of mine on" in heldout_reads.describe(s)


def test_episode_trace_reads_every_turn():
    renderer = ChatRenderer(ByteTokenizer())
    enc = renderer.tokenizer.encode
    call = '<tool_call>{"name": "run_tests", "arguments": {}}</tool_call>'
    pieces = [  # (text, role, assistant turn or -1)
        ("<|im_start|>user\nf(1)=2<|im_end|>\n", Role.PROMPT, -1),
        ("<|im_start|>assistant\n", Role.PROMPT, -1),
        (f"x{call}<|im_end|>", Role.ANSWER, 0),
        ("<|im_start|>user\n2 failed<|im_end|>\n", Role.ENV, -1),
        ("<|im_start|>user\nUse a fence.<|im_end|>\n", Role.HINT, -1),
        ("<|im_start|>assistant\n", Role.PROMPT, -1),
        ("```python\nx\n```<|im_end|>", Role.ANSWER, 1),
    ]
    tokens, roles, turn_ids, starts = [], [], [], []
    for text, role, turn in pieces:
        if text == "<|im_start|>assistant\n":
            starts.append(len(tokens))
        ids = enc(text)
        tokens += ids
        roles += [role] * len(ids)
        turn_ids += [turn] * len(ids)
    n0 = len(enc(f"x{call}<|im_end|>"))
    logprobs = np.where(np.asarray(turn_ids) >= 0, -0.5, 0.0)
    traj = Trajectory(
        tokens=np.asarray(tokens), roles=np.asarray(roles, np.int8),
        turn_ids=np.asarray(turn_ids), turn_starts=np.asarray(starts),
        behaviour_logprobs=logprobs.astype(np.float32),
        turn_verdicts=[{"fence": False}, {"fence": True}], rewards={"task": 0.0, "fence": 1.0},
        hint_tokens={}, group_id=0, policy_version=-1, task_id="t",
    )  # fmt: skip
    record = EpisodeRecord(
        task_id="t", condition="plain", sample=0, task_success=False,
        compliance={"fence": False}, actions={"run_tests": 1}, turns=2,
    )  # fmt: skip
    trace = eval_stage.episode_trace(record, traj, renderer)
    assert trace["prompt"] == "<|im_start|>user\nf(1)=2<|im_end|>\n"
    assert trace["rewards"] == {"task": 0.0, "fence": 1.0} and trace["task_id"] == "t"
    t0, t1 = trace["turns"]
    assert t0["text"] == f"x{call}<|im_end|>" and t0["tokens"] == n0
    assert t0["logprob"] == -0.5 * n0
    assert t0["tool_calls"] == [{"name": "run_tests", "arguments": {}}]
    assert (t0["verdicts"], t0["failed"], t0["hint"]) == ({"fence": False}, ["fence"], "")
    assert t0["observation"] == "<|im_start|>user\n2 failed<|im_end|>\n"
    assert t1["hint"] == "<|im_start|>user\nUse a fence.<|im_end|>\n"
    assert (t1["tool_calls"], t1["failed"], t1["observation"]) == ([], [], "")


def _eval_command(workdir: str, *extra: str) -> list[str]:
    overrides = [f"--config.{k}={v}" for k, v in FAST_PIPELINE.items()]
    return [
        sys.executable, "-m", "tg_jax.main", "--config=configs/tiny.py", f"--workdir={workdir}",
        "--config.stage=eval", f"--config.model.hf_checkpoint={workdir}/export/tg_seed0",
        *overrides, *extra,
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.e2e
def test_eval_of_an_export_reproduces_the_arms_heldout_figures(tmp_path, monkeypatch):
    from tg_jax.train import pipeline

    w = str(tmp_path / "w")
    expected = tmp_path / "final_traces.jsonl"
    final = heldout_reads.final_evaluation

    def final_with_traces(cfg, workdir, run_name, run_dir, params, tasks, renderer, **kw):
        def traces(recs, trajs):
            eval_stage.write_traces(expected, recs, trajs, renderer)

        return final(cfg, workdir, run_name, run_dir, params, tasks, renderer, traces=traces, **kw)

    monkeypatch.setattr(heldout_reads, "final_evaluation", final_with_traces)
    config = config_files.apply_overrides(_config(), {"pipeline.arms": ("tg",)})
    res = pipeline.run_pipeline(config, w)
    monkeypatch.undo()
    assert expected.exists()

    # The workdir's held-out tasks were read by the run's final evaluation: another look
    # needs asking for, and is refused before any episode.
    ask = config_files.apply_overrides(
        config, {"stage": "eval", "model.hf_checkpoint": f"{w}/export/tg_seed0"}
    )
    with pytest.raises(heldout_reads.HeldoutReadError, match="another look"):
        eval_stage.run(ask, w)
    assert len(heldout_reads.reads(w)) == 1

    env = {**cpu_devices_env(1), "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    cmd = _eval_command(w, "--config.eval.reread_heldout=True")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "as arm 'tg' on 2 tasks" in proc.stdout
    out = os.path.join(w, "eval", "tg_seed0")

    def text(*parts: str) -> str:
        with open(os.path.join(*parts)) as f:
            return f.read()

    # The same episodes (every token, verdict and outcome; the tokens' log-probs to float32
    # rounding: another process compiles its own programs) and the same figures.
    assert text(out, "heldout.jsonl") == text(w, "runs", "tg_seed0", "heldout.jsonl")
    traces = [json.loads(line) for line in text(out, "traces.jsonl").splitlines()]
    final_traces = [json.loads(line) for line in expected.read_text().splitlines()]
    assert len(traces) == len(final_traces) == 4  # 2 tasks x 2 conditions x 1 sample
    for got, want in zip(traces, final_traces, strict=True):
        assert len(got["turns"]) == 1 and got["turns"][0]["tokens"] > 0
        for turn, ref in zip(got["turns"], want["turns"], strict=True):
            assert turn.pop("logprob") == pytest.approx(ref.pop("logprob"), rel=1e-5, abs=1e-5)
        assert got == want
    results = json.loads(text(out, "results.json"))
    assert results["arms"]["tg"]["heldout"] == res["arms"]["tg"]["heldout"]
    boot = results["arms"]["tg"]["heldout"]["plain"]["bootstrap"]["compliance"]
    md = text(out, "report.md")
    assert "| tg | 1 | 2 | " in md and "## Compliance per requirement" in md
    assert pipeline.headline(results).splitlines()[1] in proc.stdout
    assert f"{boot['mean']:.2f} [{boot['low']:.2f}, {boot['high']:.2f}]" in md
    assert "Training-time" not in md  # no training
    reads = heldout_reads.reads(w)
    assert [(r["purpose"], r["run"], r["asked"], r["finished"]) for r in reads] == [
        ("final evaluation", "tg_seed0", False, True),
        ("evaluation only", "tg_seed0", True, True),
    ]
    assert "**1 more read(s)**: evaluation only of tg_seed0 on" in md
    # A rerun reads its episodes back: no read, the same figures.
    again = eval_stage.run(config_files.apply_overrides(ask, {"eval.reread_heldout": True}), w)
    assert len(heldout_reads.reads(w)) == 2
    assert again["arms"]["tg"]["heldout"] == results["arms"]["tg"]["heldout"]
