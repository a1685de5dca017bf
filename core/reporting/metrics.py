"""What rank 0 reports: metrics.jsonl lines and a progress bar or plain log lines."""

from __future__ import annotations

import json
import logging
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from core.callbacks import TrainerCallback, TrainerControl
from core.config import Config
from core.reporting.line_writer import LineWriter
from core.state import TrainState

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep only the records at or before `last_step`, so the file reads as one trajectory."""
    if not path.exists():
        return
    # A run's closing summary (train_runtime, memory) describes that run alone: drop it too.
    # A last line without its newline was torn by a kill mid-write: it goes too.
    lines = path.read_text().split("\n")[:-1]
    kept = [
        line
        for line in lines
        if line.strip()
        and (rec := json.loads(line))["step"] <= last_step
        and "train_runtime" not in rec
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    tmp.replace(path)


class JsonlMetrics(TrainerCallback):
    """Appends one JSON object per logged optimizer step to <output_dir>/metrics.jsonl.

    Floats are written by json (shortest repr that round-trips), so losses compare exactly.
    With a `writer`, lines are formatted and written on its thread, flushed once per batch.
    """

    def __init__(self, output_dir: str | Path, writer: LineWriter | None = None) -> None:
        self.path = Path(output_dir) / METRICS_FILE
        self._file: Any = None
        self._writer = writer
        self._lines: list[str] = []  # formatted on the writer's thread, written per batch

    def on_train_begin(self, config: Config, state: TrainState, control: TrainerControl) -> None:
        # A fresh run starts a fresh file; a resumed run drops records past its step.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        truncate_metrics(self.path, state.global_step)
        self.close()  # a second train() with this callback: the earlier file is done
        self._file = self.path.open("a")
        if self._writer is not None:
            self._writer.after_batch(self._write_lines)

    def on_log(
        self, config: Config, state: TrainState, control: TrainerControl, logs: dict[str, Any]
    ) -> None:
        if self._writer is None:
            self._file.write(json.dumps(logs) + "\n")
            self._file.flush()
        else:  # a copy: a later callback may edit `logs`; its values are immutable numbers
            self._writer.submit(self._format, dict(logs))

    def _format(self, logs: dict[str, Any]) -> None:
        self._lines.append(json.dumps(logs) + "\n")

    def _write_lines(self) -> None:
        """A batch's lines in one write: whole lines, so a reader sees no torn line."""
        if self._lines:
            self._file.write("".join(self._lines))
            self._lines.clear()
            self._file.flush()

    def on_train_end(self, config: Config, state: TrainState, control: TrainerControl) -> None:
        self.close()

    def close(self, quiet: bool = False) -> None:
        """Write what is queued, then close the file (idempotent). `quiet`: see
        LineWriter.close."""
        if self._file is None:
            return
        try:
            if self._writer is not None:
                try:
                    self._writer.close(quiet)
                finally:
                    self._writer.remove_after_batch(self._write_lines)
        finally:
            self._file.close()
            self._file = None


@dataclass
class Speed:
    samples_per_second: float | None
    """Since the previous training record."""
    eta_s: float | None
    """Steps left times the mean step time of the records seen so far."""


class Throughput:
    """Speed from consecutive training records (`step`, `samples`, `step_time_s`): the loop's
    own timings, so the figures agree with metrics.jsonl."""

    def __init__(self, total_steps: int, step: int = 0, samples: int = 0) -> None:
        self.total_steps = total_steps
        self.reset(step, samples)

    def reset(self, step: int, samples: int) -> None:
        """Start counting at (step, samples), e.g. where an attempt resumed."""
        self._prev = (step, samples)
        self._seconds = 0.0
        self._steps = 0

    def update(self, logs: dict[str, Any]) -> Speed:
        step0, samples0 = self._prev
        steps = logs["step"] - step0
        seconds = logs["step_time_s"] * steps
        self._prev = (logs["step"], logs["samples"])
        self._seconds += seconds
        self._steps += steps
        rate = (logs["samples"] - samples0) / seconds if seconds > 0 else None
        eta = None
        if self._steps > 0:
            eta = max(0, self.total_steps - logs["step"]) * self._seconds / self._steps
        return Speed(rate, eta)


def format_eta(seconds: float | None) -> str:
    return "?" if seconds is None else tqdm.format_interval(seconds)


class Progress(TrainerCallback):
    """A tqdm bar on a terminal (or when forced), plain log lines at each log step otherwise.

    While the bar is up, log records go through `tqdm.write` (logging_redirect_tqdm), so they
    print above the bar instead of through it. Without the bar and with a `writer`, the lines
    are formatted and logged on the writer's thread, stamped with the time of the step.
    """

    def __init__(
        self, total_steps: int, mode: str = "auto", writer: LineWriter | None = None
    ) -> None:
        self.total_steps = total_steps
        self._writer = writer
        self.use_bar = mode == "always" or (mode == "auto" and sys.stderr.isatty())
        self._bar: tqdm | None = None
        self._speed = Throughput(total_steps)
        self._redirect = ExitStack()

    def on_train_begin(self, config: Config, state: TrainState, control: TrainerControl) -> None:
        self._speed.reset(state.global_step, state.samples_seen)
        if self.use_bar:
            self._redirect.enter_context(logging_redirect_tqdm())
            self._bar = tqdm(
                total=self.total_steps, initial=state.global_step, unit="step", dynamic_ncols=True
            )

    def on_step_end(self, config: Config, state: TrainState, control: TrainerControl) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def on_log(
        self, config: Config, state: TrainState, control: TrainerControl, logs: dict[str, Any]
    ) -> None:
        if self._bar is not None or self._writer is None:
            self._report(logs)
        elif logger.isEnabledFor(logging.INFO):
            self._writer.submit(self._report, dict(logs), time.time())

    def _report(self, logs: dict[str, Any], created: float | None = None) -> None:
        """The record's line (or the bar's postfix); `created`: the time the line is stamped
        with, when it is written later."""
        info = logger.info if created is None else _stamped(created)
        if "train_runtime" in logs:  # the closing summary
            info(
                "trained %d steps in %.1f s (%.2f steps/s)",
                logs["step"],
                logs["train_runtime"],
                logs.get("train_steps_per_second", 0.0),
            )
        elif "loss" not in logs:  # an evaluation record
            evals = " ".join(f"{k} {v:.4g}" for k, v in logs.items() if k.startswith("eval_"))
            info("step %d/%d %s", logs["step"], self.total_steps, evals)
        else:
            speed = self._speed.update(logs)
            rate = speed.samples_per_second
            if self._bar is not None:
                postfix = {"loss": f"{logs['loss']:.4f}", "lr": f"{logs['lr']:.2e}"}
                if rate is not None:
                    postfix["samples/s"] = f"{rate:.1f}"
                self._bar.set_postfix(postfix, refresh=False)
                return
            info(
                "step %d/%d loss %.4f lr %.3e epoch %.2f %.3f s/step %s samples/s ETA %s",
                logs["step"],
                self.total_steps,
                logs["loss"],
                logs["lr"],
                logs["epoch"],
                logs["step_time_s"],
                "?" if rate is None else f"{rate:.1f}",
                format_eta(speed.eta_s),
            )

    def on_train_end(self, config: Config, state: TrainState, control: TrainerControl) -> None:
        self.close()

    def close(self, quiet: bool = False) -> None:
        """Write the queued lines, close the bar and give the console back to the log handlers
        (idempotent). `quiet`: see LineWriter.close."""
        if self._writer is not None:
            self._writer.close(quiet)
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._redirect.close()


def _stamped(created: float) -> Any:
    """logger.info for a line written after the fact: its record carries `created`."""

    def info(msg: str, *args: Any) -> None:
        fn, lno, func, _ = logger.findCaller(stacklevel=2)  # the line in _report
        record = logger.makeRecord(logger.name, logging.INFO, fn, lno, msg, args, None, func)
        shift = record.created - created
        record.created = created
        record.msecs = int((created - int(created)) * 1000) + 0.0  # as LogRecord computes it
        record.relativeCreated -= shift * 1000
        logger.handle(record)

    return info
