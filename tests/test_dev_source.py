"""`tasks.dev_source`: a user's own dev split, read by every check before the final evaluation
(`tg_jax.data.task_data.dev_tasks`) instead of generated dev tasks."""

import json

import ml_collections
import numpy as np
import pytest

from tests.test_plugins import EX, _main
from tg_jax import config_lib
from tg_jax.data import task_data
from tg_jax.data.task_settings import SweTasksConfig, TasksConfig
from tg_jax.envs.swe.generator import generate_swe_tasks
from tg_jax.envs.tasks import Task, generate_tasks
from tg_jax.errors import ConfigError


def _config(env, **tasks) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.env = env
    c.tasks = (config_lib.swe_tasks_config if env.kind == "swe" else config_lib.tasks_config)(
        **tasks
    )
    return c


def _write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def test_dev_file_sample_is_seeded_and_mapped(tmp_path):
    # The user's file: coding tasks (dev-split functions), their ids under "uid".
    mine = [t.to_record() for t in generate_tasks("dev", 6, seed=3)]
    path = _write_jsonl(tmp_path / "dev.jsonl",
                        [{("uid" if k == "task_id" else k): v for k, v in r.items()}
                         for r in mine])  # fmt: skip
    cfg = _config(config_lib.env_config(), dev_source=path, fields=("task_id=uid",))
    a = task_data.dev_tasks(cfg, 4, seed=1)
    want_ids = [mine[i]["task_id"] for i in np.random.default_rng(1).permutation(6)[:4]]
    assert [t.task_id for t in a] == want_ids
    assert all(isinstance(t, Task) and t.split == "dev" for t in a)
    assert [t.task_id for t in task_data.dev_tasks(cfg, 4, seed=1)] == want_ids  # same seed
    other = [t.task_id for t in task_data.dev_tasks(cfg, 4, seed=2)]
    assert other != want_ids and set(other) <= {r["task_id"] for r in mine}
    # More asked than the file holds: all of them, once each.
    every = [t.task_id for t in task_data.dev_tasks(cfg, 50, seed=0)]
    assert sorted(every) == sorted(r["task_id"] for r in mine)
    # Without the file: generated dev tasks.
    plain = task_data.dev_tasks(_config(config_lib.env_config()), 4, seed=1)
    assert len(plain) == 4 and [t.task_id for t in plain] != want_ids


def test_swe_dev_file(tmp_path):
    records = [t.to_record() for t in generate_swe_tasks("train", 3, 0)]
    path = _write_jsonl(tmp_path / "dev.jsonl", records)
    got = task_data.dev_tasks(_config(config_lib.swe_env_config(), dev_source=path), 2, seed=0)
    assert len(got) == 2 and {t.task_id for t in got} <= {r["task_id"] for r in records}


def test_a_plugin_without_a_generator_takes_its_dev_tasks_from_the_file(tmp_path):
    env = config_lib.env_config(kind=f"{EX}:FileOnlyEnv", requirements=())
    with pytest.raises(ConfigError, match="tasks.dev_source is empty"):
        task_data.check_dev_tasks(_config(env), "the periodic evaluation")
    path = _write_jsonl(tmp_path / "dev.jsonl",
                        [{"task_id": f"d{i}", "word": "apple"} for i in range(3)])  # fmt: skip
    cfg = _config(env, dev_source=path)
    task_data.check_dev_tasks(cfg, "the periodic evaluation")  # no error now
    got = task_data.dev_tasks(cfg, 2, seed=0)
    assert [r["kind"] for r in got] == ["plugin", "plugin"] and {r["split"] for r in got} == {"dev"}


def test_bad_dev_sources_are_refused(tmp_path):
    for cls in (TasksConfig, SweTasksConfig):
        with pytest.raises(ValueError, match="tasks.dev_source is tasks.heldout_source"):
            cls(heldout_source="/x/tasks.jsonl", dev_source="/x/tasks.jsonl")
        with pytest.raises(ValueError, match="tasks.dev_source is tasks.train_source"):
            cls(train_source="/x/tasks.jsonl", dev_source="/x/tasks.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cfg = _config(config_lib.env_config(), dev_source=str(empty))
    with pytest.raises(ConfigError, match="holds no tasks"):
        task_data.dev_tasks(cfg, 2, seed=0)


def test_the_command_accepts_a_file_only_plugin_with_a_dev_file(tmp_path):
    """The start-up check of `python -m tg_jax.main` that refuses a periodic evaluation without
    dev tasks (tests/test_plugins.py) passes with the user's dev file; the data stage then
    builds the train and held-out sets from the user's other files."""
    files = {}
    for split in ("train", "heldout", "dev"):
        recs = [{"task_id": f"{split}-{i}", "word": "river"} for i in range(4)]
        files[split] = _write_jsonl(tmp_path / f"{split}.jsonl", recs)
    work = tmp_path / "w"
    proc = _main(f"--workdir={work}", "--config.stage=data", "--config.rl_loop.eval_every=1",
                 f"--config.env.kind={EX}:FileOnlyEnv",
                 f"--config.env.requirements=('{EX}:short_turns',)",
                 *(f"--config.tasks.{s}_source={p}" for s, p in files.items()))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (work / "tfds").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("problem", ["missing", "empty", "malformed"])
def test_the_command_refuses_a_bad_dev_file_at_start_up(tmp_path, problem):
    """A dev file the run could not read fails before any stage runs (one error line, exit 2,
    nothing written), not when the base model's gates or the first periodic evaluation read
    it."""
    dev = tmp_path / "dev.jsonl"
    if problem != "missing":
        dev.write_text("" if problem == "empty" else '{"task_id": "d0", "family": \n')
    work = tmp_path / "w"
    proc = _main(f"--workdir={work}", "--config.stage=data", f"--config.tasks.dev_source={dev}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: invalid config: ") and "dev.jsonl" in line, line
    assert not work.exists() or not any(work.iterdir())
