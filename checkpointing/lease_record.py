"""The run lease's records and names (checkpointing/lease.py takes and holds the lease): the
`LEASE` copy and the `.lease/<epoch>` claims, their JSON format, parsed strictly (a file that is
not a lease is treated as held, never deleted), and how to read the deciding record."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from checkpointing.holder import Holder
from checkpointing.storage import Storage

LEASE = "LEASE"
CLAIMS = ".lease"
FORMAT = 1
MAX_BYTES = 1 << 16
"""A lease file larger than this is not one (never read whole into memory)."""


class LeaseError(Exception):
    """This job may not write the run (launcher exit code 73)."""


class LeaseHeld(LeaseError):
    """Another job holds the run's lease (after waiting for it)."""


class LeaseLost(LeaseError):
    """This job's lease was taken over: it commits and deletes nothing more."""


class LeaseUnreadable(LeaseError):
    """A lease file that is not a lease this code knows: treated as held, never deleted."""


def claim_name(epoch: int) -> str:
    return f"{CLAIMS}/{epoch}"


@dataclass(frozen=True)
class LeaseRecord:
    epoch: int
    holder: Holder
    heartbeat: float
    """Unix time of the last renewal."""
    timeout_s: float
    """The holder's lease timeout, for readers such as `status`."""
    released: bool = False
    format: int = FORMAT

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self), indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def parse(cls, data: bytes, where: str) -> LeaseRecord:
        try:
            if len(data) > MAX_BYTES:
                raise ValueError(f"{len(data)} bytes")
            raw = json.loads(data)
            if not isinstance(raw, dict) or raw.get("format") != FORMAT:
                raise ValueError(f"format {raw.get('format') if isinstance(raw, dict) else raw!r}")
            holder = Holder(**raw["holder"])
            record = cls(**{**raw, "holder": holder})
            for value, types, what in (
                (record.epoch, int, "epoch"),
                (record.heartbeat, (int, float), "heartbeat"),
                (record.timeout_s, (int, float), "timeout_s"),
                (record.released, bool, "released"),
                (holder.host, str, "holder.host"),
                (holder.pid, int, "holder.pid"),
                (holder.pid_start, (int, type(None)), "holder.pid_start"),
                (holder.job, (str, type(None)), "holder.job"),
                (holder.job_id, (str, type(None)), "holder.job_id"),
                (holder.started, (int, float), "holder.started"),
            ):
                bad_bool = isinstance(value, bool) and types is not bool
                if not isinstance(value, types) or bad_bool:
                    raise ValueError(f"{what} {value!r}")
            if record.epoch < 1 or holder.pid < 1:
                raise ValueError(f"epoch {record.epoch}, pid {holder.pid}")
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise LeaseUnreadable(
                f"{where} is not a lease this version reads ({type(e).__name__}: {e}); it is "
                f"treated as held. If no job writes this run, delete it by hand"
                f"{' with the .lease folder beside it' if where.endswith(LEASE) else ''} "
                "and relaunch"
            ) from e
        return record

    def age(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.heartbeat

    def free(self, timeout_s: float, now: float | None = None) -> str | None:
        """Why this lease may be taken (None: it is held)."""
        if self.released:
            return "released"
        if self.holder.gone():
            return f"process {self.holder.pid} is gone"
        if self.age(now) > timeout_s:
            return f"heartbeat {self.age(now):.1f} s old > run.lease_timeout_s {timeout_s:g}"
        return None

    def describe(self, now: float | None = None) -> str:
        state = "released" if self.released else f"last heartbeat {self.age(now):.1f} s ago"
        return f"epoch {self.epoch} held by {self.holder.describe()}, {state}"


def read_lease(storage: Storage) -> LeaseRecord | None:
    """The deciding lease record of a store (None: never leased). LeaseUnreadable for a file
    that is not a lease."""
    copy = _read_record(storage, LEASE) if storage.exists(LEASE) else None
    epoch = copy.epoch if copy is not None else 0
    while storage.exists(claim_name(epoch + 1)):
        epoch += 1
    if epoch == 0:
        return None
    name = claim_name(epoch)
    if not storage.exists(name):  # the claims were removed by hand: the copy decides
        return copy
    return _read_record(storage, name)


def _read_record(storage: Storage, rel: str) -> LeaseRecord:
    where = storage.display(rel)
    try:
        if storage.size(rel) > MAX_BYTES:
            return LeaseRecord.parse(b" " * (MAX_BYTES + 1), where)  # raises LeaseUnreadable
        data = storage.read_bytes(rel)
    except (IsADirectoryError, NotADirectoryError) as e:
        raise LeaseUnreadable(
            f"{where} is not a lease file ({type(e).__name__}); it is treated as held. If no "
            "job writes this run, delete it by hand and relaunch"
        ) from e
    return LeaseRecord.parse(data, where)
