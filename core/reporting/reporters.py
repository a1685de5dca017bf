"""What rank 0 reports while a run trains, and how an attempt's end is recorded.

`build_reporters` assembles the callbacks (`run.report_to`, the history, the progress display);
`finish_attempt` is called by the Trainer once training returned or raised, because only it
sees the exception or the preemption.
"""

from __future__ import annotations

from core.callbacks import CallbackHandler, TrainerCallback
from core.config import Config
from core.reporting.history import RunHistory
from core.reporting.line_writer import LineWriter
from core.reporting.metrics import JsonlMetrics, Progress
from core.reporting.tensorboard import TensorBoardReporter


def build_reporters(
    config: Config,
    total_steps: int,
    world_size: int,
    restart_count: int = 0,
    writer: LineWriter | None = None,
) -> list[TrainerCallback]:
    """Rank 0's reporters, in firing order (call this on rank 0 only). With a `writer`, the
    metrics and console lines are written on its thread (the loop drains it, see TrainLoop)."""
    out_dir = config.run.output_dir
    reporters: list[TrainerCallback] = []
    if "jsonl" in config.run.report_to:
        reporters.append(JsonlMetrics(out_dir, writer))
    if "tensorboard" in config.run.report_to:
        reporters.append(TensorBoardReporter(out_dir, total_steps))
    reporters.append(RunHistory(out_dir, world_size, total_steps, restart_count))
    reporters.append(Progress(total_steps, config.train.progress_bar, writer))
    return reporters


def finish_attempt(
    callbacks: CallbackHandler,
    step: int,
    preempted: bool = False,
    error: BaseException | None = None,
) -> None:
    """Record the attempt's end in the history; after an error also close the reporters that
    on_train_end would have closed (files, the progress bar and its log redirection; queued
    lines are written first, and a failure to write them is logged: `error` is the one raised)."""
    reason = "error" if error is not None else "preempted" if preempted else "done"
    for cb in callbacks.callbacks:
        if isinstance(cb, RunHistory):
            cb.end(step, reason, error)
        elif error is not None and isinstance(cb, JsonlMetrics | Progress):
            cb.close(quiet=True)
        elif error is not None and isinstance(cb, TensorBoardReporter):
            cb.close()
