"""The default engine: plain torch DistributedDataParallel (or the bare model on one process).

Why not accelerate: `Accelerator.prepare` replaces our DataLoader and sampler (its resume skips
batches by iterating them) and keeps its own RNG synchronisation, both of which break the exact
resume guarantee; what remains (device placement, autocast, no_sync) is a few lines of torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from checkpointing.balanced import Balanced
from checkpointing.stateful import DirectoryState, Stateful
from core.engines.base import Engine
from core.engines.named_state import OptimizerState
from core.engines.registry import EngineInputs
from core.models import call_model
from core.schedules import Schedule


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move a tensor, or a mapping/sequence of them, to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: move_to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(v, device) for v in batch)
    return batch


class DDPEngine(Engine):
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        schedule: Schedule,
        device: torch.device,
        bf16: bool = False,
        find_unused_parameters: bool = False,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] = call_model,
    ) -> None:
        self.device = device
        self.optimizer = optimizer
        self.schedule = schedule
        self._model = model
        self._bf16 = bf16
        self._loss_fn = loss_fn
        self._distributed = dist.is_initialized() and dist.get_world_size() > 1
        if self._distributed:
            ids = [device.index] if device.type == "cuda" else None
            self._wrapped: nn.Module = DistributedDataParallel(
                model, device_ids=ids, find_unused_parameters=find_unused_parameters
            )
        else:
            self._wrapped = model
        self._params = [p for p in model.parameters() if p.requires_grad]

    @property
    def model(self) -> nn.Module:
        return self._model

    def stateful(self) -> dict[str, Stateful | DirectoryState]:
        # Every rank holds the whole state: each writes its share (checkpointing.balanced).
        rank, world = (dist.get_rank(), dist.get_world_size()) if self._distributed else (0, 1)
        return {
            "model": Balanced(self.model, rank, world),
            "optimizer": Balanced(OptimizerState(self.model, self.optimizer), rank, world),
            "scheduler": self.schedule,
        }

    def train(self, mode: bool = True) -> None:
        self._wrapped.train(mode)

    def accumulate(self, sync: bool) -> AbstractContextManager[Any]:
        if self._distributed and not sync:
            return self._wrapped.no_sync()  # type: ignore[operator]
        return contextlib.nullcontext()

    def forward(self, batch: Any) -> torch.Tensor:
        batch = move_to_device(batch, self.device)
        if self._bf16 or torch.is_autocast_enabled(self.device.type):
            # A disabled autocast also switches off one the caller entered: fp32 stays fp32.
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self._bf16):
                return self._loss_fn(self._wrapped, batch)
        # fp32 with no autocast around: entering a disabled one would change nothing, and
        # cost host time on every micro-batch.
        return self._loss_fn(self._wrapped, batch)

    def backward(self, loss: torch.Tensor, num_micro_batches: int) -> None:
        (loss / num_micro_batches if num_micro_batches > 1 else loss).backward()

    def optimizer_step(self, max_grad_norm: float) -> torch.Tensor | None:
        norm = None
        if max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(self._params, max_grad_norm)
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm


def build(inputs: EngineInputs) -> DDPEngine:
    """The registry's builder (core/engines/__init__.py)."""
    config = inputs.config
    optimizer = inputs.make_optimizer(inputs.model)
    return DDPEngine(
        inputs.model,
        optimizer,
        inputs.make_schedule(optimizer),
        inputs.device,
        bf16=config.train.bf16,
        find_unused_parameters=config.engine.find_unused_parameters,
        loss_fn=inputs.loss_fn,
    )
