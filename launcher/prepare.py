"""`python -m launcher prepare --config FILE [--section.key VALUE ...]`: tokenise data.source
into the token store at data.store (core/data/prepare.py); `python -m launcher prepare --verify
STORE [--config FILE]` checks every shard of a store against its index."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from core.config import ConfigError, load_config
from core.data.errors import DataError
from core.data.store import StoreError, verify_store
from launcher import exit_codes
from launcher.logs import setup_logging

logger = logging.getLogger("launcher")


def share_cores(workers: int) -> None:
    """Size the Hugging Face tokenizers' thread pool (Rust rayon, read once from the environment
    when it starts) so that `workers` tokenising processes x their threads = the cores: without
    it each of N workers starts one thread per core and they fight over the cores. Spawned workers
    inherit the environment; a value the user set is kept."""
    if workers > 1 and "RAYON_NUM_THREADS" not in os.environ:
        os.environ["RAYON_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launcher prepare",
        description="Tokenise data.source into a token store at data.store (resumable: "
        "relaunch the same command after a kill), or --verify a store. Any config field can be "
        "overridden as --section.key VALUE.",
    )
    parser.add_argument("--config", help="YAML config file (default: configs/tiny.yaml)")
    parser.add_argument("--verify", metavar="STORE", help="check every shard of STORE")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args, overrides = parser.parse_known_args(argv)
    setup_logging(0)
    try:
        config = load_config(args.config, overrides)
        if args.verify:
            index = verify_store(args.verify, config.data.storage_options)
            print(
                f"{args.verify}: OK, {len(index.shards)} shard(s), {index.blocks} blocks of "
                f"{index.seq_len} tokens verified"
            )
            return exit_codes.OK
        from core.data.prepare import prepare
        from core.data.writer import IO_ERRORS, StoreWriteError

        share_cores(config.data.num_proc)
        try:
            prepare(config.data, progress=not args.no_progress and sys.stderr.isatty())
        except StoreWriteError as e:
            logger.error("%s", e)
            return exit_codes.STORAGE
        except IO_ERRORS as e:  # reading a source: a store or network failure, not bad input
            logger.error(
                "prepare: %s: %s; relaunch the same command once it is reachable",
                type(e).__name__,
                e,
            )
            return exit_codes.STORAGE
    except (ConfigError, DataError) as e:
        logger.error("%s", e)
        return exit_codes.USAGE
    except StoreError as e:
        logger.error("%s", e)
        return exit_codes.CHECKPOINT
    except KeyboardInterrupt:
        logger.warning("interrupted")
        return exit_codes.INTERRUPTED
    return exit_codes.OK
