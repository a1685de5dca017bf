"""Rank-prefixed logging: rank 0 logs at the configured level, other ranks warnings only."""

from __future__ import annotations

import logging
import sys


def setup_logging(rank: int, level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper()) if rank == 0 else logging.WARNING)
    # fsspec logs every file it opens at debug: a token store's reads would drown the run's.
    logging.getLogger("fsspec").setLevel(max(root.level, logging.INFO))
