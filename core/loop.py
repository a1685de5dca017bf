"""The inner training loop: epochs of optimizer steps of micro-batches, through an Engine.

Host syncs happen only on steps that log: other steps queue work and never call `.item()`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from checkpointing.comm import any_rank
from checkpointing.staging import SaveOutcome
from core.callbacks import CallbackHandler, TrainerCallback, TrainerControl
from core.checkpoint import RunCheckpointer
from core.config import Config
from core.data.loader import make_dataloader
from core.data.sampler import ResumableDistributedSampler
from core.data.store import uniform_length
from core.data.stream import ENDLESS
from core.dist_info import DistInfo
from core.engines.base import Engine
from core.models.tiny_gpt import TinyGPT
from core.reporting.line_writer import LineWriter
from core.reporting.memory import StageMemory, speed_metrics, tiny_gpt_flops
from core.state import TrainState

logger = logging.getLogger(__name__)

EXIT_SAVE_TIMEOUT_S = 300.0
"""How long a run that is failing waits for a background save in flight to commit."""


def plan_steps(config: Config, sampler: ResumableDistributedSampler) -> tuple[int, int]:
    """(optimizer steps per epoch, total optimizer steps); max_steps wins over num_epochs."""
    tc = config.train
    per_epoch = math.ceil(
        sampler.batches_per_epoch(config.data.drop_last) / tc.gradient_accumulation_steps
    )
    if per_epoch == 0:
        raise ValueError("an epoch holds no batch; lower train.per_device_batch_size")
    return per_epoch, tc.max_steps or (tc.num_epochs or 0) * per_epoch


class TrainLoop:
    """Runs `config.train` over `dataset` with `engine`; `state` and `sampler` are Stateful."""

    def __init__(
        self,
        config: Config,
        engine: Engine,
        dataset: Dataset[Any],
        sampler: ResumableDistributedSampler,
        collate_fn: Callable[[list[Any]], Any],
        lengths: np.ndarray | None,
        dist_info: DistInfo,
        callbacks: list[TrainerCallback] | None = None,
        state: TrainState | None = None,
        checkpointer: RunCheckpointer | None = None,
        stop_requested: Callable[[], bool] | None = None,
        evaluator: Callable[[], dict[str, float] | None] | None = None,
        memory: StageMemory | None = None,
        writer: LineWriter | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.dataset = dataset
        self.sampler = sampler
        self.collate_fn = collate_fn
        # Per-sample token counts, when the dataset tells them (tokens_seen stays 0 otherwise).
        # A token store's (all seq_len) comes as an object, not an array of N entries.
        self.lengths = (
            lengths
            if lengths is None or hasattr(lengths, "seq_len")
            else np.asarray(lengths, dtype=np.int64)
        )
        # Tokens per sample when all samples hold as many (packed data, a token store): a
        # step's count is then a product, not a sum over its ids in the epoch's order.
        self._uniform_length = uniform_length(self.lengths)
        self.dist = dist_info
        self.state = state or TrainState()
        self.control = TrainerControl()
        self.checkpointer = checkpointer
        self.stop_requested = stop_requested
        self.evaluator = evaluator
        self.memory = memory or StageMemory(engine.device)
        self.writer = writer
        """The reporters' background line writer: drained before a save and on the way out."""
        self.summary: dict[str, float] = {}
        """Speed, memory and FLOPs of the last train(), also the last line of metrics.jsonl."""
        self.preempted = False
        """True when training stopped on a stop request (a signal) and checkpointed."""
        self.callbacks = CallbackHandler(callbacks or [])
        self.steps_per_epoch, self.total_steps = plan_steps(config, sampler)
        self._drawn: deque[int] | None = None
        if config.run.log_level == "debug" and isinstance(sampler, ResumableDistributedSampler):
            # Sample accounting: every step logs the global sample ids all ranks drew.
            self._drawn = deque()
        if checkpointer is not None:
            checkpointer.extra_state = self.callbacks.stateful  # callbacks with state resume too
        self._fire("on_init_end")

    # -- the loop ----------------------------------------------------------------------------
    def train(self) -> TrainState:
        state, control = self.state, self.control
        if self.checkpointer is not None:
            self.checkpointer.prepare()  # resume (or not) before anything reads the state
        self.start_step = state.global_step
        state.per_device_batch_size = self.config.train.per_device_batch_size
        state.gradient_accumulation_steps = self.config.train.gradient_accumulation_steps
        start = (time.perf_counter(), state.samples_seen, state.tokens_seen)
        self.engine.train()
        self._fire("on_train_begin")
        self._last_log = (time.perf_counter(), state.global_step)
        if self.sampler.epoch != state.epoch:
            self.sampler.set_epoch(state.epoch)
        try:
            with self.memory.stage("train"):
                while state.global_step < self.total_steps and not control.should_training_stop:
                    before = (state.global_step, state.epoch)
                    self._train_epoch()
                    if (state.global_step, state.epoch) == before and not self.preempted:
                        raise RuntimeError(
                            f"epoch {state.epoch} holds no optimizer step from position "
                            f"{self.sampler.position} of {self.sampler.total_size}"
                        )
            if self.checkpointer is not None:
                # The final checkpoint (waiting for one in flight), or that wait alone.
                self._save(final=True, skip=self.checkpointer.last_saved_step == state.global_step)
        except BaseException:
            if self.writer is not None:
                self.writer.close(quiet=True)  # the lines before the error, then its messages
            if self.checkpointer is not None:
                self.checkpointer.close(timeout=EXIT_SAVE_TIMEOUT_S)
            raise
        if self.checkpointer is not None and self.config.checkpoint.load_best_model_at_end:
            self.checkpointer.load_best_model()
        self._summarise(*start)
        self._fire("on_train_end")
        return state

    def _summarise(self, t0: float, samples0: int, tokens0: int) -> None:
        state = self.state
        tokens = state.tokens_seen - tokens0 if self.lengths is not None else None
        self.summary = {
            **speed_metrics(
                "train",
                t0,
                state.samples_seen - samples0,
                state.global_step - self.start_step,
                tokens,
            ),
            **self.memory.metrics(),
        }
        m, model = self.config.model, self.engine.model
        if isinstance(model, TinyGPT) and self.lengths is not None:
            n_params = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
            self.summary["total_flos"] = tiny_gpt_flops(
                n_params, m.n_layer, m.n_embd, self.config.data.seq_len, state.tokens_seen
            )
        self._fire("on_log", logs={"step": state.global_step, **self.summary})

    def _train_epoch(self) -> None:
        """Optimizer steps from the sampler's position to the end of its epoch (or a stop)."""
        state = self.state
        self.control.reset_epoch()
        self._fire("on_epoch_begin")
        loader = make_dataloader(
            self.dataset,
            self.sampler,
            self.collate_fn,
            self.config.data.num_workers,
            self.config.data.drop_last,
            self.config.run.seed,
            self.dist.rank,
            pin_memory=self.engine.device.type == "cuda",
            drawn=self._drawn,
        )
        order = self.sampler.epoch_order()
        if self._drawn is not None:
            self._drawn.clear()  # ids a previous epoch's loader prefetched
        batches = iter(loader)
        for step_sizes in self._steps_left_in_epoch():
            if state.global_step >= self.total_steps:
                break
            epoch = state.epoch
            try:
                self._train_step(batches, step_sizes, order)
            except StopIteration:  # an iterable dataset ran out: its epoch ends here
                self._end_stream_epoch()
                return
            self._fire("on_step_end")
            if state.epoch != epoch:
                self._fire("on_epoch_end")
            if self._after_step():
                break

    def _end_stream_epoch(self) -> None:
        # Every rank runs out at the same micro-batch (the stream is dealt in whole groups),
        # so all drop the same partial step's gradients.
        self.engine.optimizer.zero_grad(set_to_none=True)
        self.state.epoch += 1
        self.sampler.set_epoch(self.state.epoch)
        self._fire("on_epoch_end")

    def _after_step(self) -> bool:
        """Agree across ranks on stop/save/eval requests, evaluate and checkpoint when due;
        True to stop."""
        control, step = self.control, self.state.global_step
        signalled = self.stop_requested is not None and self.stop_requested()
        save_failed = False
        if self.checkpointer is not None:
            committed, save_failed = self.checkpointer.poll()
            self._report_saves(committed)
        # One collective, so every rank stops, evaluates and saves at the same step, and a
        # background save that failed anywhere fails the run everywhere at this step.
        signalled, stop, save, evaluate, save_failed, lost = any_rank(
            [
                signalled,
                control.should_training_stop,
                control.should_save,
                control.should_evaluate,
                save_failed,
                self._lease_lost(),
            ]
        )
        if lost:
            raise self.checkpointer.lease_lost_error(step)
        if save_failed:
            self.checkpointer.raise_failure()
        if not signalled and (evaluate or self._eval_due()):
            signalled = self.evaluate() is None  # None: a stop request arrived mid-evaluation
        save_steps = self.config.checkpoint.save_steps
        due = bool(save_steps) and step % save_steps == 0
        if signalled:
            self._drain_lines()
            logger.warning("stop requested: checkpointing at step %d", step)
            self.preempted = True
        control.should_training_stop = stop or signalled or control.should_training_stop
        if self.checkpointer is not None and (due or save or signalled):
            self._save()
        control.reset_step()
        return control.should_training_stop

    def _lease_lost(self) -> bool:
        return self.checkpointer is not None and self.checkpointer.lease_lost()

    def _eval_due(self) -> bool:
        ec = self.config.eval
        if self.evaluator is None or ec.strategy == "no":
            return False
        if ec.strategy == "epoch":
            return self.sampler.position == 0  # the step just finished an epoch
        return self.state.global_step % (ec.steps or self.config.train.logging_steps) == 0

    def evaluate(self) -> dict[str, float] | None:
        """Evaluate now (every rank); log and report the metrics. None if a stop request
        interrupted the evaluation."""
        if self.evaluator is None:
            raise ValueError("no evaluation dataset: pass eval_dataset or set eval.strategy")
        self._drain_lines()  # the steps' lines come before what the evaluation logs
        with self.memory.stage("eval"):
            metrics = self.evaluator()
        if metrics is None:
            return None
        step = self.state.global_step
        record = {
            "step": step,
            "epoch": self._epoch_progress(),
            **metrics,
        }
        self.state.log_history.append(record)
        self.engine.schedule.observe(metrics[self._metric_name()])
        if self.checkpointer is not None:
            self.checkpointer.last_eval = (step, metrics)
        self._fire("on_log", logs=record)
        self._fire("on_evaluate", metrics=metrics)
        return metrics

    def _epoch_progress(self) -> float:
        """Epoch plus the fraction of it consumed (a stream's length is unknown: no fraction)."""
        if self.sampler.total_size >= ENDLESS:
            return float(self.state.epoch)
        return self.state.epoch + self.sampler.position / self.sampler.total_size

    def _metric_name(self) -> str:
        return self.config.checkpoint.best_metric or "eval_loss"

    def _save(self, final: bool = False, skip: bool = False) -> None:
        """Checkpoint now (with async_save, stage and return unless `final`); `skip`: only
        wait for the save in flight. Fires on_save for every save that committed."""
        assert self.checkpointer is not None
        # The lines of the steps this checkpoint holds are written before it commits: a resume
        # truncates metrics.jsonl to its step and appends from there.
        self._drain_lines()
        with self.memory.stage("save"):
            if skip:
                committed = self.checkpointer.wait()
            else:
                committed = self.checkpointer.save(final=final)
        self._report_saves(committed)

    def _drain_lines(self) -> None:
        if self.writer is not None:
            self.writer.drain()

    def _report_saves(self, committed: list[SaveOutcome]) -> None:
        if committed and self._lease_lost():
            return  # the run's history is the new holder's; every rank stops at the next step
        for outcome in committed:
            self._fire("on_save", path=outcome.location, seconds=outcome.seconds)

    def _steps_left_in_epoch(self) -> Iterator[list[int]]:
        """Per-rank micro-batch sizes of each optimizer step left in the epoch, as the
        DataLoader yields them (lazily: a stream's epoch has no known end)."""
        remaining, b = len(self.sampler), self.sampler.batch_size
        full, rest = divmod(remaining, b)
        count = full + (1 if rest and not self.config.data.drop_last else 0)
        accum, done = self.config.train.gradient_accumulation_steps, 0
        while done < count:
            n = min(accum, count - done)
            yield [b if done + k < full else rest for k in range(n)]
            done += n

    def _train_step(self, batches: Iterator[Any], sizes: list[int], order: np.ndarray) -> None:
        state, engine = self.state, self.engine
        if self.checkpointer is not None:
            self.checkpointer.check_rng()  # first step after a resume: RNG must be untouched
        step = state.global_step + 1
        will_log = step % self.config.train.logging_steps == 0 or step == self.total_steps
        lr = engine.schedule.last_lr() if will_log else 0.0  # before the step: what it trains with
        self._fire("on_step_begin")
        losses = []
        for i, _ in enumerate(sizes):
            batch = next(batches)
            last = i == len(sizes) - 1
            with engine.accumulate(sync=last):
                loss = engine.forward(batch)
                engine.backward(loss, len(sizes))
            if will_log:
                losses.append(loss.detach())
            if not last:
                self._fire("on_substep_end")
        # The engine clips, steps and zeroes in one call (DeepSpeed's step does all three), so
        # on_pre_optimizer_step comes before clipping and on_optimizer_step after zero_grad.
        self._fire("on_pre_optimizer_step")
        grad_norm = engine.optimizer_step(self.config.train.max_grad_norm)
        self._fire("on_optimizer_step")

        consumed = sum(sizes) * self.dist.world_size
        start = self.sampler.position
        if self._uniform_length is not None:
            state.tokens_seen += min(consumed, len(order) - start) * self._uniform_length
        elif self.lengths is not None:
            state.tokens_seen += int(self.lengths[order[start : start + consumed]].sum())
        state.samples_seen += consumed
        self.sampler.advance(consumed)
        state.global_step = step
        if self.sampler.position >= self.sampler.total_size:
            # Move to the next epoch at once, so a checkpoint after an epoch's last step has
            # one form (next epoch, position 0) wherever it is taken.
            state.epoch += 1
            self.sampler.set_epoch(state.epoch)
        if will_log:
            self._log(losses, grad_norm, lr)
        if self._drawn is not None:
            self._log_sample_ids(step, sum(sizes))

    def _log_sample_ids(self, step: int, count: int) -> None:
        """Debug: the sample ids every rank drew for this step (a gather), logged by rank 0."""
        mine = [self._drawn.popleft() for _ in range(count)]
        ranks: list[list[int]] = [mine]
        if self.dist.world_size > 1:
            ranks = [[] for _ in range(self.dist.world_size)]
            dist.all_gather_object(ranks, mine)
        logger.debug("step %d sample ids %s", step, json.dumps(ranks))

    # -- logging -----------------------------------------------------------------------------
    def _log(self, losses: list[torch.Tensor], grad_norm: torch.Tensor | None, lr: float) -> None:
        state = self.state
        # Whether rank 0 lost the run's lease rides with the loss (nothing is reported then:
        # the run's files are another job's).
        lost = self._lease_lost()
        if self.dist.world_size == 1 and len(losses) == 1:
            # What the float64 sum below gives for one loss (widening is exact; + 0.0 maps -0.0
            # to 0.0 as the sum does), minus four tensor ops on every logged step.
            loss = losses[0].item() + 0.0
        else:
            # One collective carries the loss and the flag; float64 keeps the sum over ranks
            # exact and ordered.
            total = torch.stack(losses).to(torch.float64).sum().reshape(1)
            if self.dist.world_size > 1:
                total = torch.cat([total, total.new_tensor([float(lost)])])
                dist.all_reduce(total)
            loss_sum, *flag = total.tolist()
            lost = bool(flag[0]) if flag else lost
            loss = loss_sum / (self.dist.world_size * len(losses))
        if lost:
            raise self.checkpointer.lease_lost_error(state.global_step)
        now = time.perf_counter()
        t0, s0 = self._last_log
        self._last_log = (now, state.global_step)
        logs: dict[str, Any] = {
            "step": state.global_step,
            "loss": loss,
            "lr": lr,
            "epoch": self._epoch_progress(),
            "samples": state.samples_seen,
            "step_time_s": (now - t0) / max(1, state.global_step - s0),
        }
        if self.lengths is not None:
            logs["tokens"] = state.tokens_seen
        if grad_norm is not None:
            logs["grad_norm"] = grad_norm.item()
        if self.evaluator is None or self.config.eval.strategy == "no":
            self.engine.schedule.observe(loss)  # with evaluation, the eval metric is observed
        state.log_history.append(logs)
        self._fire("on_log", logs=logs)

    def _fire(self, event: str, **kwargs: Any) -> None:
        self.callbacks.fire(event, self.config, self.state, self.control, **kwargs)
