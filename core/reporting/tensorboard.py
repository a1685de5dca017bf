"""TensorBoard scalars from rank 0 (`run.report_to: [tensorboard]`): `<output_dir>/tensorboard/`.

A resumed attempt appends to the same directory and opens its writer with `purge_step` = the
resumed step + 1: TensorBoard then hides every event of earlier attempts at or after that step
(the ones a killed attempt logged past its last checkpoint), so each step reads once. Step S
itself stays: the checkpoint at S holds it, and the resumed run never logs it again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.callbacks import TrainerCallback, TrainerControl
from core.config import Config
from core.reporting.metrics import Throughput
from core.state import TrainState

TENSORBOARD_DIR = "tensorboard"


class TensorBoardReporter(TrainerCallback):
    """train/loss, train/lr, train/grad_norm, train/samples_per_second, train/epoch at every
    logged step; eval/<metric> at every evaluation; checkpoint/save_seconds and
    checkpoint/stall_seconds at every commit. Flushed at every record, so a SIGKILL loses
    nothing that a checkpoint already holds."""

    def __init__(self, output_dir: str | Path, total_steps: int) -> None:
        self.log_dir = Path(output_dir) / TENSORBOARD_DIR
        self._speed = Throughput(total_steps)
        self._writer: Any = None

    def on_train_begin(
        self, config: Config, state: TrainState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # Imported here: loading tensorboard costs a second, and only runs that ask pay it.
        from torch.utils.tensorboard import SummaryWriter

        self._speed.reset(state.global_step, state.samples_seen)
        # Event files are read in name order, and names start with the creation second: two
        # attempts are always seconds apart (process start alone takes that long).
        self._writer = SummaryWriter(str(self.log_dir), purge_step=state.global_step + 1)

    def on_log(
        self,
        config: Config,
        state: TrainState,
        control: TrainerControl,
        logs: dict[str, Any],
        **kwargs: Any,
    ) -> None:
        w, step = self._writer, logs["step"]
        if "train_runtime" in logs:  # the closing summary: not a point of the curve
            return
        if "loss" in logs:
            w.add_scalar("train/loss", logs["loss"], step)
            w.add_scalar("train/lr", logs["lr"], step)
            w.add_scalar("train/epoch", logs["epoch"], step)
            if "grad_norm" in logs:
                w.add_scalar("train/grad_norm", logs["grad_norm"], step)
            rate = self._speed.update(logs).samples_per_second
            if rate is not None:
                w.add_scalar("train/samples_per_second", rate, step)
        else:
            for key, value in logs.items():
                if key.startswith("eval_"):
                    w.add_scalar(f"eval/{key[len('eval_') :]}", value, step)
        w.flush()

    def on_save(
        self,
        config: Config,
        state: TrainState,
        control: TrainerControl,
        path: str,
        seconds: float | None = None,
        **kwargs: Any,
    ) -> None:
        if seconds is None:
            return
        step = state.global_step
        self._writer.add_scalar("checkpoint/save_seconds", seconds, step)
        # Saves are synchronous: training waits for the whole save. An engine that saves in
        # the background would report less here than above.
        self._writer.add_scalar("checkpoint/stall_seconds", seconds, step)
        self._writer.flush()

    def on_train_end(
        self, config: Config, state: TrainState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
