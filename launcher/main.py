"""`python -m launcher --config FILE [--section.key VALUE ...]`, alone or under torchrun."""

from __future__ import annotations

import argparse
import gc
import logging
import os
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from checkpointing.manifest import CheckpointError
from core.config import Config, ConfigError, dump_config, load_config
from core.data import DataError
from core.run import build_trainer
from launcher import exit_codes
from launcher.dist import DistContext, destroy_distributed, env_rank, init_distributed
from launcher.logs import setup_logging
from launcher.malloc import tune_glibc_malloc
from launcher.signals import StopFlag

logger = logging.getLogger("launcher")

USAGE_ERRORS = (ConfigError, DataError)


def parse_args(argv: list[str] | None) -> tuple[str | None, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m launcher",
        description="Train under torchrun with resumable checkpoints. Any config field can be "
        "overridden as --section.key VALUE (e.g. --train.max_steps 50).",
    )
    parser.add_argument("--config", help="YAML config file (default: configs/tiny.yaml)")
    args, overrides = parser.parse_known_args(argv)
    return args.config, overrides


def write_resolved_config(config: Config) -> None:
    out = Path(config.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_config(config))


@record
def main(argv: list[str] | None = None) -> int:
    rank = env_rank()
    setup_logging(rank)
    tune_glibc_malloc()
    try:
        config_path, overrides = parse_args(argv)
        config = load_config(config_path, overrides)
    except ConfigError as e:
        if rank == 0:
            logger.error("%s", e)
        return exit_codes.USAGE
    setup_logging(rank, config.run.log_level)
    if config.run.full_determinism:
        # cuBLAS reads this when CUDA initialises, so it must be set before anything touches CUDA.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    ctx = init_distributed(config.engine)
    stop = StopFlag().install()
    code = exit_codes.FAILURE
    try:
        code = train(config, ctx, stop)
        return code
    except USAGE_ERRORS as e:
        if ctx.info.is_main:
            logger.error("%s", e)
        return exit_codes.USAGE
    except CheckpointError as e:
        logger.error("%s", e)  # every rank: a self-check failure may be one rank's alone
        return exit_codes.CHECKPOINT
    except KeyboardInterrupt:
        logger.warning("interrupted")
        return exit_codes.INTERRUPTED
    finally:
        stop.uninstall()
        # The trainer (its DDP wrapper holds the process group) is gone once train() returned;
        # collect it now so the group's threads end before the group is destroyed.
        gc.collect()
        destroy_distributed(clean=code in (exit_codes.OK, exit_codes.PREEMPTED))


def train(config: Config, ctx: DistContext, stop: StopFlag) -> int:
    """Build and run the trainer; the exit code for a run that ended without an exception."""
    trainer = build_trainer(config, ctx.info, ctx.device, stop_requested=stop)
    if ctx.info.is_main:
        write_resolved_config(config)
    state = trainer.train()
    if trainer.preempted:
        if ctx.info.is_main:
            logger.warning(
                "preempted at step %d; checkpoint committed, relaunch to resume", state.global_step
            )
        return exit_codes.PREEMPTED
    if ctx.info.is_main:
        logger.info("done: %d steps, %d samples", state.global_step, state.samples_seen)
    return exit_codes.OK
