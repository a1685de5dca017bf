"""One writer per run: an exclusive, fenced lease on a checkpoint store.

Files, beside the checkpoints:

    LEASE             the current lease as JSON (holder, epoch, heartbeat): what people and
                      `python -m launcher status` read
    .lease/<epoch>    one claim per epoch, created only if absent (`Storage.create_exclusive`:
                      link(2) on a filesystem, a conditional put on S3); its holder alone
                      rewrites it with each heartbeat

The claims decide: the holder is the one that created the highest epoch's claim. A job takes the
run by creating the claim of the next epoch, so of two jobs that try at once exactly one
succeeds; claims are never deleted, so a claim once seen stays visible and an epoch is never
handed out twice. `LEASE` is a copy the holder rewrites; a stale copy (written late by a holder
that was paused) never decides anything, since a reader always looks for higher claims.

A lease is free to take when it was released (a clean exit), when its holder's process is gone
(same host: the pid is dead or belongs to another process now), or when its heartbeat is older
than the timeout. A worker restarted by the same torchrun job adopts its own job's lease.

Fencing: before a commit marker is written, a checkpoint renamed into place or one deleted, the
holder checks that no higher claim exists; a job that lost its lease raises LeaseLost and
commits nothing more. What remains is the instant between that check and the write: a process
frozen exactly there and resumed after a takeover can still complete that one write. Stores give
no fencing token that closes it (see docs/checkpoints.md).

Heartbeats carry wall-clock time: hosts that share a run need clocks synchronised to well under
the timeout (NTP does this). The records, their names and their strict parsing are in
checkpointing/lease_record.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from checkpointing.holder import Holder
from checkpointing.lease_record import (
    CLAIMS,
    LEASE,
    LeaseError,
    LeaseHeld,
    LeaseLost,
    LeaseRecord,
    LeaseUnreadable,
    claim_name,
    read_lease,
)
from checkpointing.retry import StorageError, retrying
from checkpointing.storage import Storage

logger = logging.getLogger(__name__)

POLL_S = 2.0
"""How often a waiting job looks at the lease again."""


@dataclass
class Lease:
    """This job's lease on a store. Rank 0 (`primary`) renews it on a thread; every rank can
    check it before writing."""

    storage: Storage
    record: LeaseRecord
    primary: bool
    waited: bool = False
    """Whether another job held the run when this one came (`acquire` waited for it)."""
    _lost: str | None = None
    _renewed: float = field(default_factory=time.monotonic)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _lose_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def epoch(self) -> int:
        return self.record.epoch

    @property
    def lost(self) -> bool:
        """True once this job knows it lost the lease (no store access: a flag)."""
        return self._lost is not None

    def check(self, what: str) -> None:
        """Raise LeaseLost unless this job still holds the lease; call right before `what`."""
        newer = claim_name(self.epoch + 1)
        if self._lost is None and retrying(
            f"checking the lease of {self.storage.display()} before {what}",
            lambda: self.storage.exists(newer),
            self.storage.retries,
        ):
            self._lose(f"the run was taken over (a claim of epoch {self.epoch + 1} exists)")
        if self._lost is not None:
            raise LeaseLost(f"not {what}: {self._lost}")

    def confirm(self) -> bool:
        """False once this job knows it lost the lease. Costs a clock read, except on rank 0
        when the last renewal is older than half the timeout (the process was frozen, or the
        store is slow): then it renews first, so a job resumed after a takeover learns it now."""
        stale = time.monotonic() - self._renewed > self.record.timeout_s / 2
        if self._lost is None and self.primary and stale:
            try:
                self.renew()
            except LeaseLost:
                pass
            except Exception as e:  # the store: the heartbeat thread gives up at the timeout
                logger.warning("renewing the lease: %s: %s", type(e).__name__, e)
        return self._lost is None

    @property
    def why_lost(self) -> str | None:
        return self._lost

    def _lose(self, why: str) -> None:
        newer = None
        try:
            newer = read_lease(self.storage)
        except Exception:  # only for the message: the store may be what failed
            pass
        by = f"; now {newer.describe()}" if newer and newer.epoch > self.epoch else ""
        with self._lose_lock:  # the heartbeat and a commit may find out at once: say it once
            if self._lost is not None:
                return
            self._lost = f"lease epoch {self.epoch} of {self.storage.display()} lost: {why}{by}"
        logger.error("%s", self._lost)

    # -- rank 0 ------------------------------------------------------------------------------
    def _write(self, record: LeaseRecord) -> None:
        self.storage.replace_bytes(claim_name(record.epoch), record.to_bytes())
        self.storage.replace_bytes(LEASE, record.to_bytes())

    def renew(self) -> None:
        """Check, then write a fresh heartbeat."""
        with self._lock:
            self.check("renewing the lease")
            self.record = replace(self.record, heartbeat=time.time())
            self._write(self.record)
            self._renewed = time.monotonic()

    def start(self) -> Lease:
        if self.primary:
            interval = max(0.05, self.record.timeout_s / 4)
            self._thread = threading.Thread(
                target=self._beat, args=(interval,), name="lease-heartbeat", daemon=True
            )
            self._thread.start()
        return self

    def _beat(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.renew()
            except LeaseLost:
                return
            except Exception as e:  # the store: retried at the next beat, until the timeout
                stale = time.monotonic() - self._renewed
                logger.warning("renewing the lease: %s: %s", type(e).__name__, e)
                if stale > self.record.timeout_s:
                    self._lose(f"not renewed for {stale:.0f} s (the store kept failing)")
                    return

    def release(self) -> None:
        """Stop renewing; on rank 0 mark the lease released so the next job takes it at once
        (nothing when it was lost: it is another job's now)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if not self.primary or self._lost is not None:
            return
        try:
            with self._lock:
                self.check("releasing the lease")
                self.record = replace(self.record, heartbeat=time.time(), released=True)
                self._write(self.record)
        except LeaseLost:
            return
        except Exception as e:  # the store: the lease expires by itself after the timeout
            logger.warning("releasing the lease: %s: %s", type(e).__name__, e)


def try_acquire(
    storage: Storage,
    holder: Holder,
    timeout_s: float,
    now: float | None = None,
    create: Callable[[str, bytes], bool] | None = None,
) -> Lease | LeaseRecord | LeaseUnreadable:
    """One attempt: this job's Lease (not started), or what blocks it. `create`: the
    create-if-absent to use (default the store's own)."""
    create = create or storage.create_exclusive
    for _ in range(8):  # another job may win each race; then look again
        try:
            current = read_lease(storage)
        except LeaseUnreadable as e:
            return e
        if current is not None and holder.same_job(current.holder) and not current.released:
            # torchrun restarted this job's workers: the job keeps its lease and epoch.
            mine = LeaseRecord(current.epoch, holder, time.time(), timeout_s)
            lease = Lease(storage, mine, primary=True)
            lease._write(mine)
            logger.info("lease epoch %d kept across the worker restart", mine.epoch)
            return lease
        why = "new" if current is None else current.free(timeout_s, now)
        if why is None:
            return current
        epoch = 1 if current is None else current.epoch + 1
        mine = LeaseRecord(epoch, holder, time.time(), timeout_s)
        if not create(claim_name(epoch), mine.to_bytes()):
            continue
        if storage.read_bytes(claim_name(epoch)) != mine.to_bytes():
            continue  # a store that ignored the condition, and another job wrote last
        storage.replace_bytes(LEASE, mine.to_bytes())
        if current is not None and not current.released:
            logger.warning(
                "took over the lease of %s (epoch %d) from %s: %s",
                storage.display(),
                epoch,
                current.holder.describe(),
                why,
            )
        return Lease(storage, mine, primary=True)
    return read_lease(storage) or LeaseUnreadable(f"{storage.display(LEASE)}: keeps changing")


def acquire(
    storage: Storage,
    holder: Holder,
    rank: int,
    timeout_s: float,
    wait_s: float,
    group: Any = None,
    sleep: Callable[[float], None] = time.sleep,
) -> Lease:
    """The run's lease for this job, on every rank (a collective): rank 0 takes it, waiting up
    to `wait_s` while another job holds it; LeaseHeld on every rank when it is still held."""
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        outcome: Any = None
        if rank == 0:
            try:
                found = _exclusive_or_advisory(storage, holder, timeout_s)
            except StorageError as e:
                found = e
            except OSError as e:  # not retried (a missing bucket, a refused permission)
                found = StorageError(f"taking the lease of {storage.display()}: {e}")
            if isinstance(found, StorageError):
                outcome = found
            elif isinstance(found, Lease):
                outcome = (found.record, said)
            else:
                blocker = str(found) if isinstance(found, LeaseUnreadable) else found.describe()
                if time.monotonic() >= deadline:
                    outcome = f"{storage.display()} is leased by another job: {blocker}"
                    if not isinstance(found, LeaseUnreadable):
                        outcome += (
                            f"; waited {wait_s:g} s (run.lease_wait_s). Relaunch once it has "
                            "finished, or wait longer"
                        )
                elif not said:
                    logger.warning("waiting up to %.0f s for the lease: %s", wait_s, blocker)
                    said = True
        # Imported here: torch comes with it, and `launcher status` reads leases without torch
        from checkpointing.comm import broadcast_object

        outcome = broadcast_object(outcome, group)
        if isinstance(outcome, StorageError):  # every rank exits 4 with rank 0's error
            raise outcome
        if isinstance(outcome, tuple):
            record, waited = outcome
            lease = found if rank == 0 else Lease(storage, record, primary=False)
            lease.waited = waited
            return lease.start()
        if isinstance(outcome, str):
            raise LeaseHeld(outcome)
        sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))


_warned_advisory: set[str] = set()


def _exclusive_or_advisory(
    storage: Storage, holder: Holder, timeout_s: float
) -> Lease | LeaseRecord | LeaseUnreadable:
    what = f"taking the lease of {storage.display()}"
    try:
        return retrying(what, lambda: try_acquire(storage, holder, timeout_s), storage.retries)
    except NotImplementedError:
        pass
    # A store without create-if-absent: look, then write. Two jobs starting in the same
    # instant can both believe they hold it; fencing still stops the one that is overwritten
    # at its next check only if its claim was replaced (not guaranteed). Said once.
    if storage.url not in _warned_advisory:
        _warned_advisory.add(storage.url)
        logger.warning(
            "%s has no create-if-absent: the lease is advisory (see docs/checkpoints.md)",
            storage.display(),
        )

    def look_then_write(rel: str, data: bytes) -> bool:
        if storage.exists(rel):
            return False
        storage.write_bytes(rel, data)
        return True

    return retrying(
        what,
        lambda: try_acquire(storage, holder, timeout_s, create=look_then_write),
        storage.retries,
    )


__all__ = [
    "CLAIMS",
    "LEASE",
    "Lease",
    "LeaseError",
    "LeaseHeld",
    "LeaseLost",
    "LeaseRecord",
    "LeaseUnreadable",
    "acquire",
    "claim_name",
    "read_lease",
    "try_acquire",
]
