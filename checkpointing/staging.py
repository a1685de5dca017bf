"""What an asynchronous save needs: a private copy of the state, and a background writer.

The loop stalls only while `Staging.stage` copies the tensors that alias live state into
buffers kept for the next save (allocated once, so the copy is a memcpy, not page faults);
`BackgroundSave` then runs the write, hash, upload and commit on a thread while training goes on.
At most one save is in flight: the next one waits for it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


class Staging:
    """Buffers that hold one copy of the state between a snapshot and its write."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}

    def stage(
        self, file: str, tensors: Mapping[str, torch.Tensor], live: set[str]
    ) -> dict[str, torch.Tensor]:
        """`tensors` with each one named in `live` (a view of memory training will change)
        replaced by a copy in this file's buffer; the others are already private copies."""
        out = {}
        for key, t in tensors.items():
            if key not in live:
                out[key] = t
                continue
            buf = self._buffers.get((file, key))
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty_like(t, device="cpu", memory_format=torch.contiguous_format)
                self._buffers[(file, key)] = buf
            out[key] = buf.copy_(t)
        return out

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


WRITER_NICE = 19
"""How much the writer thread (and the hashing thread it starts) yields the CPU to training."""


def lower_priority() -> None:
    """Lower this thread's CPU priority (Linux: nice is per thread, and threads it starts
    inherit it), so that on a busy CPU the training threads win and the save takes longer."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except (AttributeError, OSError) as e:  # not Linux, or not allowed: run at normal priority
        logger.debug("writer thread keeps its priority: %s", e)


@dataclass
class SaveOutcome:
    """A finished save: where it committed and its wall time, or the error that stopped it."""

    step: int
    location: str | None
    seconds: float
    error: BaseException | None = None


class BackgroundSave:
    """One save running `work()` on a daemon thread (daemon: a run killed by an exception must
    still be able to exit if the store hangs; the checkpoint is then left uncommitted)."""

    def __init__(self, step: int, work: Callable[[], str]) -> None:
        self.step = step
        self.outcome: SaveOutcome | None = None
        self._t0 = time.perf_counter()
        self._work = work
        self._thread = threading.Thread(
            target=self._run, name=f"checkpoint-{step}-writer", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        lower_priority()
        try:
            location = self._work()
            self.outcome = SaveOutcome(self.step, location, time.perf_counter() - self._t0)
        except BaseException as e:  # handed to the training thread, which raises it
            self.outcome = SaveOutcome(self.step, None, time.perf_counter() - self._t0, e)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> SaveOutcome | None:
        """The outcome, once the thread has finished (None if `timeout` passed first)."""
        self._thread.join(timeout)
        return None if self._thread.is_alive() else self.outcome
