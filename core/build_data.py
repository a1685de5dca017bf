"""Building a run, the data stage: the training and evaluation datasets, the resumable sampler
and the number of steps, from the config (and a Python API user's datasets)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
from torch.utils.data import Subset

from core.build_sampler import build_sampler
from core.config import Config, ConfigError
from core.data import (
    HFTokenizer,
    build_dataset,
    dataset_fingerprint,
    sample_lengths,
)
from core.data.from_store import check_store, open_training_store, store_lengths, store_of
from core.data.ranks import check_same_data, main_process_first
from core.data.sampler import ResumableDistributedSampler
from core.data.stream import StreamPosition, is_stream
from core.dist_info import DistInfo


@dataclass
class DataParts:
    dataset: Any
    eval_dataset: Any
    sampler: ResumableDistributedSampler | StreamPosition
    lengths: np.ndarray | None
    """Per-sample token counts (None: unknown)."""
    fingerprint: str
    """The training data's content fingerprint (part of the trajectory)."""
    steps: tuple[int, int]
    """(optimizer steps per epoch, total optimizer steps)."""

    @property
    def streamed(self) -> bool:
        """Whether the training data is a stream (an iterable dataset: no length)."""
        return isinstance(self.sampler, StreamPosition)


def build_data(
    config: Config,
    tokenizer: HFTokenizer | None,
    dist_info: DistInfo,
    train_dataset: Any = None,
    eval_dataset: Any = None,
) -> DataParts:
    """The data of a run; rank 0 of each node builds (and caches) first, the others then."""
    quiet = not dist_info.is_main

    def build() -> tuple[Any, Any]:
        data = train_dataset
        if data is None and config.data.store_url is not None:
            data = open_training_store(config.data, tokenizer)
        elif data is None:
            data = build_dataset(config.data, tokenizer, quiet)
        return _eval_split(config, data, eval_dataset, tokenizer, quiet)

    dataset, evaluation = main_process_first(build, dist_info.rank, dist_info.local_rank)
    store = store_of(dataset)
    if store is not None and train_dataset is None:
        check_store(config.data, store, dist_info.rank, dist_info.world_size)
    lengths, fingerprint = _dataset_facts(dataset)
    check_same_data(fingerprint, dist_info.rank)
    sampler, steps = build_sampler(config, dataset, lengths, dist_info)
    return DataParts(dataset, evaluation, sampler, lengths, fingerprint, steps)


def _dataset_facts(dataset: Any) -> tuple[np.ndarray | None, str]:
    """(per-sample token counts or None, content fingerprint) of a training dataset."""
    if is_stream(dataset):
        # A stream cannot be hashed without reading it all; its type stands in.
        return None, f"stream:{type(dataset).__qualname__}"
    store = store_of(dataset)
    if store is not None:  # fixed-length blocks: no array of N lengths
        return store_lengths(dataset), f"{store.fingerprint}:{len(dataset)}"
    if isinstance(dataset, datasets.Dataset) and "input_ids" in dataset.column_names:
        return np.asarray(sample_lengths(dataset)), dataset_fingerprint(dataset)
    if isinstance(dataset, datasets.Dataset):
        return None, dataset_fingerprint(dataset)
    # A torch map-style dataset has no content hash; its type and size stand in for one.
    return None, f"{type(dataset).__qualname__}:{len(dataset)}"


def _eval_split(
    config: Config, dataset: Any, eval_dataset: Any, tokenizer: HFTokenizer | None, quiet: bool
) -> tuple[Any, Any]:
    """(training data, evaluation data or None) as the eval section asks."""
    if eval_dataset is not None and is_stream(eval_dataset):
        # Exactly-once distributed evaluation shards by sample index.
        raise ConfigError(
            "eval_dataset: needs a map-style dataset (datasets.Dataset or a torch "
            "Dataset with __getitem__), not an iterable one"
        )
    if eval_dataset is not None or config.eval.strategy == "no":
        return dataset, eval_dataset
    if config.eval.source != "holdout":
        source = dataclasses.replace(config.data, source=config.eval.source)
        return dataset, build_dataset(source, tokenizer, quiet)
    if is_stream(dataset):
        raise ConfigError(
            "eval.source: holdout needs a map-style training dataset; pass "
            "eval_dataset or set eval.source to a file"
        )
    n, held = len(dataset), config.eval.holdout_samples
    if held >= n:
        raise ConfigError(f"eval.holdout_samples: {held} leaves no training data of {n} samples")
    if isinstance(dataset, datasets.Dataset):
        return dataset.select(range(n - held)), dataset.select(range(n - held, n))
    return Subset(dataset, range(n - held)), Subset(dataset, range(n - held, n))
