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

from core.data.sampler import ResumableDistributedSampler
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
