"""What an asynchronous save needs: a private copy of the state, and a background writer.

The loop stalls only while `Staging.stage` copies the tensors that alias live state into
buffers kept for the next save (allocated once, so the copy is a memcpy, not page faults);
`BackgroundSave` then runs the write, hash, upload and commit on a thread while training goes on.
At most one save is in flight: the next one waits for it.

CUDA tensors are copied into pinned host buffers (allocated once, reused by every save) with
`non_blocking` copies, so the loop does not wait for them at all:

- the engine's parameters and optimizer state (`updated_by_step` of the `model` and
  `optimizer` entries), which only an optimizer step changes, are copied on a side stream that
  first waits for the training stream (so it reads this step's values); the training stream
  waits for those copies right before the next optimizer step (a global optimizer step
  pre-hook), so the next forward and backward overlap them;
- every other CUDA tensor (buffers a forward may change in place, such as running statistics;
  any other entry's tensors) is copied on the training stream itself, ordered before anything
  that follows it;
- the writer thread waits for every copy (`wait_for(enqueued())`) before it reads a byte.

A callback that changes parameters in place outside `optimizer.step()` after a save and before
the next optimizer step would race with the side-stream copy (docs/checkpoints.md, "Async save").
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

logger = logging.getLogger(__name__)


def updated_by_step(objects: Iterable[Any]) -> set[int]:
    """Addresses of the storages that only an optimizer step changes: the parameters of
    every module and the parameters and state of every optimizer among `objects`, or held by
    one of them in an attribute (the engines' entries wrap them: `.obj`, `.model`,
    `.optimizer`), two levels deep."""
    out: set[int] = set()

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if isinstance(t, DTensor) else t
            out.add(local.untyped_storage().data_ptr())

    def visit(obj: Any, depth: int) -> None:
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                add(p)
        elif isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                for p in group["params"]:
                    add(p)
            for state in obj.state.values():
                for t in state.values():
                    add(t)
        elif depth > 0 and hasattr(obj, "__dict__"):
            for value in vars(obj).values():
                visit(value, depth - 1)

    for obj in objects:
        visit(obj, 2)
    return out


class Staging:
    """Buffers that hold one copy of the state between a snapshot and its write."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._side: dict[torch.device, torch.cuda.Stream] = {}
        self._copies: list[Any] = []  # CUDA events of the copies enqueued since `enqueued`
        self._before_step: list[tuple[torch.device, Any]] = []  # side-stream copies' events
        self._hook: Any = None
        self._pinning = True

    def stage(
        self,
        file: str,
        tensors: Mapping[str, torch.Tensor],
        live: set[str],
        step_only: AbstractSet[int] = frozenset(),
    ) -> dict[str, torch.Tensor]:
        """`tensors` with each one named in `live` (a view of memory training will change) or
        on a CUDA device replaced by a copy in this file's host buffer; the others are already
        private host copies. `step_only`: storages only an optimizer step changes (see
        `updated_by_step`), copied on a side stream. CUDA copies are enqueued, not finished:
        wait for `enqueued()` before reading the result."""
        out = {}
        on_current: set[torch.device] = set()
        on_side: set[torch.device] = set()
        for key, t in tensors.items():
            if key not in live and not t.is_cuda:
                out[key] = t
                continue
            buf = self._buffer(file, key, t)
            if not t.is_cuda:
                out[key] = buf.copy_(t)
            elif t.untyped_storage().data_ptr() in step_only:
                stream = self._side_stream(t.device, on_side)
                with torch.cuda.stream(stream):
                    t.record_stream(stream)  # not handed out again before the copy ran
                    out[key] = buf.copy_(t, non_blocking=True)
            else:  # on the training stream: ordered before whatever changes `t` next
                on_current.add(t.device)
                out[key] = buf.copy_(t, non_blocking=True)
        for device in on_current:
            self._copies.append(torch.cuda.current_stream(device).record_event())
        for device in on_side:
            event = self._side[device].record_event()
            self._copies.append(event)
            self._before_step.append((device, event))
        if on_side and self._hook is None:
            # Kept for the process's life: a hook cannot remove itself while torch iterates.
            self._hook = register_optimizer_step_pre_hook(self._wait_copies)
        return out

    def _buffer(self, file: str, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get((file, key))
        if buf is not None and buf.shape == t.shape and buf.dtype == t.dtype:
            return buf
        try:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda and self._pinning)
        except RuntimeError as e:  # no page-locked memory left (ulimit -l): pageable, slower
            logger.warning("staging in pageable memory (pinning %s failed: %s)", key, e)
            self._pinning = False
            buf = torch.empty(t.shape, dtype=t.dtype)
        self._buffers[(file, key)] = buf
        return buf

    def _side_stream(self, device: torch.device, used: set[torch.device]) -> Any:
        stream = self._side.get(device)
        if stream is None:
            stream = self._side[device] = torch.cuda.Stream(device)
        if device not in used:  # the copies read this step's values, not older ones
            stream.wait_stream(torch.cuda.current_stream(device))
            used.add(device)
        return stream

    def _wait_copies(self, *_: Any) -> None:
        """Before any optimizer step: the training stream waits for the side-stream copies
        (on the GPU; the host goes on)."""
        for device, event in self._before_step:
            torch.cuda.current_stream(device).wait_event(event)
        self._before_step = []

    def enqueued(self) -> list[Any]:
        """The CUDA events of the copies `stage` enqueued since the last call; a reader of the
        staged tensors synchronises each first (see `wait_for`)."""
        out, self._copies = self._copies, []
        return out

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def wait_for(events: list[Any]) -> None:
    """Block this thread until every copy behind `events` has landed in its host buffer."""
    for event in events:
        event.synchronize()


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
