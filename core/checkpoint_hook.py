"""The loop's one checkpoint hook, in the spirit of torchtitan's `checkpointer.save(step,
last_step)`: restore before the first step, and after every step agree with the other ranks on
stop and save requests, fail on a lost lease or a failed background save, and save when due
(checkpoint.save_steps), when asked, or when a stop request arrived. The save rules live here,
not in the loop."""

from __future__ import annotations

import logging
from collections.abc import Callable

from checkpointing.staging import SaveOutcome
from core.agreement import StepRequests
from core.callbacks import TrainerControl
from core.checkpoint import RunCheckpointer
from core.reporting.memory import StageMemory
from core.reporting.step_log import Fire, StepLog

logger = logging.getLogger(__name__)

EXIT_SAVE_TIMEOUT_S = 300.0
"""How long a run that is failing waits for a background save in flight to commit."""


class CheckpointHook:
    def __init__(
        self,
        checkpointer: RunCheckpointer,
        log: StepLog,
        fire: Fire,
        memory: StageMemory,
        stop_requested: Callable[[], bool] | None = None,
    ) -> None:
        self.checkpointer = checkpointer
        self.log = log
        self.fire = fire
        self.memory = memory
        self.stop_requested = stop_requested
        self.save_steps = checkpointer.config.checkpoint.save_steps
        self.preempted = False
        """True once a stop request (a signal) stopped the run and it checkpointed."""

    def restore(self) -> None:
        """Before the first step: the planned checkpoint (or a fresh start)."""
        self.checkpointer.restore()

    def requests(self, step: int, control: TrainerControl) -> StepRequests:
        """What all ranks ask for after `step` (one collective); raises on every rank at the
        same step when any rank lost the lease or had a background save fail."""
        committed, failed = self.checkpointer.poll()
        self._report(committed)
        mine = StepRequests(
            signalled=self.stop_requested is not None and self.stop_requested(),
            stop=control.should_training_stop,
            save=control.should_save,
            evaluate=control.should_evaluate,
            save_failed=failed,
            lease_lost=self.checkpointer.lease_lost(),
        )
        agreed = mine.agreed()
        if agreed.lease_lost:
            raise self.checkpointer.lease_lost_error(step)
        if agreed.save_failed:
            self.checkpointer.raise_failure()
        return agreed

    def step_end(self, step: int, agreed: StepRequests) -> bool:
        """Save when due, asked or signalled; True when the run stops here."""
        if agreed.signalled:
            self.log.drain()
            logger.warning("stop requested: checkpointing at step %d", step)
            self.preempted = True
        due = bool(self.save_steps) and step % self.save_steps == 0
        if due or agreed.save or agreed.signalled:
            self.save()
        return agreed.stop or agreed.signalled

    def end(self, step: int) -> None:
        """After the last step: the final checkpoint, or the wait for the one in flight."""
        self.save(final=True, skip=self.checkpointer.last_saved_step == step)

    def load_best(self) -> None:
        if self.checkpointer.config.checkpoint.load_best_model_at_end:
            self.checkpointer.load_best_model()

    def abort(self) -> None:
        """On the way out after an error: give a save in flight its time to commit."""
        self.checkpointer.close(timeout=EXIT_SAVE_TIMEOUT_S)

    def lease_lost(self) -> bool:
        return self.checkpointer.lease_lost()

    def lease_lost_error(self, step: int) -> Exception:
        return self.checkpointer.lease_lost_error(step)

    def save(self, final: bool = False, skip: bool = False) -> None:
        """Checkpoint now (with async_save, stage and return unless `final`); `skip`: only
        wait for the save in flight. Fires on_save for every save that committed."""
        # The lines of the steps this checkpoint holds are written before it commits: a resume
        # truncates metrics.jsonl to its step and appends from there.
        self.log.drain()
        with self.memory.stage("save"):
            committed = self.checkpointer.wait() if skip else self.checkpointer.save(final=final)
        self._report(committed)

    def _report(self, committed: list[SaveOutcome]) -> None:
        if committed and self.checkpointer.lease_lost():
            return  # the run's history is the new holder's; every rank stops at the next step
        for outcome in committed:
            self.fire("on_save", path=outcome.location, seconds=outcome.seconds)
