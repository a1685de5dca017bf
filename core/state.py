"""TrainState: the loop's own counters (Stateful, global: identical on every rank)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainState:
    global_step: int = 0
    """Optimizer steps completed."""
    epoch: int = 0
    """Current epoch (0-based)."""
    samples_seen: int = 0
    """Samples consumed by all ranks together."""
    tokens_seen: int = 0
    """Tokens (non-padding) consumed by all ranks together."""
    log_history: list[dict[str, Any]] = field(default_factory=list)
    """Every logged metrics record, in order."""
    per_device_batch_size: int | None = None
    """The micro-batch this run trains with (auto_find_batch_size may have lowered it)."""
    gradient_accumulation_steps: int | None = None
    """The accumulation that goes with it."""

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, state[f.name])
