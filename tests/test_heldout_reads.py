"""Each registered attempt's own held-out draw (tasks.draw_heldout, protocol.draw_tasks) and
the read ledger beside the registry (evaluation.heldout_reads): a read is written when it
starts, and one that did not finish is listed."""

import json

import pytest

from tg_jax.envs import tasks
from tg_jax.evaluation import heldout_reads, protocol, registry

EASY = tasks.EASY_FAMILIES


def test_a_draw_is_fresh_disjoint_from_training_and_reproducible_from_its_seed():
    pool = tasks.heldout_functions(EASY)
    assert len(pool) == 104  # 4 families x 26 held-out constants
    train = {t.function_id for t in tasks.generate_tasks("train", 2000, 0, families=EASY)}
    first = tasks.draw_heldout(128, 7, 26, families=EASY)
    units = {t.function_id for t in first}
    assert len(units) == 26 and units <= set(pool) and not units & train
    assert {t.split for t in first} == {"heldout"}
    assert sorted(t.family for t in first[:26]).count("add") in (6, 7)  # balanced: 26 = 6+6+7+7
    assert first == tasks.draw_heldout(128, 7, 26, families=EASY)  # the seed reproduces it
    assert first != tasks.draw_heldout(128, 8, 26, families=EASY)
    # The claim's later attempts exclude what earlier ones read: four quarters, then none.
    seen = set(units)
    for seed in (8, 9, 10):
        more = {t.function_id for t in tasks.draw_heldout(128, seed, 26, families=EASY,
                                                          exclude=sorted(seen))}  # fmt: skip
        assert len(more) == 26 and not more & seen
        seen |= more
    assert seen == set(pool)
    with pytest.raises(ValueError, match="0 held-out function"):
        tasks.draw_heldout(128, 11, 26, families=EASY, exclude=sorted(seen))


def _attempt(tmp_path, workdir, attempt_id="c#1"):
    workdir.mkdir(parents=True, exist_ok=True)
    reg = tmp_path / "docs" / "preregistrations.jsonl"
    rec = {"id": attempt_id, "registry": str(reg), "config": "sha", "tasks": []}
    (workdir / protocol.ATTEMPT_FILE).write_text(json.dumps(rec))
    return reg


def test_an_unfinished_read_is_listed_and_is_a_look_in_every_workdir_of_the_attempt(tmp_path):
    w1, w2 = tmp_path / "w1", tmp_path / "w2"
    reg = _attempt(tmp_path, w1)
    _attempt(tmp_path, w2)
    ledger = reg.parent / heldout_reads.READS_FILE
    assert heldout_reads.ledger_path(str(w1)) == str(ledger)
    done = heldout_reads.start_read(str(w1), heldout_reads.FINAL, "grpo_seed0", tasks=8)
    heldout_reads.finish_read(str(w1), done["read"])
    heldout_reads.start_read(str(w1), heldout_reads.FINAL, "tg_seed0", tasks=8)  # killed here
    lines = [json.loads(x) for x in ledger.read_text().splitlines()]
    assert [x["event"] for x in lines] == ["start", "end", "start"]
    s = heldout_reads.summary(str(w2))  # another workdir (a later sitting) of the attempt
    assert [(r["run"], r["finished"]) for r in s["reads"]] == [("grpo_seed0", True),
                                                               ("tg_seed0", False)]  # fmt: skip
    assert [r["run"] for r in s["unfinished"]] == ["tg_seed0"]
    assert "**not finished**: final evaluation of tg_seed0 started" in heldout_reads.describe(s)
    with pytest.raises(heldout_reads.HeldoutReadError, match=r"started, not finished"):
        heldout_reads.check_read(str(w2), heldout_reads.FINAL, "tg_seed0")
    assert heldout_reads.check_read(str(w2), heldout_reads.FINAL, "tg_seed1") is False
    # Another attempt beside the same registry reads its own tasks: not a second look.
    w3 = tmp_path / "w3"
    _attempt(tmp_path, w3, "c#2")
    assert heldout_reads.check_read(str(w3), heldout_reads.FINAL, "tg_seed0") is False
    assert heldout_reads.reads(str(w3)) == []


def test_an_unregistered_run_keeps_its_ledger_in_its_workdir(tmp_path):
    heldout_reads.record_read(str(tmp_path), "tg_jax.evaluation.prefill", tasks=4, asked=True)
    (r,) = heldout_reads.reads(str(tmp_path))
    assert (r["purpose"], r["asked"], r["finished"]) == ("tg_jax.evaluation.prefill", True, True)
    assert (tmp_path / heldout_reads.READS_FILE).exists()
    (tmp_path / heldout_reads.READS_FILE).write_text('{"read": "x"')
    with pytest.raises(heldout_reads.HeldoutReadError, match=r":1: not a held-out read ledger"):
        heldout_reads.reads(str(tmp_path))


def test_the_draw_seed_is_fixed_by_claim_and_attempt():
    assert registry.draw_seed("abc", 1) == registry.draw_seed("abc", 1)
    assert len({registry.draw_seed("abc", 1), registry.draw_seed("abc", 2),
                registry.draw_seed("abd", 1)}) == 3  # fmt: skip


def test_the_report_line_names_the_draw_and_the_alpha(tmp_path):
    from tg_jax import config_files  # noqa: PLC0415

    config = config_files.load_config_file("configs/tiny.py")
    line = protocol.describe_draw(config, str(tmp_path))
    assert (
        "no registered draw" in line and "one-sided alpha of 0.025 (two-sided level 0.95)" in line
    )
    rec = {
        "id": "c#2",
        "heldout": {"seed": 5, "units": ["add:1", "sub:2"], "tasks": 4},
        "spend": {"alpha": 0.05, "rule": "alpha/2^k", "share": 0.0125},
        "level": 0.975,
    }
    (tmp_path / protocol.ATTEMPT_FILE).write_text(json.dumps(rec))
    assert protocol.describe_draw(config, str(tmp_path)) == (
        "Held-out tasks: attempt c#2's own draw (seed 5, 2 unit(s) read by no earlier attempt, "
        "4 tasks); it spends a one-sided alpha of 0.0125 of the claim's 0.05 (alpha/2^k; "
        "two-sided level 0.975)."
    )


def _config(path="configs/tiny.py", **overrides):
    from tg_jax import config_files

    return config_files.apply_overrides(config_files.load_config_file(path), overrides)


def _attempts(config, seeds):
    """The draws of successive attempts of one claim, each excluding the earlier ones' units."""
    seen, draws = [], []
    for seed in seeds:
        drawn = protocol.draw_tasks(config, seed, sorted(seen))
        units = protocol.units_of(drawn)
        assert not set(units) & set(seen)
        seen += units
        draws.append(drawn)
    return draws, seen


def test_an_swe_attempt_draws_repositories_no_earlier_attempt_read():
    config = _config("configs/swe.py", **{"eval.num_tasks": 6})
    (first, second), _ = _attempts(config, (3, 4))
    assert len(first) == len(second) == 6 and {t.split for t in first} == {"heldout"}
    again = protocol.draw_tasks(config, 3, [])
    assert protocol.units_of(again) == protocol.units_of(first)  # the seed reproduces it


def test_a_plugin_attempt_draws_records_no_earlier_attempt_read_until_none_are_left():
    from tests import plugin_example

    kind, req = "tests.plugin_example:WordEnv", "tests.plugin_example:short_turns"
    config = _config(**{"env.kind": kind, "env.requirements": (req,), "eval.num_tasks": 2})
    draws, seen = _attempts(config, (1, 2, 3, 4))
    words = [t["word"] for d in draws for t in d]
    assert sorted(words) == sorted(plugin_example.WordEnv.WORDS)  # 8 words, 2 per attempt
    with pytest.raises(registry.RegistryError, match="hold only 0 that no earlier attempt"):
        protocol.draw_tasks(config, 5, sorted(seen))


def test_a_task_file_attempt_draws_a_quarter_of_its_tasks_no_earlier_attempt_read(tmp_path):
    # 16 tasks of 16 hidden functions (a unit is a task's function: two tasks of one function
    # go to the same attempt or neither).
    by_function = {t.function_id: t for t in tasks.generate_tasks("heldout", 200, seed=5)}
    path = tmp_path / "heldout.jsonl"
    with path.open("w") as f:
        for i, t in enumerate(list(by_function.values())[:16]):
            f.write(json.dumps({**t.to_record(), "task_id": f"mine-{i}"}) + "\n")
    config = _config(**{"tasks.heldout_source": str(path), "eval.num_tasks": 8})
    draws, seen = _attempts(config, (1, 2, 3, 4))
    assert [len(d) for d in draws] == [4] * 4  # a quarter of 16 each (eval.num_tasks 8)
    assert sorted(t.task_id for d in draws for t in d) == sorted(f"mine-{i}" for i in range(16))
    assert protocol.units_of(protocol.draw_tasks(config, 1, [])) == protocol.units_of(draws[0])
    with pytest.raises(registry.RegistryError, match="0 task\\(s\\) are left"):
        protocol.draw_tasks(config, 5, sorted(seen))
