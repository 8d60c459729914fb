"""Tests for tg_jax.checkpointing: round trips, keep-N, sharded restore, errors, preemption."""

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from tg_jax import checkpointing
from tg_jax.checkpointing import CheckpointError, TrainingCheckpointer, restore_checkpoint


def _state(seed: int = 0):
    params = {
        "w": jnp.arange(32, dtype=jnp.float32).reshape(8, 4) + seed,
        "b": jnp.full((4,), seed, jnp.bfloat16),
    }
    opt = optax.adam(1e-3)
    opt_state = opt.init(params)
    # One real update so the optimizer moments are not all zeros.
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt_state = opt.update(grads, opt_state, params)
    return {
        "params": params,
        "opt_state": opt_state,
        "step": jnp.int32(seed),
        "rng": jax.random.key(seed),
    }


def _abstract(state):
    return jax.eval_shape(lambda: state)


def _assert_state_equal(a, b):
    a = dict(a)
    b = dict(b)
    key_a, key_b = a.pop("rng"), b.pop("rng")
    np.testing.assert_array_equal(jax.random.key_data(key_a), jax.random.key_data(key_b))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert jax.tree.structure(a) == jax.tree.structure(b)


@pytest.mark.slow
def test_round_trip_state_and_metadata(tmp_path):
    state = _state(3)
    meta = {"data": {"next_index": 17}, "policy_version": 5, "extra": {"note": "x", "xs": [1, 2]}}
    with TrainingCheckpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.restore_latest(_abstract(state)) is None
        assert ckpt.save(3, state, metadata=meta)
        ckpt.wait_until_finished()
        restored = ckpt.restore_latest(_abstract(state))
    assert restored.step == 3
    assert restored.metadata == meta
    _assert_state_equal(restored.state, state)
    assert jax.dtypes.issubdtype(restored.state["rng"].dtype, jax.dtypes.prng_key)
    # The optimizer state keeps its optax types.
    assert type(restored.state["opt_state"][0]) is type(state["opt_state"][0])
    # A fresh process-like reopen sees the same checkpoint.
    again = restore_checkpoint(tmp_path / "ckpt", _abstract(state))
    assert again.step == 3 and again.metadata == meta


def test_keep_n_and_interval(tmp_path):
    state = _state()
    with TrainingCheckpointer(tmp_path, max_to_keep=2, save_interval_steps=2) as ckpt:
        saved = [s for s in range(1, 8) if ckpt.save(s, state, metadata={"s": s})]
        ckpt.wait_until_finished()
        assert saved == [2, 4, 6]
        assert ckpt.all_steps() == [4, 6]
        assert ckpt.save(7, state, force=True)
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [6, 7]
        assert ckpt.restore(_abstract(state), step=6).metadata == {"s": 6}
        with pytest.raises(CheckpointError, match=r"no checkpoint step 2 in .*steps: \[6, 7\]"):
            ckpt.restore(_abstract(state), step=2)
    assert sorted(os.listdir(tmp_path)) == ["6", "7"]


def test_restore_onto_sharded_target(tmp_path):
    state = _state(1)
    with TrainingCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    row = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=row if x.ndim == 2 else rep),
        _abstract(state),
    )
    restored = restore_checkpoint(tmp_path, abstract)
    w = restored.state["params"]["w"]
    assert w.sharding == row
    assert len(w.addressable_shards) == 8 and w.addressable_shards[0].data.shape == (1, 4)
    assert restored.state["opt_state"][0].mu["w"].sharding == row
    assert restored.state["params"]["b"].sharding == rep
    _assert_state_equal(restored.state, state)


def test_missing_directory_is_clear(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointError, match=f"checkpoint directory {missing} does not exist"):
        restore_checkpoint(missing, _abstract(_state()))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=f"no complete checkpoint in {empty}"):
        restore_checkpoint(empty, _abstract(_state()))


def test_step_directory_as_source(tmp_path):
    with TrainingCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, _state(1), metadata={"v": 1})
        ckpt.save(2, _state(2), metadata={"v": 2})
    assert restore_checkpoint(tmp_path / "1", _abstract(_state())).metadata == {"v": 1}


def test_corrupt_checkpoint_is_clear(tmp_path):
    with TrainingCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, _state())
    state_dir = tmp_path / "1" / "state"
    for root, _, files in os.walk(state_dir):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"\x00garbage")
    with pytest.raises(CheckpointError, match=rf"checkpoint {tmp_path}/1 is unreadable"):
        restore_checkpoint(tmp_path, _abstract(_state()))


def test_truncated_array_data_is_clear(tmp_path):
    with TrainingCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, _state())
    # Keep the metadata intact and truncate only the array payload files.
    data_files = [
        os.path.join(root, name)
        for root, _, files in os.walk(tmp_path / "1" / "state")
        for name in files
        if os.sep + "d" + os.sep in os.path.join(root, name)
    ]
    assert data_files
    for path in data_files:
        with open(path, "r+b") as f:
            f.truncate(3)
    with pytest.raises(CheckpointError, match=rf"checkpoint {tmp_path}/1 is unreadable"):
        restore_checkpoint(tmp_path, _abstract(_state()))


def test_shape_dtype_structure_mismatch_is_clear(tmp_path):
    state = _state()
    with TrainingCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
    step_dir = f"{tmp_path}/1"

    bad_shape = _abstract(state)
    bad_shape["params"]["w"] = jax.ShapeDtypeStruct((8, 5), jnp.float32)
    with pytest.raises(CheckpointError) as e:
        restore_checkpoint(tmp_path, bad_shape)
    msg = str(e.value)
    assert step_dir in msg and "'params/w'" in msg and "(8, 4)" in msg and "(8, 5)" in msg

    bad_dtype = _abstract(state)
    bad_dtype["params"]["b"] = jax.ShapeDtypeStruct((4,), jnp.float32)
    with pytest.raises(CheckpointError, match=r"'params/b'.*dtype bfloat16.*dtype float32"):
        restore_checkpoint(tmp_path, bad_dtype)

    extra = _abstract(state)
    extra["params"]["new"] = jax.ShapeDtypeStruct((2,), jnp.float32)
    with pytest.raises(CheckpointError, match=r"'params/new' is in the target but not in the"):
        restore_checkpoint(tmp_path, extra)

    missing = _abstract(state)
    del missing["rng"]
    with pytest.raises(CheckpointError, match=r"'rng' is in the checkpoint but not in the target"):
        restore_checkpoint(tmp_path, missing)


@pytest.mark.parametrize("async_save", [False, True])
def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch, async_save):
    good = _state(1)
    ckpt = TrainingCheckpointer(tmp_path, async_save=async_save)
    ckpt.save(1, good, metadata={"v": 1})
    ckpt.wait_until_finished()

    # Fail the metadata write (in orbax's writer thread when async), while the arrays are being
    # written: the step must never be committed.
    async def boom(self, *args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "_save_fn", boom)
    with pytest.raises(CheckpointError) as e:
        ckpt.save(2, _state(2), metadata={"v": 2})
        ckpt.wait_until_finished()
    msg = str(e.value)
    assert str(tmp_path) in msg and "latest complete step: 1" in msg, msg
    if not async_save:
        # Synchronous: the error is exactly the simulated failure.
        assert "disk full (simulated)" in msg, msg
    # Async: orbax's own cleanup of the half-written step can race the simulated failure and
    # report instead (e.g. a temporary directory that is not empty); the invariants below hold
    # either way.
    monkeypatch.undo()

    assert ckpt.all_steps() == [1]
    restored = ckpt.restore_latest(_abstract(good))
    assert restored.step == 1 and restored.metadata == {"v": 1}
    _assert_state_equal(restored.state, good)
    ckpt.close()

    # A restarted run cleans the half-written step and can save it again.
    with TrainingCheckpointer(tmp_path, async_save=async_save) as ckpt:
        assert ckpt.all_steps() == [1]
        ckpt.save(2, _state(2), metadata={"v": 2})
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [1, 2]
        restored = ckpt.restore_latest(_abstract(good))
        assert restored.step == 2 and restored.metadata == {"v": 2}
        _assert_state_equal(restored.state, _state(2))
    # Nothing half-written is left once a manager has been reopened.
    with TrainingCheckpointer(tmp_path, async_save=async_save):
        assert sorted(os.listdir(tmp_path)) == ["1", "2"]


def test_bad_metadata_fails_before_io(tmp_path):
    with TrainingCheckpointer(tmp_path) as ckpt:
        with pytest.raises(CheckpointError, match=r"metadata for step 1 in .* not JSON"):
            ckpt.save(1, _state(), metadata={"x": object()})
        assert ckpt.all_steps() == []


def test_sigterm_sets_flag_and_loop_saves(tmp_path):
    checkpointing.clear_preemption_request()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert checkpointing.install_sigterm_handler()
        assert checkpointing.sigterm_handler_installed()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # code replaced it: installs again
        assert not checkpointing.sigterm_handler_installed()
        assert checkpointing.install_sigterm_handler()
        assert checkpointing.sigterm_handler_installed()
        state, abstract = _state(), _abstract(_state())
        with TrainingCheckpointer(tmp_path, save_interval_steps=100) as ckpt:
            last = None
            for step in range(1, 50):
                if step == 5:
                    os.kill(os.getpid(), signal.SIGTERM)
                preempted = checkpointing.preemption_requested(step)
                if preempted or ckpt.should_save(step):
                    ckpt.save(step, state, metadata={"step": step}, force=True)
                if preempted:
                    last = step
                    break
        assert last == 5
        assert restore_checkpoint(tmp_path, abstract).metadata == {"step": 5}
    finally:
        signal.signal(signal.SIGTERM, previous)
        checkpointing.clear_preemption_request()
    assert not checkpointing.preemption_requested(1)


def test_preempted_exits_with_status_143_and_says_how_to_resume(tmp_path):
    err = checkpointing.Preempted("SFT", str(tmp_path))
    assert isinstance(err, SystemExit) and err.code == checkpointing.PREEMPTED_EXIT_CODE == 143
    assert "preempted during SFT" in str(err) and "Rerun the same command" in str(err)
    assert str(tmp_path) in str(err)
    with pytest.raises(SystemExit) as info:
        raise err
    assert info.value.code == 143


def test_a_corrupt_latest_checkpoint_falls_back_to_the_one_before(tmp_path, caplog):
    good = _state(1)
    with TrainingCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, good, metadata={"v": 1})
        ckpt.save(2, _state(2), metadata={"v": 2})
    for root, _, files in os.walk(tmp_path / "2" / "state"):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"\x00garbage")
    with TrainingCheckpointer(tmp_path) as ckpt, caplog.at_level("WARNING"):
        restored = ckpt.restore_latest(_abstract(good))
    assert restored.step == 1 and restored.metadata == {"v": 1}
    _assert_state_equal(restored.state, good)
    assert f"checkpoint {tmp_path}/2 is unreadable" in caplog.text
    assert f"kept as {tmp_path}/2.corrupt, falling back" in caplog.text
    # Set aside, not deleted: step 2 can be written again by the resumed run.
    assert (tmp_path / "2.corrupt" / "state").is_dir() and not (tmp_path / "2").exists()
    with TrainingCheckpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == [1]
        ckpt.save(2, _state(2), metadata={"v": 2}, force=True)
    # Every step unreadable: the newest one's error, not a silent fresh start, and the last
    # one is left where it is.
    for step in ("1", "2"):
        for root, _, files in os.walk(tmp_path / step / "state"):
            for name in files:
                with open(os.path.join(root, name), "wb") as f:
                    f.write(b"\x00garbage")
    with TrainingCheckpointer(tmp_path) as ckpt:
        with pytest.raises(CheckpointError, match=rf"checkpoint {tmp_path}/2 is unreadable"):
            ckpt.restore_latest(_abstract(good))
        assert ckpt.all_steps() == [1]
    assert (tmp_path / "1" / "state").is_dir()
