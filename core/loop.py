"""The inner training loop: epochs of optimizer steps of micro-batches, through an Engine.

It only trains: fetch, forward/backward over micro-batches, clip and step, then one call per
concern: the checkpoint hook (core/checkpoint_hook.py: restore, cross-rank requests, saves), the
validator (core/validator.py) and the step log (core/reporting/step_log.py). Host syncs happen
only on steps that log: other steps queue work and never call `.item()`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from core.callbacks import CallbackHandler, TrainerControl
from core.checkpoint_hook import CheckpointHook
from core.config import Config
from core.data.loader import make_dataloader
from core.data.sampler import ResumableDistributedSampler
from core.data.store_reader import uniform_length
from core.dist_info import DistInfo
from core.engines.base import Engine
from core.reporting.memory import StageMemory
from core.reporting.step_log import StepLog
from core.state import TrainState
from core.validator import Validator

logger = logging.getLogger(__name__)

__all__ = ["DistInfo", "TrainLoop"]


class TrainLoop:
    """Runs `config.train` over `dataset` with `engine`; `state` and `sampler` are Stateful.
    Built by core/run.py:build_trainer, which hands it its parts."""

    def __init__(
        self,
        config: Config,
        engine: Engine,
        dataset: Dataset[Any],
        sampler: ResumableDistributedSampler,
        collate_fn: Callable[[list[Any]], Any],
        lengths: np.ndarray | None,
        dist_info: DistInfo,
        state: TrainState,
        callbacks: CallbackHandler,
        control: TrainerControl,
        checkpoints: CheckpointHook,
        validator: Validator,
        log: StepLog,
        memory: StageMemory,
        total_steps: tuple[int, int],
    ) -> None:
        self.config, self.engine, self.dataset, self.sampler = config, engine, dataset, sampler
        self.collate_fn = collate_fn
        # Per-sample token counts, when the dataset tells them (tokens_seen stays 0 otherwise);
        # a token store's (all seq_len) comes as an object, not an array of N entries.
        as_array = lengths is not None and not hasattr(lengths, "seq_len")
        self.lengths = np.asarray(lengths, dtype=np.int64) if as_array else lengths
        # Tokens per sample when all samples hold as many (packed data, a token store): a
        # step's count is then a product, not a sum over its ids in the epoch's order.
        self._uniform_length = uniform_length(self.lengths)
        self.dist = dist_info
        self.state = state
        self.control = control
        self.callbacks = callbacks
        self.checkpoints = checkpoints
        self.checkpointer = checkpoints.checkpointer
        self.validator = validator
        self.log = log
        self.memory = memory
        self.steps_per_epoch, self.total_steps = total_steps
        self.summary: dict[str, float] = {}
        """Speed, memory and FLOPs of the last train(), also the last line of metrics.jsonl."""
        self.start_step = state.global_step
        self._drawn: deque[int] | None = None
        if config.run.log_level == "debug" and isinstance(sampler, ResumableDistributedSampler):
            self._drawn = deque()  # sample accounting: every step logs the ids all ranks drew
        self._fire("on_init_end")

    @property
    def preempted(self) -> bool:
        """True when training stopped on a stop request (a signal) and checkpointed."""
        return self.checkpoints.preempted

    # -- the loop ----------------------------------------------------------------------------
    def train(self) -> TrainState:
        state, control = self.state, self.control
        self.checkpoints.restore()  # the planned checkpoint, before anything reads the state
        self.start_step = state.global_step
        state.per_device_batch_size = self.config.train.per_device_batch_size
        state.gradient_accumulation_steps = self.config.train.gradient_accumulation_steps
        start = (time.perf_counter(), state.samples_seen, state.tokens_seen)
        self.engine.train()
        self._fire("on_train_begin")
        self.log.begin()
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
            self.checkpoints.end(state.global_step)
        except BaseException:
            self.log.close()
            self.checkpoints.abort()
            raise
        self.checkpoints.load_best()
        steps = state.global_step - self.start_step
        self.summary = self.log.summary(*start, steps)
        self._fire("on_train_end")
        return state

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
                self.train_step(batches, step_sizes, order)
            except StopIteration:  # an iterable dataset ran out: its epoch ends here
                self._end_stream_epoch()
                return
            self._fire("on_step_end")
            if state.epoch != epoch:
                self._fire("on_epoch_end")
            if self._step_end():
                break

    def _step_end(self) -> bool:
        """After a step: what the ranks ask for, evaluation when due, the checkpoint hook.
        True to stop."""
        step, control = self.state.global_step, self.control
        agreed = self.checkpoints.requests(step, control)
        epoch_ended = self.sampler.position == 0
        if not agreed.signalled and self.validator.due(step, agreed.evaluate, epoch_ended):
            agreed.signalled = self.validator.run(step) is None  # a stop came mid-evaluation
        control.should_training_stop |= self.checkpoints.step_end(step, agreed)
        control.reset_step()
        return control.should_training_stop

    def train_step(self, batches: Iterator[Any], sizes: list[int], order: np.ndarray) -> None:
        """One optimizer step over len(sizes) micro-batches."""
        state, engine = self.state, self.engine
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
        self._advance(sum(sizes) * self.dist.world_size, order)
        state.global_step = step
        # Whether any rank lost the run's lease rides with the loss (nothing is reported then).
        if will_log and self.log.step(losses, grad_norm, lr, self.checkpoints.lease_lost()):
            raise self.checkpoints.lease_lost_error(step)
        if self._drawn is not None:
            self.log.sample_ids(step, [self._drawn.popleft() for _ in range(sum(sizes))])

    def _advance(self, consumed: int, order: np.ndarray) -> None:
        """Count the step's samples and tokens, and move the sampler past them."""
        state, start = self.state, self.sampler.position
        if self._uniform_length is not None:
            state.tokens_seen += min(consumed, len(order) - start) * self._uniform_length
        elif self.lengths is not None:
            state.tokens_seen += int(self.lengths[order[start : start + consumed]].sum())
        state.samples_seen += consumed
        self.sampler.advance(consumed)
        if self.sampler.position >= self.sampler.total_size:
            # Move to the next epoch at once, so a checkpoint after an epoch's last step has
            # one form (next epoch, position 0) wherever it is taken.
            state.epoch += 1
            self.sampler.set_epoch(state.epoch)

    def _end_stream_epoch(self) -> None:
        # Every rank runs out at the same micro-batch (the stream is dealt in whole groups),
        # so all drop the same partial step's gradients.
        self.engine.optimizer.zero_grad(set_to_none=True)
        self.state.epoch += 1
        self.sampler.set_epoch(self.state.epoch)
        self._fire("on_epoch_end")

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

    def _fire(self, event: str, **kwargs: Any) -> None:
        self.callbacks.fire(event, self.config, self.state, self.control, **kwargs)
