"""The loop's records: a logged step (loss reduced across ranks once, lr, grad norm, speed), an
evaluation, and the run's summary (speed, memory, FLOPs when the model can count them). Each
record goes to state.log_history and to the callbacks' on_log (metrics.jsonl, TensorBoard, the
console: see core/reporting/reporters.py).

Host syncs happen only on steps that log: other steps never call `.item()`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from core.config import Config
from core.data.stream import ENDLESS
from core.dist_info import DistInfo
from core.engines.base import Engine
from core.reporting.line_writer import LineWriter
from core.reporting.memory import StageMemory, speed_metrics
from core.state import TrainState

logger = logging.getLogger("core.loop")  # where the sample ids were always logged

Fire = Callable[..., Any]
"""fire(event, **kwargs): the loop's callback dispatch."""


class StepLog:
    def __init__(
        self,
        config: Config,
        state: TrainState,
        engine: Engine,
        sampler: Any,
        lengths: np.ndarray | None,
        dist_info: DistInfo,
        fire: Fire,
        memory: StageMemory,
        writer: LineWriter | None = None,
        observes_loss: bool = True,
    ) -> None:
        self.config, self.state, self.engine, self.sampler = config, state, engine, sampler
        self.lengths = lengths
        self.world_size = dist_info.world_size
        self.fire = fire
        self.memory = memory
        self.writer = writer
        """The reporters' background line writer: drained before a save and on the way out."""
        self.observes_loss = observes_loss
        """The schedule observes the training loss (without evaluation; else the eval metric)."""
        self._last = (time.perf_counter(), state.global_step)

    def begin(self) -> None:
        self._last = (time.perf_counter(), self.state.global_step)

    def drain(self) -> None:
        """Write out the lines queued so far (before a save or an evaluation logs more)."""
        if self.writer is not None:
            self.writer.drain()

    def close(self) -> None:
        """On the way out after an error: the lines before it, then its messages."""
        if self.writer is not None:
            self.writer.close(quiet=True)

    def epoch_progress(self) -> float:
        """Epoch plus the fraction of it consumed (a stream's length is unknown: no fraction)."""
        if self.sampler.total_size >= ENDLESS:
            return float(self.state.epoch)
        return self.state.epoch + self.sampler.position / self.sampler.total_size

    def step(
        self, losses: list[torch.Tensor], grad_norm: torch.Tensor | None, lr: float, flag: bool
    ) -> bool:
        """Log the step just taken; `flag` rides with the loss's reduction across ranks (the
        lease: nothing is reported once any rank lost it). Returns the flag as any rank had it,
        and logs nothing when it is set."""
        state = self.state
        if self.world_size == 1 and len(losses) == 1:
            # What the float64 sum below gives for one loss (widening is exact; + 0.0 maps -0.0
            # to 0.0 as the sum does), minus four tensor ops on every logged step.
            loss = losses[0].item() + 0.0
        else:
            # One collective carries the loss and the flag; float64 keeps the sum over ranks
            # exact and ordered.
            total = torch.stack(losses).to(torch.float64).sum().reshape(1)
            if self.world_size > 1:
                total = torch.cat([total, total.new_tensor([float(flag)])])
                dist.all_reduce(total)
            loss_sum, *rest = total.tolist()
            flag = bool(rest[0]) if rest else flag
            loss = loss_sum / (self.world_size * len(losses))
        if flag:
            return True
        now = time.perf_counter()
        t0, s0 = self._last
        self._last = (now, state.global_step)
        logs: dict[str, Any] = {
            "step": state.global_step,
            "loss": loss,
            "lr": lr,
            "epoch": self.epoch_progress(),
            "samples": state.samples_seen,
            "step_time_s": (now - t0) / max(1, state.global_step - s0),
        }
        if self.lengths is not None:
            logs["tokens"] = state.tokens_seen
        if grad_norm is not None:
            logs["grad_norm"] = grad_norm.item()
        if self.observes_loss:
            self.engine.schedule.observe(loss)
        state.log_history.append(logs)
        self.fire("on_log", logs=logs)
        return False

    def sample_ids(self, step: int, mine: list[int]) -> None:
        """Debug: the global sample ids every rank drew for `step` (a gather), by rank 0."""
        ranks: list[list[int]] = [mine]
        if self.world_size > 1:
            ranks = [[] for _ in range(self.world_size)]
            dist.all_gather_object(ranks, mine)
        logger.debug("step %d sample ids %s", step, json.dumps(ranks))

    def evaluation(self, metrics: dict[str, float], observed: str) -> None:
        """Log an evaluation's metrics; the schedule observes metrics[observed]."""
        record = {"step": self.state.global_step, "epoch": self.epoch_progress(), **metrics}
        self.state.log_history.append(record)
        self.engine.schedule.observe(metrics[observed])
        self.fire("on_log", logs=record)
        self.fire("on_evaluate", metrics=metrics)

    def summary(self, t0: float, samples0: int, tokens0: int, steps: int) -> dict[str, float]:
        """Speed and memory since (t0, samples0, tokens0), and total FLOPs where the model
        counts them (`training_flops(tokens, seq_len)`); logged as the run's last record."""
        state = self.state
        tokens = state.tokens_seen - tokens0 if self.lengths is not None else None
        summary = {
            **speed_metrics("train", t0, state.samples_seen - samples0, steps, tokens),
            **self.memory.metrics(),
        }
        flops = getattr(self.engine.model, "training_flops", None)
        if flops is not None and self.lengths is not None:
            summary["total_flos"] = flops(state.tokens_seen, self.config.data.seq_len)
        self.fire("on_log", logs={"step": state.global_step, **summary})
        return summary
