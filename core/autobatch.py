"""`train.auto_find_batch_size`: on out-of-memory in the first steps, halve the per-device batch
and double gradient accumulation (the global batch stays the same), then retry from the start.

Like the Hugging Face Trainer's find_executable_batch_size, but the size found is recorded in
TrainState, so a resumed run starts at that size instead of searching again.
"""

from __future__ import annotations

import dataclasses
import gc
import logging

import torch

from checkpointing.manifest import Manifest
from checkpointing.serialize import load_state
from checkpointing.storage import Storage
from core.config import Config

logger = logging.getLogger(__name__)

# An OOM after this many optimizer steps of an attempt is not a batch-size search any more.
SEARCH_STEPS = 3


def is_oom(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or a CPU allocator failure."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


def with_batch(config: Config, per_device: int, accumulation: int) -> Config:
    train = dataclasses.replace(
        config.train, per_device_batch_size=per_device, gradient_accumulation_steps=accumulation
    )
    return dataclasses.replace(config, train=train)


def at_recorded_batch(config: Config, found: tuple[Storage, Manifest]) -> Config:
    """auto_find_batch_size resumes at the micro-batch the search settled on, not searching
    again (checkpoints written before it was recorded keep the configured one)."""
    state = load_state(found[0], "train_state", found[1].files)
    if state.get("per_device_batch_size") is None:
        return config
    return with_batch(config, state["per_device_batch_size"], state["gradient_accumulation_steps"])


def halved(config: Config) -> Config:
    """The next size to try: the batch divided by its smallest factor (2 when even) and the
    accumulation multiplied by it, so their product stays. Raises when the batch is 1."""
    b, a = config.train.per_device_batch_size, config.train.gradient_accumulation_steps
    if b == 1:
        raise RuntimeError("auto_find_batch_size: out of memory even at per_device_batch_size 1")
    factor = next(f for f in range(2, b + 1) if b % f == 0)
    logger.warning(
        "out of memory at per_device_batch_size %d: retrying with %d x %d accumulation",
        b,
        b // factor,
        a * factor,
    )
    return with_batch(config, b // factor, a * factor)


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
