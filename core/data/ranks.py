"""Building the datasets once on a machine, and checking every rank built the same: the first
rank tokenises into datasets' cache, the others load it (`main_process_first`); a rank whose
samples differ from rank 0's stops every rank before training (`check_same_data`)."""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from checkpointing.comm import broadcast_object
from core.agreement import any_rank
from core.data.errors import DataError

logger = logging.getLogger(__name__)

T = TypeVar("T")
BUILD_TIMEOUT = datetime.timedelta(hours=48)


def main_process_first(build: Callable[[], T], rank: int, local_rank: int) -> T:
    """`build()` on rank 0 first, then on the first rank of every other node, then on the rest:
    the first build of a dataset tokenises it into datasets' cache, later ones (on a shared
    filesystem: all of them) load that cache, so tokenising runs once and not once per rank.
    A failure anywhere stops every rank at the same point with its own error (or a DataError
    naming the rank that failed), never a rank waiting forever in a collective."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return build()
    # The waiting ranks sit in a collective while another tokenises, which may take hours: a
    # group of its own, whose timeout is not the training group's.
    group = dist.new_group(backend="gloo", timeout=BUILD_TIMEOUT)
    try:
        return _in_phases(build, rank, local_rank, group)
    finally:
        dist.destroy_process_group(group)


def check_same_data(fingerprint: str, rank: int) -> None:
    """Every rank built the samples rank 0 built (a local file or cache that differs between
    nodes, a template that prints the date...): else one line, on every rank, before training."""
    expected = broadcast_object(fingerprint)
    differs = fingerprint != expected
    if any_rank([differs])[0]:
        if differs:
            message = (
                f"data: rank {rank} built other samples than rank 0 (dataset fingerprint "
                f"{fingerprint}, rank 0: {expected}); give every node the same data.source files"
            )
            logger.error("%s", message)  # rank 0 alone reports usage errors (launcher.main)
            raise DataError(message)
        raise DataError("data: another rank built other samples than rank 0 (see its log)")


def _in_phases(build: Callable[[], T], rank: int, local_rank: int, group: Any) -> T:
    phases = (rank == 0, rank != 0 and local_rank == 0, local_rank != 0)
    result: Any = None
    error: BaseException | None = None
    for mine in phases:
        if mine:
            try:
                result = build()
            except Exception as e:  # re-raised below, once every rank knows
                error = e
                if rank != 0:  # rank 0 alone reports usage errors (launcher.main)
                    logger.error("rank %d: %s", rank, e)
        if any_rank([error is not None], group)[0]:
            if error is not None:
                raise error
            raise DataError("data: building the datasets failed on another rank (see its log)")
    return result
