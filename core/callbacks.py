"""Callbacks in the spirit of the Hugging Face TrainerCallback / TrainerControl.

Each event receives the config, the TrainState and the TrainerControl; a callback requests
actions by setting flags on the control (`should_training_stop`, `should_save`, `should_log`).
The loop resets `should_save` and `should_log` after acting on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.config import Config
from core.state import TrainState


@dataclass
class TrainerControl:
    should_training_stop: bool = False
    should_save: bool = False
    should_log: bool = False


class TrainerCallback:
    """Override any subset of these events; all are no-ops by default."""

    def on_train_begin(self, config: Config, state: TrainState, control: TrainerControl) -> None:
        pass

    def on_step_end(self, config: Config, state: TrainState, control: TrainerControl) -> None:
        pass

    def on_log(
        self, config: Config, state: TrainState, control: TrainerControl, logs: dict[str, Any]
    ) -> None:
        pass

    def on_save(
        self, config: Config, state: TrainState, control: TrainerControl, path: str
    ) -> None:
        pass

    def on_train_end(self, config: Config, state: TrainState, control: TrainerControl) -> None:
        pass


class CallbackHandler:
    """Calls every callback's event in order and hands back the shared control."""

    def __init__(self, callbacks: list[TrainerCallback]) -> None:
        self.callbacks = list(callbacks)

    def fire(
        self, event: str, config: Config, state: TrainState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        for cb in self.callbacks:
            getattr(cb, event)(config, state, control, **kwargs)
        return control
