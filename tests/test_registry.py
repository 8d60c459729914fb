"""The registry of pre-registered claims (tg_jax.evaluation.registry): a claim's key is derived
from its parts, an attempt is appended once with its own held-out draw, the claim's alpha is
spent over its attempts by alpha/2^k (what each spent, what is left, superseded verdicts),
and the outcome is appended when the report is written."""

import json
import os
import subprocess
import sys

import pytest

from tg_jax import config_files
from tg_jax.evaluation import protocol, registry
from tg_jax.train import pipeline

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(reg, **overrides):
    config = config_files.load_config_file(os.path.join(REPO, "configs", "tiny.py"))
    return config_files.apply_overrides(
        config, {"eval.hypothesis": "tiny/tg-vs-grpo", "eval.registry": str(reg), **overrides}
    )


def _arms(config):
    return {a: pipeline.arm_config(config, a) for a in config.pipeline.arms}


def _lines(reg):
    return [json.loads(x) for x in reg.read_text().splitlines()]


def _base(tmp_path, weights=b"w" * 64, name="base"):
    """A checkpoint directory with one weight file and a config header."""
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    (d / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}" + weights)
    (d / "config.json").write_text('{"hidden_size": 8}')
    return d


def test_attempts_are_appended_once_with_their_own_draw_and_budget_share(tmp_path):
    reg = tmp_path / "preregistrations.jsonl"
    base = _base(tmp_path)
    first = _config(reg, **{"model.hf_checkpoint": str(base)})
    out = protocol.preregister(first, str(tmp_path / "w1"), _arms(first))
    claim = registry.claim_key(protocol.claim_parts(first, str(base)))
    assert out["registry_id"] == f"{claim}#1" and out["level"] == pytest.approx(0.95)
    again = protocol.preregister(first, str(tmp_path / "w1"), _arms(first))  # a resumed run
    assert again["registry_id"] == f"{claim}#1" and len(_lines(reg)) == 1
    (entry,) = _lines(reg)
    assert entry["config"] == out["sha256"] and entry["earlier"] == [] and entry["outcome"] is None
    assert (entry["margin"], entry["candidate"]) == (-0.05, "tg")
    assert entry["spend"] == {"alpha": pytest.approx(0.05), "rule": "alpha/2^k",
                              "share": pytest.approx(0.025)}  # fmt: skip
    drawn = entry["heldout"]
    assert drawn["seed"] == registry.draw_seed(claim, 1) and drawn["tasks"] == first.eval.num_tasks
    tasks_1 = protocol.attempt_of(str(tmp_path / "w1"))["tasks"]
    assert sorted({f"{t['family']}:{','.join(map(str, t['params']))}" for t in tasks_1}) == sorted(
        drawn["units"]
    )
    # Another label, more RL steps, a new workdir: the same claim (its key is derived), its
    # second attempt, found without being named; 97.5%, and fresh held-out functions.
    second = _config(reg, **{"model.hf_checkpoint": str(base), "rl_loop.steps": 3,
                             "eval.hypothesis": "renamed"})  # fmt: skip
    out2 = protocol.preregister(second, str(tmp_path / "w2"), _arms(second))
    assert out2["registry_id"] == f"{claim}#2" and out2["earlier"] == [f"{claim}#1"]
    assert out2["level"] == pytest.approx(0.975) == registry.corrected_level(0.95, 1)
    entry2 = _lines(reg)[1]
    assert not set(entry2["heldout"]["units"]) & set(drawn["units"])
    # A later sitting of attempt 2 (a new workdir, the same pre-registration): the same draw.
    out3 = protocol.preregister(second, str(tmp_path / "w3"), _arms(second))
    assert out3["registry_id"] == f"{claim}#2" and len(_lines(reg)) == 2
    assert protocol.attempt_of(str(tmp_path / "w3"))["tasks"] == protocol.attempt_of(
        str(tmp_path / "w2"))["tasks"]  # fmt: skip
    # Another base model (other weights, the same header): another claim, its first attempt.
    other = _config(reg, **{"model.hf_checkpoint": str(_base(tmp_path, b"v" * 64, "b2"))})
    out4 = protocol.preregister(other, str(tmp_path / "w4"), _arms(other))
    assert out4["registry_id"].endswith("#1") and not out4["registry_id"].startswith(claim)
    # Outcomes are appended and merged by id; an abandoned attempt spends nothing.
    ni = {"verdict": "fail", "mean": -0.03, "lower": -0.07, "level": 0.95}
    registry.record_outcome(str(reg), f"{claim}#1", ni)
    registry.record_abandoned(str(reg), f"{claim}#2", "a bug in its commit")
    entries = registry.read(str(reg))
    assert entries[f"{claim}#1"]["outcome"]["verdict"] == "fail"
    assert entries[f"{claim}#2"]["outcome"] == {"verdict": "abandoned",
                                                "why": "a bug in its commit"}  # fmt: skip
    b = registry.budget(entries, claim)
    assert [r["spent"] for r in b["attempts"]] == pytest.approx([0.025, 0.0])
    assert b["left"] == pytest.approx(0.025)
    with pytest.raises(registry.RegistryError, match="no registered attempt 'tiny/x#1'"):
        registry.record_abandoned(str(reg), "tiny/x#1", "never registered")


class _Ev(dict):
    __getattr__ = dict.__getitem__


def _register(reg, sha, parts, level=0.95, drawn=None):
    ev = _Ev(hypothesis="h", registry=str(reg), earlier=())

    def draw(seed, exclude):
        if drawn is not None:
            drawn.append((seed, list(exclude)))
        return [f"u{seed}"], 4

    record = {"candidate": "tg", "baseline": "grpo", "seeds": [0, 1, 2], "margin": -0.05,
              "level": level}  # fmt: skip
    return registry.register(ev, record, sha, "w", parts, draw)


PARTS = {"env": "coding:add", "requirements": ["fence"], "metric": "m", "margin": -0.05,
         "candidate": "tg", "baseline": "grpo", "base_sha256": "ab" * 32}  # fmt: skip


def test_the_budget_alpha_over_2_to_the_k_spent_left_and_superseded_by_hand(tmp_path):
    assert [registry.corrected_level(0.95, k) for k in range(4)] == pytest.approx(
        [0.95, 0.975, 0.9875, 0.99375])  # fmt: skip
    reg = tmp_path / "r.jsonl"
    drawn = []
    e1 = _register(reg, "s1", PARTS, drawn=drawn)
    e2 = _register(reg, "s2", PARTS, drawn=drawn)
    assert (e1["level"], e2["level"]) == (pytest.approx(0.95), pytest.approx(0.975))
    assert drawn[1] == (registry.draw_seed(e1["claim"], 2), [f"u{drawn[0][0]}"])
    # Attempt 1 decided at its share; attempt 2 decided at an unsplit 95% (an earlier rule):
    # more than its share 0.0125, superseded; attempt 3 registered, its share 0.00625 reserved.
    registry.record_outcome(str(reg), e1["id"], {"verdict": "pass", "level": 0.95})
    registry.record_outcome(str(reg), e2["id"], {"verdict": "pass", "level": 0.95})
    b = registry.budget(registry.read(str(reg)), e1["claim"])
    assert [(r["share"], r["spent"], r["superseded"]) for r in b["attempts"]] == [
        (pytest.approx(0.025), pytest.approx(0.025), False),
        (pytest.approx(0.0125), pytest.approx(0.025), True),
    ]
    assert b["spent"] == pytest.approx(0.05) and b["left"] == pytest.approx(0.0)
    lines = registry.describe_budget(b, "h")
    assert "SUPERSEDED" in lines[2] and "SUPERSEDED" not in lines[1]
    assert lines[-1] == "  spent 0.05000, left 0.00000"
    # Nothing is left for attempt 3's share: refused, with the budget printed.
    with pytest.raises(registry.RegistryError, match=r"0.00000 of its alpha 0.05 left, under "
                       r"attempt 3's share 0.00625: its budget is spent"):  # fmt: skip
        _register(reg, "s3", PARTS)
    # A clean claim: 0.025 + 0.0125 spent, a pending third reserves 0.00625.
    clean = {**PARTS, "margin": -0.1}
    for n, level in ((1, 0.95), (2, 0.975)):
        e = _register(reg, f"c{n}", clean)
        registry.record_outcome(str(reg), e["id"], {"verdict": "fail", "level": level})
    e3 = _register(reg, "c3", clean)
    assert e3["level"] == pytest.approx(0.9875)
    b = registry.budget(registry.read(str(reg)), e3["claim"])
    assert b["spent"] == pytest.approx(0.04375) and b["left"] == pytest.approx(0.00625)
    assert not any(r["superseded"] for r in b["attempts"])
    # The claim's alpha was fixed at its first registration: another eval.level is refused.
    with pytest.raises(registry.RegistryError, match="set eval.level=0.95"):
        _register(reg, "c4", clean, level=0.9)


def test_the_claim_key_changes_with_each_part_and_nothing_else():
    key = registry.claim_key(PARTS)
    changed = {"env": "coding:sub", "requirements": ["fence", "tool_json"], "metric": "x",
               "margin": -0.04, "candidate": "tg_think", "baseline": "sdpo",
               "base_sha256": "cd" * 32}  # fmt: skip
    keys = {part: registry.claim_key({**PARTS, part: v}) for part, v in changed.items()}
    assert sorted(keys) == sorted(registry.CLAIM_PARTS)
    assert key not in keys.values() and len(set(keys.values())) == len(keys)
    same = dict(reversed(list(PARTS.items())))
    assert registry.claim_key({**same, "margin": -0.05, "requirements": ("fence",)}) == key
    assert registry.claim_key({**PARTS, "label": "anything"}) == key
    with pytest.raises(ValueError, match="base_sha256"):
        registry.claim_key({k: v for k, v in PARTS.items() if k != "base_sha256"})


def test_a_base_is_known_by_its_weights_not_its_header(tmp_path):
    a, b = _base(tmp_path, name="a"), _base(tmp_path, name="b")
    (b / "config.json").write_text('{"hidden_size": 8, "note": "another header"}')
    (b / "tokenizer.json").write_text("{}")
    assert protocol.weights_sha256(str(a)) == protocol.weights_sha256(str(b))
    (b / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}" + b"w" * 63 + b"x")
    assert protocol.weights_sha256(str(a)) != protocol.weights_sha256(str(b))
    cache = str(tmp_path / "cache.json")
    assert protocol.weights_sha256(str(b), cache) == protocol.weights_sha256(str(b))
    assert json.loads(open(cache).read())["sha256"] == protocol.weights_sha256(str(b))


def test_a_bad_registry_line_names_the_file_and_line(tmp_path):
    reg = tmp_path / "r.jsonl"
    reg.write_text('{"id": "a#1", "hypothesis": "a"}\nnot json\n')
    with pytest.raises(registry.RegistryError, match=r"r.jsonl:2: not a registry line"):
        registry.read(str(reg))


def test_the_command_refuses_an_unknown_earlier_attempt_before_any_work(tmp_path):
    reg = tmp_path / "preregistrations.jsonl"
    first = {"id": "tiny/tg-vs-grpo#1", "hypothesis": "tiny/tg-vs-grpo", "workdir": "elsewhere",
             "outcome": {"verdict": "fail"}}  # fmt: skip
    reg.write_text(json.dumps(first) + "\n")
    work = tmp_path / "w"
    cmd = [sys.executable, "-m", "tg_jax.main", "--config=configs/tiny.py", f"--workdir={work}",
           "--config.stage=pipeline", "--config.eval.hypothesis=tiny/tg-vs-grpo",
           f"--config.eval.registry={reg}", "--config.eval.earlier=('tiny/x#1',)"]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()[-1:]
    assert line.startswith("error: invalid config: eval.earlier names ['tiny/x#1']")
    assert not os.path.exists(work) or not os.listdir(work)  # nothing ran


def test_the_projects_registry_reads_with_what_each_attempt_spent():
    entries = registry.read(os.path.join(REPO, "docs", "preregistrations.jsonl"))
    assert len(entries) >= 20
    for hypothesis in {e["hypothesis"] for e in entries.values()}:
        ids = registry.attempts(entries, hypothesis)
        assert ids == [f"{hypothesis}#{n}" for n in range(1, len(ids) + 1)]
        for n, key in enumerate(ids):
            assert entries[key]["earlier"] == ids[:n], key
            if entries[key]["outcome"] is None:  # a registered run still going: its latest
                assert key == ids[-1], key
                continue
            assert entries[key]["outcome"]["verdict"] in registry.OUTCOMES
    # The fence claim: #1-#6 decided at an unsplit 95% (one-sided 0.025 each), #7 at 99.29%;
    # under alpha/2^k only #1 kept to its share, and its 0.1536 one-sided is 3 times 0.05.
    fence = registry.budget(entries, "legacy:fence/tg-vs-grpo")
    assert fence["spent"] == pytest.approx(6 * 0.025 + (1 - 0.9928571428571429) / 2)
    assert [r["superseded"] for r in fence["attempts"]] == [False] + [True] * 6
    passed = [
        r["id"]
        for c in registry.claims(entries)
        for r in registry.budget(entries, c)["attempts"]
        if r["verdict"] == "pass"
    ]
    standing = [r["id"] for c in registry.claims(entries)
                for r in registry.budget(entries, c)["attempts"]
                if r["verdict"] == "pass" and not r["superseded"]]  # fmt: skip
    assert sorted(passed) == ["default/tg_thinking-vs-grpo#1", "fence/tg-vs-grpo#3",
                              "fence/tg-vs-grpo#6", "joint/tg-vs-grpo#5"]  # fmt: skip
    assert standing == ["default/tg_thinking-vs-grpo#1"]
    for key, e in entries.items():  # the migration recorded what each spent
        assert "spent" in e, key
        assert e["spent"] == pytest.approx(registry.spent(e), abs=1e-6), key


def test_a_claim_with_attempts_from_before_derived_keys_is_not_restarted(tmp_path):
    """Attempts registered before derived keys read a fixed held-out set: a first derived
    attempt under their label, candidate and baseline would restart their spent alpha on
    tasks they read. Refused; another candidate (another claim) registers."""
    reg = tmp_path / "preregistrations.jsonl"
    legacy = {"id": "h#1", "hypothesis": "h", "candidate": "tg", "baseline": "grpo",
              "margin": -0.05, "level": 0.95,
              "outcome": {"verdict": "fail", "level": 0.95}}  # fmt: skip
    reg.write_text(json.dumps(legacy) + "\n")
    with pytest.raises(registry.RegistryError, match=r"1 attempt\(s\) of 'legacy:h' from before "
                       r"derived claim keys \(h#1; one-sided alpha spent 0.02500\)"):  # fmt: skip
        _register(reg, "sha", PARTS)
    assert len(_lines(reg)) == 1  # nothing appended
    other = {**PARTS, "candidate": "tg_think"}
    ev = _Ev(hypothesis="h", registry=str(reg), earlier=())
    record = {"candidate": "tg_think", "baseline": "grpo", "margin": -0.05, "level": 0.95}
    entry = registry.register(ev, record, "sha", "w", other, lambda seed, ex: ([f"u{seed}"], 4))
    assert entry["attempt"] == 1 and len(_lines(reg)) == 2
    # The project's registry: the default claim's two attempts from before derived keys.
    entries = registry.read(os.path.join(REPO, "docs", "preregistrations.jsonl"))
    record = {"candidate": "tg", "baseline": "grpo"}
    with pytest.raises(registry.RegistryError, match=r"2 attempt\(s\) of 'legacy:default/tg-vs"):
        registry._check_no_legacy(entries, [], "c", "default/tg-vs-grpo", record)
