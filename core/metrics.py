"""What rank 0 reports: metrics.jsonl lines and a progress bar or plain log lines."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from core.callbacks import TrainerCallback, TrainerControl
from core.config import Config
from core.state import TrainState

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep only the records at or before `last_step`, so the file reads as one trajectory."""
    if not path.exists():
        return
    # A run's closing summary (train_runtime, memory) describes that run alone: drop it too.
    kept = [
        line
        for line in path.read_text().splitlines()
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
    """

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / METRICS_FILE
        self._file: Any = None

    def on_train_begin(self, config: Config, state: TrainState, control: TrainerControl) -> None:
        # A fresh run starts a fresh file; a resumed run drops records past its step.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        truncate_metrics(self.path, state.global_step)
        self._file = self.path.open("a")

    def on_log(
        self, config: Config, state: TrainState, control: TrainerControl, logs: dict[str, Any]
    ) -> None:
        self._file.write(json.dumps(logs) + "\n")
        self._file.flush()

    def on_train_end(self, config: Config, state: TrainState, control: TrainerControl) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class Progress(TrainerCallback):
    """A tqdm bar on a terminal (or when forced), plain log lines at each log step otherwise."""

    def __init__(self, total_steps: int, mode: str = "auto") -> None:
        self.total_steps = total_steps
        self.use_bar = mode == "always" or (mode == "auto" and sys.stderr.isatty())
        self._bar: tqdm | None = None

    def on_train_begin(self, config: Config, state: TrainState, control: TrainerControl) -> None:
        if self.use_bar:
            self._bar = tqdm(
                total=self.total_steps, initial=state.global_step, unit="step", dynamic_ncols=True
            )

    def on_step_end(self, config: Config, state: TrainState, control: TrainerControl) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def on_log(
        self, config: Config, state: TrainState, control: TrainerControl, logs: dict[str, Any]
    ) -> None:
        if "train_runtime" in logs:  # the closing summary
            logger.info(
                "trained %d steps in %.1f s (%.2f steps/s)",
                logs["step"],
                logs["train_runtime"],
                logs.get("train_steps_per_second", 0.0),
            )
        elif "loss" not in logs:  # an evaluation record
            evals = " ".join(f"{k} {v:.4g}" for k, v in logs.items() if k.startswith("eval_"))
            logger.info("step %d/%d %s", logs["step"], self.total_steps, evals)
        elif self._bar is not None:
            self._bar.set_postfix(loss=f"{logs['loss']:.4f}", lr=f"{logs['lr']:.2e}", refresh=False)
        else:
            logger.info(
                "step %d/%d loss %.4f lr %.3e epoch %.2f %.3f s/step",
                logs["step"],
                self.total_steps,
                logs["loss"],
                logs["lr"],
                logs["epoch"],
                logs["step_time_s"],
            )

    def on_train_end(self, config: Config, state: TrainState, control: TrainerControl) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
