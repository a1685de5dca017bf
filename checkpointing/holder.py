"""Who holds a run's lease (checkpointing/lease.py), and whether that process is gone."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass


def _proc_stat(pid: int) -> list[bytes] | None:
    """Fields 3... of /proc/<pid>/stat (Linux; None elsewhere or when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses.
    return stat[stat.rindex(b")") + 2 :].split()


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, to tell a reused pid."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields else None


@dataclass(frozen=True)
class Holder:
    """Who holds a lease."""

    host: str
    pid: int
    """The process that renews the lease (rank 0)."""
    pid_start: int | None
    job: str | None
    """What stays the same when torchrun restarts its workers (run id and agent pid); None
    outside torchrun."""
    job_id: str | None
    """The scheduler's job id, for people (Slurm, Kubernetes pod, torchrun run id)."""
    started: float

    @classmethod
    def this_process(cls, job: str | None = None, job_id: str | None = None) -> Holder:
        pid = os.getpid()
        return cls(socket.gethostname(), pid, _start_ticks(pid), job, job_id, time.time())

    def same_job(self, other: Holder) -> bool:
        return self.job is not None and self.job == other.job and self.host == other.host

    def gone(self) -> bool:
        """True when this holder's process is known to be dead (only on this host)."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        fields = _proc_stat(self.pid)
        if fields is None:
            return False  # no /proc: the pid exists, that is all we know
        if fields[0] in (b"Z", b"X"):  # exited, not yet reaped by its parent
            return True
        return self.pid_start is not None and int(fields[19]) != self.pid_start

    def describe(self) -> str:
        job = f", job {self.job_id}" if self.job_id else ""
        return f"{self.host} pid {self.pid}{job}"
