"""Building a run, the engine stage: the engine config.engine.name names, from the registry
(core/engines/registry.py), with the optimizer and schedule it steps (the config's, or a Python
API user's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from core.config import Config, ConfigError
from core.dist_info import DistInfo
from core.engines.base import Engine
from core.engines.registry import EngineInputs, engine_spec
from core.optim import build_optimizer, parameter_groups
from core.schedules import Schedule, build_schedule

if TYPE_CHECKING:
    from core.run import UserParts


def build_engine(
    config: Config,
    model: nn.Module,
    parts: UserParts,
    device: torch.device,
    total_steps: int,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    dist_info: DistInfo,
) -> Engine:
    """The engine config.engine.name names, from the registry (core/engines/registry.py)."""

    def make_optimizer(module: nn.Module) -> torch.optim.Optimizer:
        if parts.optimizer is not None:
            return parts.optimizer
        if parts.optimizer_cls_and_kwargs is not None:
            cls, kwargs = parts.optimizer_cls_and_kwargs
            return cls(parameter_groups(module, config.optim.weight_decay), **kwargs)
        return build_optimizer(module, config.optim, device)

    def make_schedule(optimizer: torch.optim.Optimizer) -> Schedule:
        if parts.lr_scheduler is not None:
            return Schedule(parts.lr_scheduler)
        sc = config.scheduler
        try:
            return build_schedule(
                optimizer, sc.name, total_steps, sc.warmup_steps, sc.warmup_ratio, sc.kwargs
            )
        except ValueError as e:
            raise ConfigError(f"scheduler.kwargs: {e}") from e

    inputs = EngineInputs(
        config,
        model,
        device,
        dist_info.world_size,
        loss_fn,
        make_optimizer,
        make_schedule,
        ready_optimizer=parts.optimizer,
        custom_optimizer=parts.optimizer is not None or parts.optimizer_cls_and_kwargs is not None,
    )
    return engine_spec(config.engine.name).build(inputs)
