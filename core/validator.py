"""Evaluation during training: what evaluates the model (built from the config, the user's
parts and the engine), when it is due (eval.strategy, eval.steps, or a callback's request),
running it with the steps' lines written first, and logging what it found."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from core.checkpoint import RunCheckpointer
from core.config import Config
from core.data import collate
from core.dist_info import DistInfo
from core.engines.base import Engine
from core.evaluation import evaluate
from core.reporting.memory import StageMemory
from core.reporting.step_log import StepLog

if TYPE_CHECKING:
    from core.run import UserParts

Evaluate = Callable[[], "dict[str, float] | None"]
"""Evaluates the current model on every rank; None when a stop request interrupted it."""


def build_evaluator(
    config: Config,
    parts: UserParts,
    eval_dataset: Any,
    model: nn.Module,
    engine: Engine,
    label_names: list[str],
    dist_info: DistInfo,
    stop_requested: Callable[[], bool] | None,
) -> Evaluate | None:
    """Evaluation of `model` (as `engine` trains it) on `eval_dataset`, a map-style dataset
    (the data stage refuses a stream); None: nothing to evaluate."""
    if eval_dataset is None:
        return None
    return functools.partial(
        evaluate,
        model,
        eval_dataset,
        parts.data_collator or collate,
        config.eval.per_device_batch_size or config.train.per_device_batch_size,
        rank=dist_info.rank,
        world_size=dist_info.world_size,
        device=engine.device,
        compute_metrics=parts.compute_metrics,
        preprocess_logits_for_metrics=parts.preprocess_logits_for_metrics,
        label_names=label_names or ["labels"],
        bf16=config.train.bf16,
        num_workers=config.data.num_workers,
        seed=config.run.seed,
        should_stop=stop_requested,
        lockstep=engine.gathers_in_forward,
    )


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
