"""DistInfo, the plain values the launcher hands core about this process (`core.loop` re-exports
it, where it was first defined)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands, as plain values (the launcher reads the environment)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    restart_count: int = 0
    """How many times torchrun restarted the worker group before this process."""
    job: str | None = None
    """What stays the same when torchrun restarts the workers of one job (its run id and agent
    pid); None without torchrun. A restarted worker keeps its job's lease on the run."""
    job_id: str | None = None
    """The scheduler's job id (Slurm, Kubernetes pod, torchrun run id), named in the lease."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0
