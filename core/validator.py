"""Evaluation during training: when it is due (eval.strategy, eval.steps, or a callback's
request), running it with the steps' lines written first, and logging what it found."""

from __future__ import annotations

from collections.abc import Callable

from core.checkpoint import RunCheckpointer
from core.config import Config
from core.reporting.memory import StageMemory
from core.reporting.step_log import StepLog

Evaluate = Callable[[], "dict[str, float] | None"]
"""Evaluates the current model on every rank; None when a stop request interrupted it."""


class Validator:
    def __init__(
        self,
        evaluate: Evaluate | None,
        config: Config,
        log: StepLog,
        memory: StageMemory,
        checkpointer: RunCheckpointer,
    ) -> None:
        self.evaluate = evaluate
        self.config = config
        self.log = log
        self.memory = memory
        self.checkpointer = checkpointer

    @property
    def enabled(self) -> bool:
        return self.evaluate is not None and self.config.eval.strategy != "no"

    def due(self, step: int, asked: bool, epoch_ended: bool) -> bool:
        """Whether to evaluate after `step`: asked for by a callback, or by eval.strategy."""
        if asked:
            return True
        if not self.enabled:
            return False
        ec = self.config.eval
        if ec.strategy == "epoch":
            return epoch_ended
        return step % (ec.steps or self.config.train.logging_steps) == 0

    def run(self, step: int) -> dict[str, float] | None:
        """Evaluate now (every rank); log and report the metrics. None if a stop request
        interrupted the evaluation."""
        if self.evaluate is None:
            raise ValueError("no evaluation dataset: pass eval_dataset or set eval.strategy")
        self.log.drain()  # the steps' lines come before what the evaluation logs
        with self.memory.stage("eval"):
            metrics = self.evaluate()
        if metrics is None:
            return None
        self.log.evaluation(metrics, self.config.checkpoint.best_metric or "eval_loss")
        self.checkpointer.last_eval = (step, metrics)  # a save at this step records the metric
        return metrics
