"""Iterable (streaming) datasets: a position in the stream in place of the resumable sampler.

An iterable has no random access, so a resume reaches its position by reading and discarding
the items before it (O(position), unlike the map-style sampler's O(1) jump); everything after
is exact. Items are taken in groups of world-size: rank r takes item r of each complete group,
so every rank sees the same number of items and no collective waits on a rank that ran dry.
When the stream ends, the epoch ends (a partial optimizer step is discarded) and the next epoch
iterates it again (after `set_epoch(epoch)` where the dataset has one, as HF's does).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import datasets
from torch.utils.data import IterableDataset

# Stands in for "unknown" wherever the loop asks how long an epoch is.
ENDLESS = 2**62


def is_stream(dataset: Any) -> bool:
    return isinstance(dataset, (IterableDataset, datasets.IterableDataset)) or not hasattr(
        dataset, "__getitem__"
    )


class _Shard(IterableDataset):
    def __init__(self, source: Iterable[Any], skip: int, rank: int, world: int) -> None:
        self.source, self.skip, self.rank, self.world = source, skip, rank, world

    def __iter__(self) -> Iterator[Any]:
        items = itertools.islice(iter(self.source), self.skip, None)
        while len(group := list(itertools.islice(items, self.world))) == self.world:
            yield group[self.rank]


class StreamPosition:
    """The sampler interface the loop uses, for an iterable dataset (Stateful)."""

    def __init__(
        self, num_replicas: int, rank: int, batch_size: int, seed: int, accumulation: int = 1
    ) -> None:
        self.num_replicas, self.rank, self.batch_size, self.seed = (
            num_replicas,
            rank,
            batch_size,
            seed,
        )
        self.global_batch = batch_size * num_replicas * accumulation
        """Items of one optimizer step, all ranks together."""
        self.epoch = 0
        self.position = 0
        self.total_size = ENDLESS
        self.lengths = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position = epoch, 0

    def advance(self, num_global_samples: int) -> None:
        self.position += num_global_samples

    def batches_per_epoch(self, drop_last_batch: bool) -> int:
        return ENDLESS

    def epoch_order(self) -> range:
        return range(ENDLESS)  # item ids are stream positions

    def upcoming(self, count: int) -> list[int]:
        return list(range(self.position, self.position + count))

    def __len__(self) -> int:
        return ENDLESS - self.position

    def shard(self, dataset: Any) -> _Shard:
        """This rank's items from the current position of the current epoch."""
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(self.epoch)
        return _Shard(dataset, self.position, self.rank, self.num_replicas)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "stream", "epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "stream":
            raise ValueError("the checkpoint's sampler is for a map-style dataset, not a stream")
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]
