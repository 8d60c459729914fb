"""Grain pipelines over task sources: shard, shuffle, repeat, decode, group; resumable.

The RL loop pulls one group of tasks per step (``group_size`` tasks; each is then rolled out
several times for GRPO)::

    sources = tfds_builders.prepare_task_dataset(workdir / "tfds", config_name=..., generate=...)
    tasks = TaskIterator(sources["train"], group_size=32, seed=config.seed,
                         decode_fn=Task.from_record)
    if restored is not None:
        tasks.set_state(restored.metadata["data"])
    for step in ...:
        group = next(tasks)          # list of 32 tasks
        ...
        ckpt.save(step + 1, state, metadata={"data": tasks.get_state(), ...})

Order: this host's shard (a contiguous slice, ``grain.sharding.ShardByJaxProcess`` by default),
shuffled with ``seed`` (a new permutation each epoch), repeated ``num_epochs`` times (None:
forever), decoded, cut into groups; a group may span an epoch boundary. The whole order is a
pure function of (source length, seed, shard, group size), so the iterator state is just the
next group index: ``get_state()`` is a small JSON dict, and ``set_state`` refuses a state made
with different settings rather than silently continuing with another sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain

from tg_jax.data.tfds_builders import decode_example


def shard_bounds(num_records: int, shard: grain.sharding.ShardOptions) -> tuple[int, int]:
    """[start, end) of ``shard``'s contiguous slice; the first ``num % count`` shards get one
    more record unless ``shard.drop_remainder`` (then all shards are equal)."""
    per_shard, remainder = divmod(num_records, shard.shard_count)
    if shard.drop_remainder:
        start = per_shard * shard.shard_index
        return start, start + per_shard
    start = per_shard * shard.shard_index + min(shard.shard_index, remainder)
    return start, start + per_shard + (1 if shard.shard_index < remainder else 0)


def _default_shard(shard: grain.sharding.ShardOptions | None) -> grain.sharding.ShardOptions:
    # Equal shards so every host runs the same number of groups per epoch.
    return shard if shard is not None else grain.sharding.ShardByJaxProcess(drop_remainder=True)


def to_record(element: Any) -> Any:
    """A stored example (``{"task_id", "record": JSON bytes}``) as its record dict; other
    elements (e.g. an in-memory list of record dicts) pass through."""
    if (
        isinstance(element, Mapping)
        and set(element) == {"task_id", "record"}
        and isinstance(element["record"], bytes | str)
    ):
        return decode_example(element)
    return element


def task_dataset(
    source: Sequence[Any],
    *,
    seed: int,
    shuffle: bool = True,
    num_epochs: int | None = None,
    shard: grain.sharding.ShardOptions | None = None,
    decode_fn: Callable[[dict], Any] | None = None,
) -> grain.MapDataset:
    """Ungrouped task stream: shard -> shuffle -> repeat -> decode.

    Args:
      source: random-access records (a TFDS data source, or a list of record dicts).
      seed: shuffle seed (each epoch is shuffled differently, deterministically).
      shuffle: False keeps the source order (e.g. evaluation).
      num_epochs: passes over the shard; None repeats forever.
      shard: which part this host reads; default ``ShardByJaxProcess(drop_remainder=True)`` so
        every host has the same number of tasks per epoch.
      decode_fn: applied to each record dict (e.g. ``Task.from_record``).
    """
    shard = _default_shard(shard)
    start, end = shard_bounds(len(source), shard)
    if end <= start:
        raise ValueError(
            f"shard {shard.shard_index}/{shard.shard_count} of {len(source)} tasks is empty"
        )
    ds = grain.MapDataset.source(source)[start:end]
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs)
    ds = ds.map(to_record)
    if decode_fn is not None:
        ds = ds.map(decode_fn)
    return ds


class TaskIterator:
    """Iterates groups (lists) of tasks; ``get_state``/``set_state`` are JSON dicts."""

    def __init__(
        self,
        source: Sequence[Any],
        *,
        group_size: int,
        seed: int,
        shuffle: bool = True,
        num_epochs: int | None = None,
        shard: grain.sharding.ShardOptions | None = None,
        decode_fn: Callable[[dict], Any] | None = None,
        drop_remainder: bool = True,
        read_options: grain.ReadOptions | None = None,
    ):
        """Args: as ``task_dataset``, plus
        group_size: tasks per group (per host).
        drop_remainder: drop a last short group (finite epochs only).
        read_options: grain reading threads; default reads inline (records are tiny and the
          decode is cheap, so threads would only compete with the trainer for CPU).
        """
        shard = (
            shard if shard is not None else grain.sharding.ShardByJaxProcess(drop_remainder=True)
        )
        start, end = shard_bounds(len(source), shard)
        self.shard_size = end - start
        self.group_size = group_size
        ds = task_dataset(
            source,
            seed=seed,
            shuffle=shuffle,
            num_epochs=num_epochs,
            shard=shard,
            decode_fn=decode_fn,
        )
        ds = ds.batch(group_size, drop_remainder=drop_remainder, batch_fn=list)
        self._dataset = ds.to_iter_dataset(
            read_options or grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        )
        self._iterator = iter(self._dataset)
        # Everything that determines the sequence; a state is only valid for the same values.
        self._settings = {
            "num_records": len(source),
            "seed": seed,
            "shuffle": shuffle,
            "num_epochs": num_epochs,
            "shard_index": shard.shard_index,
            "shard_count": shard.shard_count,
            "shard_drop_remainder": shard.drop_remainder,
            "group_size": group_size,
            "drop_remainder": drop_remainder,
        }

    def __iter__(self) -> TaskIterator:
        return self

    def __next__(self) -> list[Any]:
        return next(self._iterator)

    @property
    def groups_per_epoch(self) -> float:
        """Groups in one pass over this host's shard (fractional if they span epochs)."""
        return self.shard_size / self.group_size

    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable position: ``{"next_index": int, "settings": {...}}``."""
        return {
            "next_index": int(self._iterator.get_state()["next_index"]),
            "settings": dict(self._settings),
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continues from ``state`` (from ``get_state``); ValueError if settings differ."""
        saved = state.get("settings", {})
        for key, value in self._settings.items():
            if key in saved and saved[key] != value:
                raise ValueError(
                    f"task iterator state was saved with {key}={saved[key]!r} but this "
                    f"iterator has {key}={value!r}; resuming would give a different sequence"
                )
        self._iterator.set_state({"next_index": int(state["next_index"])})
