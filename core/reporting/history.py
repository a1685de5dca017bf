"""A run's history across attempts: `<output_dir>/history.jsonl`, one JSON object per line.

Rank 0 appends a `start` record when an attempt begins training (after any resume), a
`checkpoint` record after each checkpoint is committed, and an `end` record when the attempt
stops (done, preempted, or an error). A SIGKILL or a lost node writes no end record: that is
how the next attempt tells a crash. Every record is flushed and fsynced as it is written.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

from checkpointing.redact import display_url
from core.callbacks import TrainerCallback, TrainerControl
from core.config import Config
from core.state import TrainState

logger = logging.getLogger(__name__)

HISTORY_FILE = "history.jsonl"
CAUSES = ("fresh", "preempted", "crashed", "restarted", "unknown")
"""Why an attempt started: the first one; after a preemption; after an attempt that died
(no end record) or ended with an error; after a clean end, or a torchrun worker restart;
unknown when the history cannot be read."""
REASONS = ("done", "preempted", "error")


@dataclass
class AttemptStart:
    EVENT: ClassVar[str] = "start"
    time: float
    """Unix time."""
    attempt: int
    """1 for the first attempt, counting every start recorded in this run dir."""
    step: int
    """The global step training started from (0, or the resumed checkpoint's step)."""
    resumed_from: str | None
    """The checkpoint resumed (its name when inside the run dir), None for step 0."""
    world_size: int
    cause: str
    """One of CAUSES."""
    total_steps: int
    restart_count: int = 0
    """torchrun's worker-group restart count (TORCHELASTIC_RESTART_COUNT)."""


@dataclass
class CheckpointCommit:
    EVENT: ClassVar[str] = "checkpoint"
    time: float
    step: int
    path: str
    """The checkpoint's name when inside the run dir, else its path."""
    save_seconds: float | None
    """Wall time of the save (the loop waits for all of it: saves are synchronous)."""


@dataclass
class AttemptEnd:
    EVENT: ClassVar[str] = "end"
    time: float
    step: int
    reason: str
    """One of REASONS."""
    error: str | None = None
    """`ExceptionType: message` when reason is error."""


Record = AttemptStart | CheckpointCommit | AttemptEnd
_TYPES: dict[str, type[Record]] = {
    cls.EVENT: cls for cls in (AttemptStart, CheckpointCommit, AttemptEnd)
}


def to_json(record: Record) -> str:
    return json.dumps({"event": record.EVENT, **asdict(record)})


def from_dict(raw: dict[str, Any]) -> Record:
    fields = dict(raw)
    event = fields.pop("event", None)
    if event not in _TYPES:
        raise ValueError(f"unknown history event {event!r}; known: {', '.join(_TYPES)}")
    return _TYPES[event](**fields)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file ([] if absent). A last line without its newline is
    skipped: the writer may have been killed mid-line, or may be writing it right now."""
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")
    if lines and lines[-1] != "":
        lines = lines[:-1]  # unterminated: torn or in progress
    out = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e})") from e
    return out


def read_history(run_dir: str | Path) -> list[Record]:
    path = Path(run_dir) / HISTORY_FILE
    try:
        return [from_dict(raw) for raw in read_jsonl(path)]
    except TypeError as e:
        raise ValueError(f"{path}: a record has unexpected fields ({e})") from e


def resume_cause(previous: list[Record], restart_count: int = 0) -> str:
    """Why a new attempt starts, from the records of the attempts before it."""
    if restart_count > 0:
        return "restarted"  # torchrun restarted the worker group (after a worker failed)
    starts = [i for i, r in enumerate(previous) if isinstance(r, AttemptStart)]
    if not starts:
        return "fresh"
    ends = [r for r in previous[starts[-1] :] if isinstance(r, AttemptEnd)]
    if not ends:
        return "crashed"  # killed without a word: SIGKILL, OOM killer, node loss
    causes = {"preempted": "preempted", "error": "crashed", "done": "restarted"}
    return causes.get(ends[-1].reason, "unknown")


def _name_in(root: str, path: str | Path) -> str:
    """`checkpoint-<step>` for a checkpoint in the run's checkpoint root, else its location."""
    parent, _, name = str(path).rstrip("/").rpartition("/")
    if "://" in root or "://" in parent:
        return name if parent == root.rstrip("/") else display_url(str(path))
    return name if Path(parent or ".").resolve() == Path(root).resolve() else str(path)


class RunHistory(TrainerCallback):
    """Rank 0's writer of history.jsonl. The attempt's end is recorded by `end()`, called by
    whoever sees how training finished (the Trainer: it sees exceptions and preemption)."""

    def __init__(
        self, output_dir: str | Path, world_size: int, total_steps: int, restart_count: int = 0
    ) -> None:
        self.run_dir = Path(output_dir)
        self.path = self.run_dir / HISTORY_FILE
        self.world_size = world_size
        self.total_steps = total_steps
        self.restart_count = restart_count
        self._open = False

    def _append(self, record: Record) -> None:
        with self.path.open("a") as f:
            f.write(to_json(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _drop_torn_line(self) -> None:
        """A kill mid-write can leave a last line without its newline: cut it before appending."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            with self.path.open("r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)

    def on_train_begin(
        self, config: Config, state: TrainState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._drop_torn_line()
        try:
            previous = read_history(self.run_dir)
            cause = resume_cause(previous, self.restart_count)
        except ValueError as e:
            # A damaged report file must not stop training; the new records still append.
            logger.warning("%s; recording this attempt's cause as unknown", e)
            previous, cause = [], "unknown"
        step = state.global_step
        resumed = None
        if step > 0:  # a resume: resume_from is latest (so this step's checkpoint) or a path
            rf = config.checkpoint.resume_from
            root = self._root(config)
            resumed = _name_in(root, f"{root}/checkpoint-{step}" if rf == "latest" else rf)
        self._append(
            AttemptStart(
                time=time.time(),
                attempt=1 + sum(isinstance(r, AttemptStart) for r in previous),
                step=step,
                resumed_from=resumed,
                world_size=self.world_size,
                cause=cause,
                total_steps=self.total_steps,
                restart_count=self.restart_count,
            )
        )
        self._open = True

    def on_save(
        self,
        config: Config,
        state: TrainState,
        control: TrainerControl,
        path: str,
        seconds: float | None = None,
        **kwargs: Any,
    ) -> None:
        # on_save fires after the commit (rename + directory fsync), never for a partial save.
        self._append(
            CheckpointCommit(
                time.time(), state.global_step, _name_in(self._root(config), path), seconds
            )
        )

    def _root(self, config: Config) -> str:
        return config.checkpoint.dir or str(self.run_dir)

    def end(self, step: int, reason: str, error: BaseException | None = None) -> None:
        """Record the attempt's end once (nothing if it never started training)."""
        if reason not in REASONS:
            raise ValueError(f"unknown end reason {reason!r}; known: {', '.join(REASONS)}")
        if not self._open:
            return
        self._open = False
        message = None if error is None else f"{type(error).__name__}: {error}".splitlines()[0]
        self._append(AttemptEnd(time.time(), step, reason, message))
