"""Learning-rate schedules: the eight Hugging Face `SchedulerType`s behind one small adapter.

The maths matches transformers' `optimization.py`. Every LambdaLR multiplier is a module-level
dataclass (never a lambda or closure): `LambdaLR.state_dict()` then stores its `__dict__`, which
holds only plain numbers, so scheduler state pickles, round-trips and can be written as JSON.
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau

logger = logging.getLogger(__name__)


@dataclass
class Warmup:
    """Linear warmup 0 -> 1 over `warmup_steps`, then `after_warmup(step)`; the shared base."""

    warmup_steps: int

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return float(step) / float(max(1, self.warmup_steps))
        return self.after_warmup(step)

    def after_warmup(self, step: int) -> float:
        raise NotImplementedError

    def _progress(self, step: int, total_steps: int) -> float:
        """Fraction of the post-warmup phase done (may exceed 1 past the end)."""
        decay_steps = float(max(1, total_steps - self.warmup_steps))
        return float(step - self.warmup_steps) / decay_steps


@dataclass
class ConstantWithWarmup(Warmup):
    """Warmup, then 1; with warmup_steps=0 it is transformers' plain constant schedule."""

    def after_warmup(self, step: int) -> float:
        return 1.0


@dataclass
class LinearWarmupDecay(Warmup):
    """Warmup, then linear decay to 0 at `total_steps` (0 afterwards)."""

    total_steps: int

    def after_warmup(self, step: int) -> float:
        remaining = float(self.total_steps - step)
        return max(0.0, remaining / float(max(1, self.total_steps - self.warmup_steps)))


@dataclass
class CosineWarmupDecay(Warmup):
    """Warmup, then `num_cycles` cosine waves (0.5: one half-cosine from 1 down to 0)."""

    total_steps: int
    num_cycles: float

    def after_warmup(self, step: int) -> float:
        progress = self._progress(step, self.total_steps)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(self.num_cycles) * 2.0 * progress)))


@dataclass
class CosineHardRestarts(Warmup):
    """Warmup, then `num_cycles` half-cosines from 1 to 0, each restarting at 1; 0 past the end."""

    total_steps: int
    num_cycles: float

    def after_warmup(self, step: int) -> float:
        progress = self._progress(step, self.total_steps)
        if progress >= 1.0:
            return 0.0
        cycle_progress = (float(self.num_cycles) * progress) % 1.0
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * cycle_progress)))


@dataclass
class PolynomialWarmupDecay(Warmup):
    """Warmup, then lr = (lr_init - lr_end) * (1 - progress) ** power + lr_end, over lr_init."""

    total_steps: int
    lr_end: float
    power: float
    lr_init: float

    def after_warmup(self, step: int) -> float:
        # Divided by lr_init throughout because LambdaLR multiplies by the initial lr.
        if step > self.total_steps:
            return self.lr_end / self.lr_init
        # max(1, ...) only where transformers would divide by zero (warmup == total steps).
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        pct_remaining = 1 - (step - self.warmup_steps) / decay_steps
        decay = (self.lr_init - self.lr_end) * pct_remaining**self.power + self.lr_end
        return decay / self.lr_init


@dataclass
class InverseSqrt(Warmup):
    """Warmup, then `1 / sqrt((step + timescale - warmup_steps) / timescale)`."""

    timescale: int

    def after_warmup(self, step: int) -> float:
        shift = self.timescale - self.warmup_steps
        return 1.0 / math.sqrt((step + shift) / self.timescale)


# Accepted kwargs per schedule with their defaults (transformers' defaults); the keys are also
# what the unknown-kwarg error lists. reduce_lr_on_plateau takes ReduceLROnPlateau's own kwargs.
_KWARG_DEFAULTS: dict[str, dict[str, Any]] = {
    "linear": {},
    "cosine": {"num_cycles": 0.5},
    "cosine_with_restarts": {"num_cycles": 1},
    "polynomial": {"lr_end": 1e-7, "power": 1.0},
    "constant": {},
    "constant_with_warmup": {},
    "inverse_sqrt": {"timescale": None},
}
_PLATEAU_KWARGS = tuple(inspect.signature(ReduceLROnPlateau).parameters)[1:]  # all but optimizer
SCHEDULE_NAMES: tuple[str, ...] = (*_KWARG_DEFAULTS, "reduce_lr_on_plateau")


class Schedule:
    """What the training loop drives, whatever the schedule type (so the loop has no branches).

    Call `step()` after every optimizer step and `observe(metric)` at each logging/eval point;
    each is a no-op for the type it does not concern. `state_dict`/`load_state_dict` pass
    through to the torch scheduler; restore the optimizer's state alongside.
    """

    def __init__(self, scheduler: LRScheduler) -> None:
        self.scheduler = scheduler
        self._plateau = isinstance(scheduler, ReduceLROnPlateau)

    def step(self) -> None:
        """Advance a step-driven schedule by one optimizer step; no-op for plateau."""
        if not self._plateau:
            self.scheduler.step()

    def observe(self, metric: float) -> None:
        """Feed a metric to reduce_lr_on_plateau; no-op for step-driven schedules."""
        if self._plateau:
            self.scheduler.step(float(metric))

    def last_lr(self) -> float:
        """The current lr of param group 0, as the optimizer will use it."""
        return float(self.scheduler.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)


def get_warmup_steps(num_training_steps: int, warmup_steps: int, warmup_ratio: float) -> int:
    """`warmup_steps` if > 0, else `ceil(num_training_steps * warmup_ratio)` (as transformers)."""
    return warmup_steps if warmup_steps > 0 else math.ceil(num_training_steps * warmup_ratio)


def build_schedule(
    optimizer: Optimizer,
    name: str,
    num_training_steps: int,
    warmup_steps: int = 0,
    warmup_ratio: float = 0.0,
    kwargs: dict[str, Any] | None = None,
) -> Schedule:
    """Build schedule `name` over `optimizer`; bad names or kwargs raise a one-line ValueError."""
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {name!r}; accepted: {', '.join(SCHEDULE_NAMES)}")
    kwargs = dict(kwargs or {})
    accepted = _PLATEAU_KWARGS if name == "reduce_lr_on_plateau" else tuple(_KWARG_DEFAULTS[name])
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(
            f"unknown kwarg {unknown[0]!r} for schedule {name!r}; "
            f"accepted: {', '.join(accepted) or 'none'}"
        )
    warmup = get_warmup_steps(num_training_steps, warmup_steps, warmup_ratio)
    if warmup > 0 and name in ("constant", "reduce_lr_on_plateau"):
        # transformers ignores warmup for these too; say so rather than drop it silently.
        logger.warning("schedule %r has no warmup; ignoring %d warmup steps", name, warmup)
    if name == "reduce_lr_on_plateau":
        return Schedule(ReduceLROnPlateau(optimizer, **kwargs))
    for key, value in kwargs.items():
        # Values land in the lambda's __dict__, which is checkpointed as JSON: plain numbers only.
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"schedule {name!r} kwarg {key!r} must be a number, got {value!r}")
    opts = {**_KWARG_DEFAULTS[name], **kwargs}
    multiplier = _multiplier(name, optimizer, num_training_steps, warmup, opts)
    return Schedule(LambdaLR(optimizer, multiplier))


def _multiplier(
    name: str, optimizer: Optimizer, total: int, warmup: int, opts: dict[str, Any]
) -> Warmup:
    if name in ("constant", "constant_with_warmup"):
        return ConstantWithWarmup(warmup if name == "constant_with_warmup" else 0)
    if name == "linear":
        return LinearWarmupDecay(warmup, total)
    if name == "cosine":
        return CosineWarmupDecay(warmup, total, opts["num_cycles"])
    if name == "cosine_with_restarts":
        return CosineHardRestarts(warmup, total, opts["num_cycles"])
    if name == "inverse_sqrt":
        timescale = opts["timescale"] if opts["timescale"] is not None else (warmup or 10_000)
        return InverseSqrt(warmup, timescale)
    # polynomial: decays from the optimizer's initial lr, as transformers does.
    lr_init = float(optimizer.defaults["lr"])
    if not lr_init > opts["lr_end"]:
        raise ValueError(f"polynomial lr_end {opts['lr_end']} must be below the lr {lr_init}")
    return PolynomialWarmupDecay(warmup, total, opts["lr_end"], opts["power"], lr_init)
