"""Callbacks in the spirit of the Hugging Face TrainerCallback / TrainerControl.

Each event receives the config, the TrainState and the TrainerControl; a callback requests
actions by setting flags on the control. The loop acts on a flag, then clears it: per-step
flags with `reset_step()`, `should_epoch_stop` with `reset_epoch()`.

A callback that is also Stateful (`state_dict()` / `load_state_dict()`, JSON-compatible values)
is checkpointed through `CallbackHandler.stateful()`, so a resumed run continues its counters.
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass
from typing import Any

from checkpointing.stateful import Stateful
from core.config import Config, metric_greater_is_better
from core.state import TrainState

logger = logging.getLogger(__name__)


@dataclass
class TrainerControl:
    should_training_stop: bool = False
    """Stop after the current step (every rank agrees before acting)."""
    should_epoch_stop: bool = False
    """End the current epoch after the current step."""
    should_save: bool = False
    """Checkpoint after the current step."""
    should_evaluate: bool = False
    """Evaluate after the current step."""
    should_log: bool = False
    """Log after the current step."""

    def reset_step(self) -> None:
        """Clear the per-step requests (save, evaluate, log), once the loop has acted on them."""
        self.should_save = self.should_evaluate = self.should_log = False

    def reset_epoch(self) -> None:
        self.should_epoch_stop = False

    def reset_training(self) -> None:
        self.should_training_stop = False


class TrainerCallback:
    """Override any subset of these events; all are no-ops by default.

    Events are called with keywords only beyond (config, state, control); an override may
    name just the keywords it uses, plus `**kwargs` to accept what later versions may add.
    """

    def on_init_end(
        self, config: Config, state: TrainState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The trainer is built (before any resume)."""

    def on_train_begin(
        self, config: Config, state: TrainState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Training starts, after a resume has restored the state."""

    def on_train_end(
        self, config: Config, state: TrainState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Training ended (steps done or stopped), after the final checkpoint."""

    def on_epoch_begin(
        self, config: Config, state: TrainState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """An epoch starts (or resumes mid-way)."""

    def on_epoch_end(
        self, config: Config, state: TrainState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """An epoch ended (its last optimizer step is done)."""

    def on_step_begin(
        self, config: Config, state: TrainState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """An optimizer step starts, before its first micro-batch."""

    def on_substep_end(
        self, config: Config, state: TrainState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """A micro-batch's backward is done, for every micro-batch of a step but the last."""

    def on_pre_optimizer_step(
        self, config: Config, state: TrainState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Gradients are complete (all micro-batches), before clipping and optimizer.step (the
        engine clips, steps and zeroes in one call)."""

    def on_optimizer_step(
        self, config: Config, state: TrainState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """optimizer.step and the schedule's step are done (the gradients are already zeroed)."""

    def on_step_end(
        self, config: Config, state: TrainState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """An optimizer step is done and `state.global_step` counts it."""

    def on_evaluate(
        self,
        config: Config,
        state: TrainState,
        control: TrainerControl,
        metrics: dict[str, float],
        **kwargs: Any,
    ) -> None:
        """An evaluation finished; `metrics` are identical on every rank."""

    def on_save(
        self, config: Config, state: TrainState, control: TrainerControl, path: str, **kwargs: Any
    ) -> None:
        """A checkpoint was committed at `path`; `seconds` (keyword) is the save's wall time."""

    def on_log(
        self,
        config: Config,
        state: TrainState,
        control: TrainerControl,
        logs: dict[str, Any],
        **kwargs: Any,
    ) -> None:
        """A metrics record was made (rank-agreed values)."""

    def on_prediction_step(
        self, config: Config, state: TrainState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """One evaluation batch was run."""


EVENTS: tuple[str, ...] = tuple(name for name in vars(TrainerCallback) if name.startswith("on_"))
"""Every event name `CallbackHandler.fire` accepts, in declaration order."""


def _overrides(callback: TrainerCallback, event: str) -> bool:
    """Whether `callback` may do something on `event` (the base class's events are no-ops)."""
    if event in getattr(callback, "__dict__", ()):  # set on the instance
        return True
    return getattr(type(callback), event) is not getattr(TrainerCallback, event)


class CallbackHandler:
    """Calls every callback's event in order and hands back the shared control.

    Only callbacks that override an event are called for it: the loop fires several events per
    optimizer step, and calling the no-op base methods was host time on every step. Which
    events each callback overrides is looked up again whenever the list changed (add, pop,
    remove, or `callbacks` edited in place), not on every fire.
    """

    def __init__(self, callbacks: list[TrainerCallback]) -> None:
        self.callbacks: list[TrainerCallback] = []
        self._listeners: dict[str, list[TrainerCallback]] = {}
        self._listed: list[TrainerCallback] | None = None  # the list _listeners was built from
        for cb in callbacks:
            self.add(cb)

    def fire(
        self, event: str, config: Config, state: TrainState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        listed, now = self._listed, self.callbacks
        # By identity: a callback that compares equal to another (a dataclass) is not the same.
        if listed is None or len(listed) != len(now) or not all(map(operator.is_, listed, now)):
            self._index()
        listeners = self._listeners.get(event)
        if listeners is None:
            # A typo must fail loudly, not silently skip every callback.
            raise ValueError(f"unknown callback event {event!r}; known: {', '.join(EVENTS)}")
        for cb in listeners:
            getattr(cb, event)(config, state, control, **kwargs)
        return control

    def _index(self) -> None:
        self._listeners = {e: [cb for cb in self.callbacks if _overrides(cb, e)] for e in EVENTS}
        self._listed = list(self.callbacks)

    # -- the list, as in Hugging Face's CallbackHandler ----------------------------------------
    def add(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """Append a callback (a class is instantiated with no arguments)."""
        cb = callback() if isinstance(callback, type) else callback
        if not isinstance(cb, TrainerCallback):
            raise TypeError(f"a callback must be a TrainerCallback, got {type(cb).__name__}")
        if any(type(other) is type(cb) for other in self.callbacks):
            logger.warning("adding a second %s to the callbacks", type(cb).__name__)
        self.callbacks.append(cb)

    def pop(self, callback: TrainerCallback | type[TrainerCallback]) -> TrainerCallback | None:
        """Remove and return the first callback of that class (or that very object); None if
        there is none."""
        for i, cb in enumerate(self.callbacks):
            if (type(cb) is callback) if isinstance(callback, type) else (cb is callback):
                return self.callbacks.pop(i)
        return None

    def remove(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """Remove the first callback of that class (or that very object); an error if absent."""
        if self.pop(callback) is None:
            name = callback.__name__ if isinstance(callback, type) else type(callback).__name__
            raise ValueError(f"no {name} among the callbacks")

    # -- checkpointed state --------------------------------------------------------------------
    def stateful(self) -> dict[str, Stateful]:
        """Entries for the checkpoint mapping: `callback.<ClassName>` -> the callback, for every
        Stateful callback, in list order. The n-th (n >= 1) further callback of the same class
        name is `callback.<ClassName>.<n>`. Their state is JSON-compatible and global."""
        entries: dict[str, Stateful] = {}
        seen: dict[str, int] = {}
        for cb in self.callbacks:
            if not isinstance(cb, Stateful):
                continue
            cls = type(cb).__name__
            n = seen.get(cls, 0)
            seen[cls] = n + 1
            entries[f"callback.{cls}" if n == 0 else f"callback.{cls}.{n}"] = cb
        return entries


class EarlyStoppingCallback(TrainerCallback):
    """Stops training after `patience` evaluations in a row without improvement.

    An evaluation improves when `metrics[metric]` beats the best so far by more than
    `threshold`. `metric` defaults to `checkpoint.best_metric`, else `eval_loss`;
    `greater_is_better` to `checkpoint.greater_is_better`, else false for names ending in
    `loss`. Stateful, so a resumed run keeps the best value and the count.
    """

    def __init__(
        self,
        patience: int = 1,
        threshold: float = 0.0,
        metric: str | None = None,
        greater_is_better: bool | None = None,
    ) -> None:
        if patience < 1:
            raise ValueError(f"EarlyStoppingCallback patience must be >= 1, got {patience}")
        if not threshold >= 0:
            raise ValueError(f"EarlyStoppingCallback threshold must be >= 0, got {threshold}")
        self.patience = patience
        self.threshold = threshold
        self.metric = metric
        self.greater_is_better = greater_is_better
        self.best: float | None = None
        self.bad_evaluations = 0

    def resolve(self, config: Config) -> tuple[str, bool]:
        """(metric name, greater is better) after applying the config's defaults."""
        metric = self.metric or config.checkpoint.best_metric or "eval_loss"
        explicit = self.greater_is_better
        if explicit is None:
            explicit = config.checkpoint.greater_is_better
        return metric, metric_greater_is_better(metric, explicit)

    def on_evaluate(
        self,
        config: Config,
        state: TrainState,
        control: TrainerControl,
        metrics: dict[str, float],
        **kwargs: Any,
    ) -> None:
        metric, greater = self.resolve(config)
        if metric not in metrics:
            raise ValueError(
                f"early stopping metric {metric!r} is not among the evaluation metrics "
                f"({', '.join(sorted(metrics)) or 'none'}); set checkpoint.best_metric"
            )
        value = float(metrics[metric])
        if self._improves(value, greater):
            self.best, self.bad_evaluations = value, 0
        else:
            self.bad_evaluations += 1
        if self.bad_evaluations >= self.patience:
            logger.info(
                "early stopping at step %d: %s did not improve on %s for %d evaluations",
                state.global_step,
                metric,
                self.best,
                self.bad_evaluations,
            )
            control.should_training_stop = True

    def _improves(self, value: float, greater: bool) -> bool:
        # A non-finite value never becomes the best: it is no progress, and keeps the state JSON.
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        gain = value - self.best if greater else self.best - value
        return gain > self.threshold

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_evaluations": self.bad_evaluations}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        best = state_dict["best"]
        self.best = None if best is None else float(best)
        self.bad_evaluations = int(state_dict["bad_evaluations"])
