"""Building a run, the sampler stage: the resumable sampler over the training data (a seeded
shuffle of a map-style dataset, a Feistel bijection over a token store's blocks, or a position
in a stream) and the number of optimizer steps it gives."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from core.config import Config, ConfigError
from core.data.from_store import store_of
from core.data.sampler import BijectiveSampler, ResumableDistributedSampler
from core.data.stream import StreamPosition, is_stream
from core.dist_info import DistInfo

Sampler = ResumableDistributedSampler | StreamPosition


def build_sampler(
    config: Config, dataset: Any, lengths: np.ndarray | None, dist_info: DistInfo
) -> tuple[Sampler, tuple[int, int]]:
    """(this rank's sampler, (optimizer steps per epoch, total optimizer steps)); max_steps
    wins over num_epochs. A stream's epoch is endless: its run is max_steps long."""
    tc = config.train
    sampler = _sampler(config, dataset, lengths, dist_info)
    per_epoch = math.ceil(
        sampler.batches_per_epoch(config.data.drop_last) / tc.gradient_accumulation_steps
    )
    if per_epoch == 0:
        raise ConfigError(
            "train.per_device_batch_size: an epoch holds no batch; lower "
            "train.per_device_batch_size"
        )
    return sampler, (per_epoch, tc.max_steps or (tc.num_epochs or 0) * per_epoch)


def _sampler(
    config: Config, dataset: Any, lengths: np.ndarray | None, dist_info: DistInfo
) -> Sampler:
    tc = config.train
    if is_stream(dataset):
        for ok, key, why in (
            (tc.max_steps is not None, "train.max_steps", "an iterable dataset has no length"),
            (config.data.num_workers == 0, "data.num_workers", "must be 0 for an iterable dataset"),
            (not config.data.group_by_length, "data.group_by_length", "needs a map-style dataset"),
        ):
            if not ok:
                raise ConfigError(f"{key}: {why}")
        return StreamPosition(
            dist_info.world_size,
            dist_info.rank,
            tc.per_device_batch_size,
            config.run.seed,
            tc.gradient_accumulation_steps,
        )
    try:
        cls = BijectiveSampler if store_of(dataset) is not None else ResumableDistributedSampler
        return cls(
            num_samples=len(dataset),
            num_replicas=dist_info.world_size,
            rank=dist_info.rank,
            batch_size=tc.per_device_batch_size,
            seed=config.run.seed,
            drop_last=config.data.drop_last,
            lengths=lengths if config.data.group_by_length else None,
            accumulation=tc.gradient_accumulation_steps,
        )
    except ValueError as e:
        raise ConfigError(f"train.per_device_batch_size: {e}") from e
