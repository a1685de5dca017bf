"""The engine interface: the only way the loop touches distributed strategy code.

An engine owns the (possibly wrapped) model, the optimizer and the schedule. The loop calls,
per optimizer step of n micro-batches:

    for i in range(n):
        with engine.accumulate(sync=(i == n - 1)):
            loss = engine.forward(batch)
            engine.backward(loss, n)
    grad_norm = engine.optimizer_step(max_grad_norm)

so gradient synchronisation, loss scaling, clipping and stepping stay engine decisions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from checkpointing.stateful import DirectoryState, Stateful
from core.engines.named_state import OptimizerState
from core.schedules import Schedule


class Engine(ABC):
    """Base class of the distributed engines (DDP, FSDP, DeepSpeed)."""

    device: torch.device
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    gathers_in_forward: bool = False
    """Whether the model's forward is a collective (sharded parameters are gathered): every
    rank must then call it equally often, in evaluation too."""

    @property
    @abstractmethod
    def model(self) -> nn.Module:
        """The unwrapped model (what a checkpoint saves and a user exports)."""

    @abstractmethod
    def train(self, mode: bool = True) -> None:
        """Put the model in training (or eval) mode."""

    @abstractmethod
    def accumulate(self, sync: bool) -> AbstractContextManager[Any]:
        """Context for one micro-batch; gradients are synchronised only when `sync` is true."""

    @abstractmethod
    def forward(self, batch: Any) -> torch.Tensor:
        """Move `batch` to the device, run the model (autocast if enabled), return the loss."""

    @abstractmethod
    def backward(self, loss: torch.Tensor, num_micro_batches: int) -> None:
        """Backpropagate `loss` as one of `num_micro_batches` averaged micro-batches."""

    @abstractmethod
    def optimizer_step(self, max_grad_norm: float) -> torch.Tensor | None:
        """Clip (when max_grad_norm > 0), step optimizer and schedule, zero the gradients.
        Returns the pre-clip global gradient norm as a device tensor, or None without clipping."""

    def stateful(self) -> dict[str, Stateful | DirectoryState]:
        """What a checkpoint of this engine holds (names are the checkpoint's entries)."""
        return {
            "model": self.model,
            "optimizer": OptimizerState(self.model, self.optimizer),
            "scheduler": self.schedule,
        }

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer, unsharded, on the CPU (a collective for engines that
        shard; every rank gets the whole dict)."""
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
