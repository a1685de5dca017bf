"""The only place that reads torchrun's environment and owns the process group."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import io
import logging
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

# Imported before any group exists, on purpose: its functions take `group=group.WORLD` as a
# default, evaluated at import. Imported later (DDP pulls it in on first use, through
# torch.distributed._shard), ten defaults would hold the world group past its destruction and
# keep gloo's threads alive into interpreter shutdown (see destroy_distributed).
import torch.distributed.nn.functional

from checkpointing.comm import reset_control_group
from core.config import EngineConfig
from core.loop import DistInfo
from launcher.agent import record_exit

logger = logging.getLogger(__name__)
_HAD_GROUP = False  # whether destroy_distributed tore a group down (exit_worker)


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
    """Tear the groups down. After a clean finish all ranks meet first, so no rank closes its
    connections while a peer is still using them; after an error a peer may be gone.

    The caller must have dropped whatever holds a group (an engine, a DDP wrapper; DeepSpeed's
    group cache goes through DeepSpeed's own destroy): the last reference to each C++ group then
    goes here, and its destructor joins gloo's worker threads now, not at interpreter shutdown
    (see exit_worker). Some libraries keep a group anyway (DeepSpeed's engine through hooks it
    registers, FSDP2 through torch internals): those are logged at debug level."""
    global _HAD_GROUP
    gc.collect()
    if dist.is_initialized():
        _HAD_GROUP = True
        if clean:
            dist.barrier()
        world = getattr(dist.distributed_c10d, "_world", None)  # every group, subgroups too
        groups = [weakref.ref(g) for g in getattr(world, "pg_map", {})]
        deepspeed_comm = sys.modules.get("deepspeed.comm")
        if deepspeed_comm is not None and deepspeed_comm.is_initialized():
            deepspeed_comm.destroy_process_group()  # also forgets the groups DeepSpeed cached
        else:
            dist.destroy_process_group()
        reset_control_group()
        gc.collect()
        alive = sum(ref() is not None for ref in groups)
        if alive:
            logger.debug("%d process group(s) still referenced after the teardown", alive)


EARLY_END_WAIT_S = 30.0
"""How long a torchrun worker that fails before the process group exists waits for its peers."""


def await_peers_ending_early(timeout_s: float = EARLY_END_WAIT_S) -> bool:
    """Under torchrun, for a worker that fails before any process group (a bad config, an
    unwritable run directory): wait until every worker of the job came to such an end, or
    `timeout_s`. torchrun stops all workers once the first one exits: without this, a peer that
    exits first gets rank 0, which alone logs the reason, stopped before it says why (the job
    fails without a word), and `python -m launcher.agent` sees workers that did not agree.

    The workers meet on torchrun's own store (the agent hosts it), under a key of this attempt;
    without an agent store (or after any error reaching it) there is nothing to wait on.
    True when it waited on the store (the workers end at about the same moment)."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    if world < 2 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    key = f"launcher/ended-before-group/{env.get('TORCHELASTIC_RUN_ID')}/{env_restart_count()}"
    try:
        store = dist.TCPStore(
            env["MASTER_ADDR"],
            int(env["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        ended = store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        while ended < world and time.monotonic() < deadline:
            time.sleep(0.05)
            ended = store.add(key, 0)
    except Exception as e:  # torchrun's store: gone or unreachable, nobody to wait for
        logger.debug("waiting for the other workers: %s: %s", type(e).__name__, e)
        return False
    return True


def exit_worker(code: int) -> NoReturn:
    """End the process with `code`. One that never had a process group exits as usual, its
    objects left out of the teardown's garbage collection. One that had a group, or that met its
    peers to end early (await_peers_ending_early), skips the
    interpreter's own teardown, once everything Python-level is done (non-daemon threads
    joined, atexit handlers run: logging flushed, temporary files removed, child processes
    reaped; open files flushed).

    Why: gloo's worker threads outlive `destroy_process_group` while anything still references
    the group. A thread that releases a finished collective's tensors just after Python began
    finalising asks for the GIL, is made to exit inside a C++ destructor, and the whole process
    aborts ("terminate called without an active exception", SIGABRT) after a run that
    succeeded: 3 of 64 two-rank exits of tests/fsdp_worker.py on a loaded 2-core machine. Past
    this point nothing is left to run but that teardown (every checkpoint is fsynced and
    committed before training returns), so it is skipped.

    The code is first recorded for `python -m launcher.agent` (launcher/agent.py)."""
    record_exit(code)
    # Peers that met before ending (await_peers_ending_early) leave together, quickly: a teardown
    # still running when torchrun sees the first exit would be ended by its SIGTERM.
    met = code != 0 and not (_HAD_GROUP or dist.is_initialized()) and await_peers_ending_early()
    if not (_HAD_GROUP or dist.is_initialized() or met):
        # The teardown runs, minus the collector's walks over every object torch and datasets
        # made (1.3 s of CPU after a tiny run), which only free memory the OS frees anyway.
        gc.freeze()
        sys.exit(code)
    main = threading.main_thread()
    for t in threading.enumerate():
        if t is not main and not t.daemon:
            t.join()  # what the interpreter's shutdown would wait for
    atexit._run_exitfuncs()
    # A file object left open would have been flushed as the interpreter freed it. (Objects
    # frozen after the imports, launcher/__main__.py, are not listed: files the run opened are.)
    # (By type: isinstance would ask each object for __class__, and some warn when asked.)
    files = [o for o in gc.get_objects() if issubclass(type(o), io.IOBase)]
    for f in [*files, sys.stdout, sys.stderr]:
        with contextlib.suppress(Exception):
            if not f.closed:
                f.flush()
    os._exit(code)
