"""Preemption signals: the handler only records the request; the loop acts at a step boundary.

SIGTERM is what torchrun forwards to workers and what Kubernetes and Slurm send before a kill;
SIGUSR1 is what `sbatch --signal=USR1@N` sends ahead of the time limit.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

logger = logging.getLogger(__name__)

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopFlag:
    """Callable: true once a preemption signal arrived. Further signals change nothing, so a
    second SIGTERM during the checkpoint save cannot interrupt it."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> StopFlag:
        for sig in PREEMPTION_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only an assignment: logging or I/O from a signal handler can deadlock.
        if self.signum is None:
            self.signum = signum

    def __call__(self) -> bool:
        return self.signum is not None
