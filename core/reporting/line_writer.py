"""Report lines written off the training step: a queue drained by a background thread.

With logging every step, formatting and writing the metrics.jsonl line and the console line
cost more host time than a small model's whole step. The reporters hand the writer a function
and its arguments instead (the record's values are immutable numbers, copied into a new dict);
a thread runs them in submission order every `interval_s`, a batch at a time, so the step
thread never waits on a write and the thread does not wake for every line (each wake-up would
contend for the GIL in the middle of a step).

`drain()` runs everything submitted so far on the calling thread and returns once it is
written: the loop drains before a checkpoint save (a committed step's lines are on disk before
its commit, so truncation on resume stays exact), and `close()` drains on every way out
(the end, a preemption, an error). A line is on disk at most `interval_s` after its step
otherwise; a SIGKILL loses at most that much, all of it past the last checkpoint.

`may_write` fences the lines to the job that holds the run: a job frozen (SIGSTOP, a stalled
node) with lines queued and taken over meanwhile must not append them once it runs again, after
the new holder's lines (its drain on the way out would). Each batch asks first and drops what is
queued once the answer is no.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

INTERVAL_S = 0.1
"""How long a line waits, at most, before the thread writes it."""


class LineWriter:
    """Runs submitted calls in order on a background thread (started on the first submit).

    `may_write` (optional): asked before each batch; once False, queued calls are dropped.
    A call that raises stops the writing: the error is raised again by the next `submit` or
    `drain` on the step thread, so a failed write (a full disk) still fails the run.
    `after_batch` callables (a file's flush) run once after each batch instead of per line.
    """

    def __init__(
        self, interval_s: float | None = None, may_write: Callable[[], bool] | None = None
    ) -> None:
        self.interval_s = INTERVAL_S if interval_s is None else interval_s
        self.may_write = may_write
        self._pending: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        # Held while a batch runs: a drain on the step thread waits for the thread's batch, so
        # lines never pass each other.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._after: list[Callable[[], Any]] = []

    def after_batch(self, fn: Callable[[], Any]) -> None:
        """Call `fn()` after every batch of calls (and every drain) that ran at least one."""
        self._after.append(fn)

    def remove_after_batch(self, fn: Callable[[], Any]) -> None:
        self._after.remove(fn)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue `fn(*args)` (no wake-up: the thread picks it up within interval_s)."""
        if self._error is not None:
            self._raise()
        self._pending.append((fn, args))  # deque.append is atomic: no lock on the step path
        if self._thread is None:
            self._start()

    def drain(self) -> None:
        """Run every call submitted so far, on this thread, before returning."""
        with self._lock:
            self._run_pending()
        if self._error is not None:
            self._raise()

    def close(self, quiet: bool = False) -> None:
        """Drain and stop the thread (idempotent). `quiet`: on the way out after another
        error, a failed write is logged instead of raised (it would hide that error)."""
        try:
            self.drain()
        except Exception as e:
            if not quiet:
                raise
            logger.warning("writing report lines: %s: %s", type(e).__name__, e)
        finally:
            self._stop.set()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join()
            self._thread = None
            self._stop = threading.Event()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="line-writer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        stop = self._stop
        while not stop.wait(self.interval_s):
            if self._pending:
                with self._lock:
                    self._run_pending()

    def _run_pending(self) -> None:
        pending, ran = self._pending, False
        try:
            if pending and self.may_write is not None and not self.may_write():
                n = len(pending)
                logger.warning("the run is no longer this job's: %d report line(s) dropped", n)
                pending.clear()
                return
            while pending and self._error is None:
                fn, args = pending.popleft()
                ran = True
                fn(*args)
            if ran:
                for after in self._after:
                    after()
        except BaseException as e:
            # Kept for the step thread, which raises it at its next submit or drain.
            self._error = e

    def _raise(self) -> None:
        assert self._error is not None
        raise self._error  # the write's own error (OSError...), as when it was written inline
