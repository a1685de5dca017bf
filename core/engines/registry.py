"""Engines by name. Each engine is one module with one builder; one `register_engine` line makes
it a value of `engine.name`, and its declarations here are all the config and the elastic
resume rules know of it.

    register_engine("ddp", "core.engines.ddp:build", state_by_name=True)

A builder takes `EngineInputs` and returns a `core.engines.base.Engine`. Builders given as
"module:function" are imported on first use, so naming the engines costs no import (the config
checks `engine.name` against them before torch is touched by anything else).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from checkpointing.manifest import Manifest
    from core.config import Config
    from core.engines.base import Engine
    from core.schedules import Schedule


@dataclass(frozen=True)
class EngineInputs:
    """What an engine builder gets: the config, the model on its device, and how to make the
    optimizer and schedule (the user's, or the config's) once the engine has wrapped the model."""

    config: Config
    model: nn.Module
    device: torch.device
    world_size: int
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    """An optimizer over the given module's parameters (the wrapped or sharded ones)."""
    make_schedule: Callable[[torch.optim.Optimizer], Schedule]
    ready_optimizer: torch.optim.Optimizer | None = None
    """An optimizer the user built (over the unwrapped parameters), if any."""
    custom_optimizer: bool = False
    """The user chose the optimizer (a ready one, or a class and kwargs)."""


Builder = Callable[[EngineInputs], "Engine"]
ReshardCheck = Callable[["Config", "Manifest", str], None]


@dataclass(frozen=True)
class EngineSpec:
    name: str
    builder: Builder | str
    state_by_name: bool = False
    """Checkpoints hold complete model and optimizer state keyed by parameter name: every such
    engine resumes the others' checkpoints, on any number of ranks."""
    reshard_check: ReshardCheck | str | None = None
    """Called before resuming a checkpoint of this engine on another number of ranks: raises
    CheckpointError with the reason when its state cannot be resharded."""

    def build(self, inputs: EngineInputs) -> Engine:
        return _resolve(self.builder)(inputs)

    def check_reshard(self, config: Config, saved: Manifest, where: str) -> None:
        if self.reshard_check is not None:
            _resolve(self.reshard_check)(config, saved, where)


_ENGINES: dict[str, EngineSpec] = {}


def register_engine(
    name: str,
    builder: Builder | str,
    *,
    state_by_name: bool = False,
    reshard_check: ReshardCheck | str | None = None,
) -> None:
    """Make `name` a value of engine.name, built by `builder` ("module:function" or a callable).
    Registering a name again replaces it."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"engine name {name!r}: use letters, digits, - and _")
    _ENGINES[name] = EngineSpec(name, builder, state_by_name, reshard_check)


def unregister_engine(name: str) -> None:
    """Forget `name` (a test's engine, say); unknown names are ignored."""
    _ENGINES.pop(name, None)


def engine_names() -> tuple[str, ...]:
    """The registered engine names, in registration order."""
    return tuple(_ENGINES)


def engine_spec(name: str) -> EngineSpec:
    if name not in _ENGINES:
        raise KeyError(f"no engine {name!r}; registered: {', '.join(_ENGINES)}")
    return _ENGINES[name]


def crosses(saved: str, now: str) -> bool:
    """Whether a checkpoint of engine `saved` resumes under another engine `now`: both keep
    their state by name."""
    if saved == now or saved not in _ENGINES or now not in _ENGINES:
        return False
    return _ENGINES[saved].state_by_name and _ENGINES[now].state_by_name


def _resolve(target: Callable[..., Any] | str) -> Callable[..., Any]:
    if callable(target):
        return target
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)
