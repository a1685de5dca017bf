"""Resuming on another number of ranks: the global batch a checkpoint ran at, and the config
that keeps it on this world size (or a refusal that says why it cannot).

Elastic rules: see docs/elastic.md.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from checkpointing.manifest import CheckpointError, Manifest
from core.config import Config
from core.engines.registry import crosses, engine_spec

logger = logging.getLogger(__name__)


def saved_global_batch(saved: dict[str, Any]) -> int | None:
    """The global batch (samples per optimizer step) a saved trajectory ran at; derived for
    checkpoints written before it was recorded."""
    if "train.global_batch" in saved:
        return saved["train.global_batch"]
    per_rank = saved.get("train.samples_per_step")
    if per_rank is None and "train.per_device_batch_size" in saved:
        per_rank = saved["train.per_device_batch_size"] * saved["train.gradient_accumulation_steps"]
    return None if per_rank is None else per_rank * saved["world_size"]


def fit_world_size(config: Config, saved: Manifest | None, world_size: int) -> Config:
    """The config that resumes `saved` on `world_size` ranks.

    With train.keep_global_batch, gradient accumulation is set so that world size x per-device
    batch x accumulation equals the checkpoint's global batch, and a change is logged: on
    another number of ranks, and on the same number after such a resume (the checkpoint then
    ran at another accumulation than the config says). A resume that cannot keep it, or state
    that cannot be resharded, is refused with the numbers (CheckpointError)."""
    if saved is None:
        return config
    tc, old = config.train, saved.world_size
    elastic = old != world_size
    where = (
        f"resuming a checkpoint of {old} rank(s) on {world_size}"
        if elastic
        else f"resuming checkpoint-{saved.step}"
    )
    if elastic:
        if saved.engine != config.engine.name and not crosses(saved.engine, config.engine.name):
            raise CheckpointError(
                f"{where}: saved by engine {saved.engine}, this run uses {config.engine.name}"
            )
        engine_spec(saved.engine).check_reshard(config, saved, where)
        if str(saved.trajectory.get("dataset", "")).startswith("stream:"):
            raise CheckpointError(
                f"{where}: an iterable dataset is dealt to ranks by their number, so its "
                f"position means nothing on {world_size}; relaunch on {old}"
            )
    target = saved_global_batch(saved.trajectory)
    b, a = tc.per_device_batch_size, tc.gradient_accumulation_steps
    if target is None or world_size * b * a == target:
        if target is not None and elastic:
            logger.warning(
                "%s: the global batch stays %d (%d x %d x %d accumulation)",
                where,
                target,
                world_size,
                b,
                a,
            )
        return config
    if not tc.keep_global_batch:
        if not elastic:
            return config  # the trajectory check names what changed
        raise CheckpointError(
            f"{where}: the global batch would change from {target} to {world_size * b * a} "
            f"({world_size} ranks x {b} per device x {a} accumulation) with "
            "train.keep_global_batch false; set it true, or choose the accumulation yourself"
        )
    if not elastic and saved.trajectory.get("train.per_device_batch_size", b) != b:
        return config  # another micro-batch on the same ranks: the trajectory check refuses
    if target % world_size:
        raise CheckpointError(
            f"{where}: cannot keep the global batch of {target} samples: it is not a multiple "
            f"of {world_size} ranks; relaunch on a number of ranks that divides {target}"
        )
    if target % (world_size * b):
        raise CheckpointError(
            f"{where}: cannot keep the global batch of {target} samples: it is not a multiple "
            f"of {world_size} ranks x {b} per device; set train.per_device_batch_size to a "
            f"divisor of {target // world_size}"
        )
    accumulation = target // (world_size * b)
    logger.warning(
        "%s: gradient_accumulation_steps %d -> %d keeps the global batch at %d (%d x %d x %d)%s",
        where,
        a,
        accumulation,
        target,
        world_size,
        b,
        accumulation,
        f"; losses continue within float rounding of the run on {old}, not bit for bit"
        if elastic
        else "",
    )
    train = dataclasses.replace(tc, gradient_accumulation_steps=accumulation)
    return dataclasses.replace(config, train=train)
