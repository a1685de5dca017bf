"""Builds a training run from a Config: data, sampler, model, optimizer, schedule, engine, loop."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from checkpointing.comm import control_group
from checkpointing.manager import CheckpointManager
from core.callbacks import TrainerCallback
from core.checkpoint import RunCheckpointer, trajectory
from core.config import Config, ConfigError
from core.data import build_dataset, collate, dataset_fingerprint, sample_lengths
from core.engines.ddp import DDPEngine
from core.loop import DistInfo, Trainer, plan_steps
from core.metrics import JsonlMetrics, Progress
from core.models import build_model
from core.optim import build_optimizer
from core.sampler import ResumableDistributedSampler
from core.schedules import build_schedule
from core.seeding import enable_full_determinism, set_seed
from core.state import TrainState

logger = logging.getLogger(__name__)


def build_trainer(
    config: Config,
    dist_info: DistInfo,
    device: torch.device,
    callbacks: list[TrainerCallback] | None = None,
    stop_requested: Callable[[], bool] | None = None,
) -> Trainer:
    """Everything a run needs, built in a fixed order so that seeding decides all of it."""
    if config.run.full_determinism:
        enable_full_determinism(config.run.seed)
    else:
        set_seed(config.run.seed)

    dataset = build_dataset(config.data)
    lengths = sample_lengths(dataset)
    try:
        sampler = ResumableDistributedSampler(
            num_samples=len(dataset),
            num_replicas=dist_info.world_size,
            rank=dist_info.rank,
            batch_size=config.train.per_device_batch_size,
            seed=config.run.seed,
            drop_last=config.data.drop_last,
            lengths=lengths if config.data.group_by_length else None,
        )
        _, total_steps = plan_steps(config, sampler)
    except ValueError as e:
        raise ConfigError(f"train.per_device_batch_size: {e}") from e

    model = build_model(config.model).to(device)
    optimizer = build_optimizer(model, config.optim, device)
    sc = config.scheduler
    try:
        schedule = build_schedule(
            optimizer, sc.name, total_steps, sc.warmup_steps, sc.warmup_ratio, sc.kwargs
        )
    except ValueError as e:
        raise ConfigError(f"scheduler.kwargs: {e}") from e
    engine = DDPEngine(
        model,
        optimizer,
        schedule,
        device,
        bf16=config.train.bf16,
        find_unused_parameters=config.engine.find_unused_parameters,
    )
    n_params = sum(p.numel() for p in model.parameters())
    if dist_info.is_main:
        logger.info(
            "model %s: %.2fM parameters; %d samples, %d steps on %d rank(s), device %s",
            config.model.name,
            n_params / 1e6,
            len(dataset),
            total_steps,
            dist_info.world_size,
            device,
        )
    state = TrainState()
    manager = CheckpointManager(
        config.run.output_dir,
        dist_info.rank,
        dist_info.world_size,
        save_total_limit=config.checkpoint.save_total_limit,
        engine=config.engine.name,
        group=control_group(),
    )
    checkpointer = RunCheckpointer(
        config,
        manager,
        engine,
        sampler,
        state,
        trajectory(config, dist_info.world_size, dataset_fingerprint(dataset), total_steps),
    )
    reporters: list[TrainerCallback] = []
    if dist_info.is_main:
        reporters = [
            JsonlMetrics(config.run.output_dir),
            Progress(total_steps, config.train.progress_bar),
        ]
    return Trainer(
        config,
        engine,
        dataset,
        sampler,
        collate,
        lengths,
        dist_info,
        callbacks=[*reporters, *(callbacks or [])],
        state=state,
        checkpointer=checkpointer,
        stop_requested=stop_requested,
    )
