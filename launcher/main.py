"""`python -m launcher --config FILE [--section.key VALUE ...]`, alone or under torchrun."""

from __future__ import annotations

import argparse
import logging

from torch.distributed.elastic.multiprocessing.errors import record

from checkpointing.lease import LeaseError
from checkpointing.manifest import CheckpointError
from checkpointing.retry import StorageError
from core.config import Config, ConfigError, load_config
from core.data import DataError
from core.trainer import Trainer
from launcher import exit_codes
from launcher.dist import env_rank
from launcher.logs import setup_logging
from launcher.preflight import check_writable
from launcher.session import Session, session

logger = logging.getLogger("launcher")

USAGE_ERRORS = (ConfigError, DataError)
COMMANDS = """other commands (each has its own --help):
  prepare --config FILE   tokenise data.source into the token store at data.store
  prepare --verify STORE  check every shard of a token store against its index
  status RUN_DIR          steps, checkpoints, resumes, speed and ETA of a run
  plot RUN_DIR...         loss and learning rate by step, as a PNG"""


def parse_args(argv: list[str] | None) -> tuple[str | None, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m launcher",
        description="Train under torchrun with resumable checkpoints. Any config field can be "
        "overridden as --section.key VALUE (e.g. --train.max_steps 50).",
        epilog=COMMANDS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML config file (default: configs/tiny.yaml)")
    # The `deepspeed` launcher appends --local_rank=N (unless --no_local_rank); LOCAL_RANK in
    # the environment says the same, and that is what we read.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args(argv)
    return args.config, overrides


@record
def main(argv: list[str] | None = None) -> int:
    rank = env_rank()
    setup_logging(rank)
    try:
        config_path, overrides = parse_args(argv)
        config = load_config(config_path, overrides)
        check_writable(config)  # before anything is built: a permission is not a store outage
    except ConfigError as e:
        if rank == 0:
            logger.error("%s", e)
        return exit_codes.USAGE
    try:
        with session(config.engine, config.run.log_level, config.run.full_determinism) as s:
            return train(config, s)
    except USAGE_ERRORS as e:
        if rank == 0:
            logger.error("%s", e)
        return exit_codes.USAGE
    except LeaseError as e:
        if rank == 0:  # the lease is rank 0's; the others learned the outcome from it
            logger.error("%s", e)
        return exit_codes.LEASE
    except CheckpointError as e:
        logger.error("%s", e)  # every rank: a self-check failure may be one rank's alone
        return exit_codes.CHECKPOINT
    except StorageError as e:
        logger.error("%s", e)
        return exit_codes.STORAGE
    except KeyboardInterrupt:
        logger.warning("interrupted")
        return exit_codes.INTERRUPTED


def train(config: Config, s: Session) -> int:
    """Run the Python API's Trainer; the exit code for a run that ended without an exception."""
    trainer = Trainer(args=config, dist_info=s.info, device=s.device, stop_requested=s.stop)
    result = trainer.train()
    if trainer.preempted:
        if s.info.is_main:
            logger.warning(
                "preempted at step %d; checkpoint committed, relaunch to resume", result.global_step
            )
        return exit_codes.PREEMPTED
    if s.info.is_main:
        logger.info("done: %d steps, training loss %.4f", result.global_step, result.training_loss)
    return exit_codes.OK
