"""A distributed session for the Python API: the process group, device and preemption flag that
`launcher.main` sets up, for a user script run under torchrun.

    from core.trainer import Trainer
    from launcher.session import session

    with session() as s:
        trainer = Trainer(model=..., args=config, dist_info=s.info, device=s.device,
                          stop_requested=s.stop)
        trainer.train()
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from core.config import EngineConfig
from core.loop import DistInfo
from launcher.dist import destroy_distributed, env_rank, init_distributed
from launcher.logs import setup_logging
from launcher.malloc import tune_glibc_malloc
from launcher.signals import StopFlag


@dataclass(frozen=True)
class Session:
    info: DistInfo
    device: torch.device
    stop: StopFlag


@contextmanager
def session(
    engine: EngineConfig | None = None, log_level: str = "info", full_determinism: bool = False
) -> Iterator[Session]:
    """Set up logging, the allocator, the process group (under torchrun) and the preemption
    signals; tear all of it down on every exit path."""
    setup_logging(env_rank(), log_level)
    tune_glibc_malloc()
    if full_determinism:
        # cuBLAS reads this when CUDA initialises, so it must be set before anything touches CUDA.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    ctx = init_distributed(engine or EngineConfig())
    stop = StopFlag().install()
    clean = False
    try:
        yield Session(ctx.info, ctx.device, stop)
        clean = True
    finally:
        stop.uninstall()
        destroy_distributed(clean=clean)
