"""DataLoaders whose randomness comes only from (seed, epoch, rank, worker id).

torch's DataLoader draws each iterator's base seed from the global torch RNG unless it is given
a generator, so an epoch started at a different moment (a resume) would shift both the workers'
seeds and the training RNG stream. We pass a generator of our own and seed workers explicitly.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from core.data.collate import block_batch, collate
from core.data.sampler import BijectiveSampler, ResumableDistributedSampler
from core.data.store_reader import TokenStore
from core.data.stream import StreamPosition


def derive_seed(*parts: int) -> int:
    """A 63-bit seed derived from integers, stable across processes and Python versions."""
    state = np.random.SeedSequence([int(p) for p in parts]).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31 | int(state[1]) >> 1) & ((1 << 63) - 1)


class WorkerSeeder:
    """worker_init_fn: seeds random, NumPy and torch in a worker from (seed, epoch, rank, id).

    A class rather than a closure so that it pickles into spawned worker processes.
    """

    def __init__(self, seed: int, epoch: int, rank: int) -> None:
        self.seed, self.epoch, self.rank = seed, epoch, rank

    def __call__(self, worker_id: int) -> None:
        s = derive_seed(self.seed, self.epoch, self.rank, worker_id)
        random.seed(s)
        np.random.seed(s % 2**32)
        torch.manual_seed(s)


def make_dataloader(
    dataset: Dataset[Any],
    sampler: ResumableDistributedSampler | StreamPosition,
    collate_fn: Callable[[list[Any]], Any],
    num_workers: int,
    drop_last: bool,
    seed: int,
    rank: int,
    pin_memory: bool = False,
    drawn: deque[int] | None = None,
) -> DataLoader[Any]:
    """A DataLoader for the sampler's current epoch, starting at its current position.
    `drawn`, if given, receives every sample id as the DataLoader takes it from the sampler
    (in order: batches come out in the order their ids went in)."""
    generator = torch.Generator()
    generator.manual_seed(derive_seed(seed, sampler.epoch, rank))
    store = _whole_store(dataset)
    if (
        store is not None
        and isinstance(sampler, BijectiveSampler)
        and num_workers == 0
        and collate_fn is collate
    ):
        return StoreBatches(store[0], store[1], sampler, drop_last, pin_memory, drawn)  # type: ignore[return-value]
    if isinstance(sampler, StreamPosition):
        # One reader per rank: workers would each replay the stream.
        return DataLoader(
            sampler.shard(dataset),
            batch_size=sampler.batch_size,
            collate_fn=collate_fn,
            drop_last=drop_last,
            pin_memory=pin_memory,
            generator=generator,
        )
    return DataLoader(
        dataset,
        batch_size=sampler.batch_size,
        sampler=sampler if drawn is None else _Recorded(sampler, drawn),
        collate_fn=collate_fn,
        num_workers=num_workers,
        drop_last=drop_last,
        pin_memory=pin_memory,
        generator=generator,
        worker_init_fn=WorkerSeeder(seed, sampler.epoch, rank) if num_workers > 0 else None,
        persistent_workers=False,
    )


class _Recorded:
    """The sampler, noting each id it hands out."""

    def __init__(self, sampler: ResumableDistributedSampler, drawn: deque[int]) -> None:
        self.sampler, self.drawn = sampler, drawn

    def __iter__(self) -> Iterator[int]:
        for i in self.sampler:
            self.drawn.append(i)
            yield i

    def __len__(self) -> int:
        return len(self.sampler)


def _whole_store(dataset: Any) -> tuple[TokenStore, int] | None:
    """(store, offset of sample 0) when `dataset` is a token store or a contiguous range of one
    (the training part of an eval holdout split)."""
    if isinstance(dataset, TokenStore):
        return dataset, 0
    inner = getattr(dataset, "dataset", None)
    indices = getattr(dataset, "indices", None)
    if isinstance(inner, TokenStore) and isinstance(indices, range) and indices.step == 1:
        return inner, indices.start
    return None


class StoreBatches:
    """Batches of a token store without a DataLoader (no worker processes): the sampler's ids
    come as arrays, each batch is one read of the memory map (or verified byte ranges) and one
    widening copy, the batch `collate` would build ({"input_ids", "labels"}, int64). A
    DataLoader costs ~30 us and a Python int per sample per batch; with data.num_workers > 0 the
    DataLoader is used (reading then runs in the workers)."""

    def __init__(
        self,
        store: TokenStore,
        offset: int,
        sampler: BijectiveSampler,
        drop_last: bool,
        pin_memory: bool,
        drawn: deque[int] | None,
    ) -> None:
        self.store, self.offset, self.sampler = store, offset, sampler
        self.drop_last, self.pin_memory, self.drawn = drop_last, pin_memory, drawn

    def __len__(self) -> int:
        return self.sampler.batches_per_epoch(self.drop_last)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        b = self.sampler.batch_size
        pending = np.zeros(0, dtype=np.int64)
        for ids in self.sampler.rank_chunks():
            pending = np.concatenate([pending, ids]) if len(pending) else ids
            full = len(pending) // b * b
            for start in range(0, full, b):
                yield self._batch(pending[start : start + b])
            pending = pending[full:]
        if len(pending) and not self.drop_last:
            yield self._batch(pending)

    def _batch(self, ids: np.ndarray) -> dict[str, torch.Tensor]:
        if self.drawn is not None:
            self.drawn.extend(ids.tolist())
        rows = self.store.read_sampled(ids + self.offset if self.offset else ids)
        return block_batch(rows, self.pin_memory)
