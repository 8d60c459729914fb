"""Tests for tg_jax.data: TFDS task builders (no TensorFlow), JSONL import, grain pipelines."""

import json
import sys

import grain
import pytest

from tg_jax.data import pipeline, tfds_builders
from tg_jax.data.pipeline import TaskIterator
from tg_jax.data.tfds_builders import TaskRecordError


def _generate(split):
    n = 12 if split == "train" else 4
    for i in range(n):
        yield {"task_id": f"{split}/{i}", "x": i, "examples": [[i, 2 * i]]}


def _validate(record):
    if not isinstance(record.get("x"), int):
        raise ValueError("field 'x' must be an int")
    return record


def _validate_number(record):
    # Lets NaN through validation so the JSON check after it is exercised.
    if not isinstance(record.get("x"), int | float):
        raise ValueError("field 'x' must be an int")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("tfds")
    return tfds_builders.prepare_task_dataset(
        data_dir, config_name="toy", generate=_generate, validate_fn=_validate
    ), data_dir


def test_tfds_builder_round_trip_without_tensorflow(sources):
    src, data_dir = sources
    assert set(src) == {"train", "heldout"}
    assert len(src["train"]) == 12 and len(src["heldout"]) == 4
    example = src["heldout"][2]
    assert example["task_id"] == b"heldout/2"
    # Generation order is kept and records round-trip exactly.
    assert [tfds_builders.decode_example(src["train"][i]) for i in range(12)] == list(
        _generate("train")
    )
    assert "tensorflow" not in sys.modules
    assert (data_dir / "task_dataset" / "toy" / "1.0.0" / "dataset_info.json").exists()
    # Reading a prepared dataset needs no generator.
    again = tfds_builders.prepare(tfds_builders.TaskDataset(data_dir=data_dir, config_name="toy"))
    assert len(again["train"]) == 12


def test_unprepared_without_generator_is_clear(tmp_path):
    with pytest.raises(ValueError, match="not prepared .* no generate function"):
        tfds_builders.prepare(tfds_builders.TaskDataset(data_dir=tmp_path, config_name="none"))


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"task_id": "t/1", "x": "one"}, r"split 'train' record 1: invalid task record: field 'x'"),
        ({"x": 1}, r"split 'train' record 1: task record needs a non-empty string 'task_id'"),
        ({"task_id": "t/0", "x": 1}, r"split 'train' record 1: duplicate task_id 't/0'"),
        ({"task_id": "t/1", "x": float("nan")}, r"record 1: .*not JSON-serialisable"),
    ],
)
def test_generated_bad_record_is_clear(tmp_path, bad, message):
    def generate(split):
        yield {"task_id": "t/0", "x": 0}
        yield bad

    with pytest.raises(TaskRecordError, match=message):
        tfds_builders.prepare_task_dataset(
            tmp_path,
            config_name="bad",
            generate=generate,
            validate_fn=_validate_number,
        )


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_jsonl_import(tmp_path):
    a = _write(tmp_path / "a.jsonl", [json.dumps({"task_id": "a", "x": 1}), ""])
    b = _write(tmp_path / "b.jsonl", [json.dumps({"task_id": "b", "x": 2})])
    h = _write(tmp_path / "h.jsonl", [json.dumps({"task_id": "h", "x": 3})])
    src = tfds_builders.prepare_jsonl_task_dataset(
        tmp_path / "tfds",
        config_name="user_v1",
        files={"train": [a, b], "heldout": str(h)},
        validate_fn=_validate,
    )
    assert [tfds_builders.decode_example(src["train"][i])["task_id"] for i in range(2)] == [
        "a",
        "b",
    ]
    assert tfds_builders.decode_example(src["heldout"][0]) == {"task_id": "h", "x": 3}


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"task_id": "c", "x": ', r"invalid JSON"),
        ("[1, 2]", r"task record must be a JSON object, got list"),
        ('{"task_id": "c", "x": "three"}', r"invalid task record: field 'x' must be an int"),
        ('{"task_id": "a", "x": 3}', r"duplicate task_id 'a' \(first on line 1\)"),
    ],
)
def test_jsonl_bad_line_names_file_and_line(tmp_path, bad_line, message):
    lines = [json.dumps({"task_id": "a", "x": 1}), "", json.dumps({"task_id": "b", "x": 2})]
    path = _write(tmp_path / "tasks.jsonl", [*lines, bad_line])
    with pytest.raises(TaskRecordError, match=rf"^{path}:4: {message}"):
        tfds_builders.read_jsonl_tasks(path, _validate)
    with pytest.raises(TaskRecordError, match=rf"^{path}:4: {message}"):
        tfds_builders.prepare_jsonl_task_dataset(
            tmp_path / "tfds", config_name="bad", files={"train": path}, validate_fn=_validate
        )


def test_jsonl_duplicate_across_files(tmp_path):
    a = _write(tmp_path / "a.jsonl", [json.dumps({"task_id": "a", "x": 1})])
    b = _write(tmp_path / "b.jsonl", ["", json.dumps({"task_id": "a", "x": 2})])
    with pytest.raises(TaskRecordError, match=rf"{b}:2: duplicate task_id 'a'"):
        tfds_builders.prepare_jsonl_task_dataset(
            tmp_path / "tfds", config_name="dup", files={"train": [a, b]}
        )


RECORDS = [{"task_id": f"t{i}", "x": i} for i in range(10)]
NO_SHARD = grain.sharding.NoSharding()


def _ids(groups):
    return [[r["task_id"] for r in g] for g in groups]


def test_shuffle_is_deterministic_and_epochs_are_permutations():
    def take(seed, n):
        it = TaskIterator(RECORDS, group_size=5, seed=seed, shard=NO_SHARD)
        return _ids(next(it) for _ in range(n))

    first = take(0, 4)
    assert first == take(0, 4)
    assert first != take(1, 4)
    epoch1, epoch2 = sum(first[:2], []), sum(first[2:], [])
    assert sorted(epoch1) == sorted(epoch2) == sorted(r["task_id"] for r in RECORDS)
    assert epoch1 != epoch2 and epoch1 != [r["task_id"] for r in RECORDS]


def test_resume_mid_epoch_continues_exactly():
    def make():
        return TaskIterator(RECORDS, group_size=3, seed=7, shard=NO_SHARD, decode_fn=dict)

    full = make()
    reference = _ids(next(full) for _ in range(9))

    run = make()
    _ = [next(run) for _ in range(2)]  # 6 of 10 tasks: mid-epoch
    state = json.loads(json.dumps(run.get_state()))
    assert state["next_index"] == 2

    resumed = make()
    resumed.set_state(state)
    assert _ids(next(resumed) for _ in range(7)) == reference[2:]


def test_set_state_with_other_settings_is_refused():
    state = TaskIterator(RECORDS, group_size=3, seed=7, shard=NO_SHARD).get_state()
    other = TaskIterator(RECORDS, group_size=3, seed=8, shard=NO_SHARD)
    with pytest.raises(ValueError, match="saved with seed=7 but this iterator has seed=8"):
        other.set_state(state)


def test_two_shards_are_disjoint_and_cover():
    seen = []
    for index in range(2):
        shard = grain.sharding.ShardOptions(shard_index=index, shard_count=2)
        it = TaskIterator(RECORDS, group_size=5, seed=3, shard=shard, num_epochs=1)
        groups = _ids(it)
        assert len(groups) == 1
        seen.append(set(groups[0]))
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == {r["task_id"] for r in RECORDS}


def test_uneven_shards():
    bounds = [
        pipeline.shard_bounds(10, grain.sharding.ShardOptions(i, 3, drop_remainder=drop))
        for drop in (False, True)
        for i in range(3)
    ]
    assert bounds == [(0, 4), (4, 7), (7, 10), (0, 3), (3, 6), (6, 9)]
    with pytest.raises(ValueError, match="shard 15/20 of 10 tasks is empty"):
        TaskIterator(RECORDS, group_size=1, seed=0, shard=grain.sharding.ShardOptions(15, 20))


def test_finite_epochs_and_remainder():
    it = TaskIterator(RECORDS, group_size=4, seed=0, shard=NO_SHARD, num_epochs=2)
    assert [len(g) for g in it] == [4, 4, 4, 4, 4]
    it = TaskIterator(
        RECORDS, group_size=4, seed=0, shard=NO_SHARD, num_epochs=1, drop_remainder=False
    )
    assert [len(g) for g in it] == [4, 4, 2]
    plain = TaskIterator(RECORDS, group_size=10, seed=0, shard=NO_SHARD, shuffle=False)
    assert _ids([next(plain)]) == [[r["task_id"] for r in RECORDS]]


def test_pipeline_over_tfds_source_with_decode_fn(sources):
    src, _ = sources
    it = TaskIterator(src["train"], group_size=4, seed=0, decode_fn=_validate)
    groups = [next(it) for _ in range(3)]
    assert sorted(r["task_id"] for g in groups for r in g) == sorted(
        r["task_id"] for r in _generate("train")
    )
    assert it.groups_per_epoch == 3.0
    resumed = TaskIterator(src["train"], group_size=4, seed=0, decode_fn=_validate)
    resumed.set_state(it.get_state())
    assert next(resumed) == next(it)
