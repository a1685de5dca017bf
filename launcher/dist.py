"""The only place that reads torchrun's environment and owns the process group."""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from checkpointing.comm import reset_control_group
from core.config import EngineConfig
from core.loop import DistInfo

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistContext:
    info: DistInfo
    device: torch.device
    backend: str | None  # None: a single process without a process group


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def env_restart_count() -> int:
    """torchrun's count of worker-group restarts so far (0 without torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def env_job() -> tuple[str | None, str | None]:
    """(job identity kept across torchrun's worker restarts, scheduler job id for people).

    A worker's parent is torchrun's agent, alive for the whole job: its pid and the rendezvous
    run id name the job. The `deepspeed` launcher restarts nothing; alone there is no job.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    job = f"{run_id}/{os.getppid()}" if run_id else None
    for var in ("SLURM_JOB_ID", "JOB_ID", "PBS_JOBID", "LSB_JOBID"):
        if os.environ.get(var):
            job_id = os.environ[var]
            break
    else:
        in_pod = os.environ.get("KUBERNETES_SERVICE_HOST") is not None
        job_id = (os.environ.get("HOSTNAME") if in_pod else None) or run_id
    return job, job_id


def _attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store, with a key prefix per torchrun restart attempt.

    torchrun --standalone keeps one agent store across restarts, and gloo finds its peers under
    keys that restart from the same names in every new process: without the prefix, a restarted
    worker can read a dead peer's address from the previous attempt and time out connecting
    (seen here: `connectFullMesh ... Connection refused`, 1 run in 3).
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=world_size,
        is_master=not agent_store and rank == 0,
        timeout=timeout,
        wait_for_workers=False,
    )
    return dist.PrefixStore(f"launcher/attempt-{env_restart_count()}", store)


def init_distributed(cfg: EngineConfig, timeout_s: float = 1800.0) -> DistContext:
    """Read RANK/WORLD_SIZE/LOCAL_RANK (set by torchrun), pick the device, init the group.

    Without torchrun's variables this is one process and no process group is created.
    """
    rank = env_rank()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("engine.device is cuda but CUDA is not available")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = None
    if "WORLD_SIZE" in os.environ:
        backend = cfg.backend if cfg.backend != "auto" else ("nccl" if use_cuda else "gloo")
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend=backend,
            store=_attempt_store(rank, world_size, timeout),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if backend == "nccl" else None,
        )
    info = DistInfo(rank, world_size, local_rank, env_restart_count(), *env_job())
    return DistContext(info, device, backend)


def destroy_distributed(clean: bool) -> None:
    """Tear the group down. After a clean finish all ranks meet first, so no rank closes its
    connections while a peer is still using them; after an error a peer may be gone."""
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
        reset_control_group()
