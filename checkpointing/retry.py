"""Retries of store operations: which errors are worth another attempt, and StorageError, the
one-line error once a store operation failed after every attempt."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger("checkpointing.storage")  # the name users filter on
T = TypeVar("T")


class StorageError(OSError):
    """The checkpoint store failed an operation after every retry (one line: what and why)."""


_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def io_error_types() -> tuple[type[BaseException], ...]:
    """What a filesystem or object-store call raises when the store fails (not a bug of ours):
    OSError and the object-store clients' own errors."""
    return _transient_types()


def _transient_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [OSError, TimeoutError]
    try:  # the object-store clients' own base errors, when they are installed
        from botocore.exceptions import BotoCoreError, ClientError

        types += [BotoCoreError, ClientError]
    except ImportError:
        pass
    try:
        from aiohttp import ClientError as AiohttpError

        types.append(AiohttpError)
    except ImportError:
        pass
    return tuple(types)


def is_transient(e: BaseException) -> bool:
    """An error worth retrying: the store or the network, not a missing file or a refusal."""
    if isinstance(e, (StorageError, *_PERMANENT)):
        return False
    return isinstance(e, _transient_types())


def retrying(
    what: str, fn: Callable[[], T], retries: int, backoff: float = 0.5, log: bool = True
) -> T:
    """`fn()`, retried up to `retries` times on transient errors with exponential backoff
    (backoff, 2*backoff, ...); then StorageError naming `what` and the last error."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except Exception as e:
            if not is_transient(e):
                raise
            if attempt == retries:
                raise StorageError(
                    f"{what}: failed after {retries + 1} attempts: {type(e).__name__}: {e}"
                ) from e
            delay = backoff * 2**attempt
            if log:
                logger.warning("%s: %s: %s; retrying in %.1f s", what, type(e).__name__, e, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")
