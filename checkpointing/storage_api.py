"""The interface every checkpoint store implements (checkpointing/storage.py opens one): a
directory handle addressed by relative posix paths."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from checkpointing.digest import FileDigest
from checkpointing.redact import display_url
from checkpointing.writers import HashingWriter


class Storage:
    """A directory of a local filesystem or an object store; paths are relative posix strings.

    `write` hashes what it writes and returns when the file is durable (local: fsynced;
    object store: the upload completed). Listing sees what other processes wrote.
    """

    url: str
    atomic_rename: bool = False
    retries: int = 3

    def child(self, rel: str) -> Storage:
        raise NotImplementedError

    def exists(self, rel: str) -> bool:
        raise NotImplementedError

    def isdir(self, rel: str = "") -> bool:
        raise NotImplementedError

    def size(self, rel: str) -> int:
        raise NotImplementedError

    def listdir(self, rel: str = "") -> list[str]:
        """Names of the entries directly under `rel` (empty when it does not exist)."""
        raise NotImplementedError

    def files(self, rel: str = "") -> list[str]:
        """Every file under `rel`, as paths relative to this storage."""
        raise NotImplementedError

    def open_read(self, rel: str) -> Any:
        raise NotImplementedError

    def read_bytes(self, rel: str) -> bytes:
        raise NotImplementedError

    @contextmanager
    def writer(self, rel: str) -> Iterator[HashingWriter]:
        """`with storage.writer(rel) as w: w.write(...)`; the file is durable after the block;
        its digest is `w.digest()`, valid once the block ends without an error."""
        raise NotImplementedError
        yield

    def write_bytes(self, rel: str, data: bytes) -> FileDigest:
        with self.writer(rel) as w:
            w.write(data)
        return w.digest()

    def remove(self, rel: str) -> None:
        """Delete a file or a tree; nothing when it does not exist."""
        raise NotImplementedError

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Create `rel` holding `data` if nothing is there, atomically against every other
        writer of the store: True if this call created it, False if it existed. The whole
        content is visible at once. NotImplementedError where the store has no such primitive."""
        raise NotImplementedError(f"{self.display()}: no create-if-absent on this store")

    def replace_bytes(self, rel: str, data: bytes) -> None:
        """Replace `rel` so that a reader sees the old content or the new, never a mix."""
        self.write_bytes(rel, data)  # an object put replaces the whole object at once

    def rename(self, src: str, dst: str) -> None:
        raise NotImplementedError(f"{self.url}: no atomic rename on this storage")

    def sync_dir(self, rel: str = "") -> None:
        """Make the entries created in directory `rel` durable (a no-op on object stores)."""

    def local_path(self, rel: str = "") -> Path | None:
        """The local path of `rel`, or None when the storage is not a local filesystem."""
        return None

    def display(self, rel: str = "") -> str:
        """`rel` as a user reads it in logs (a path, or a URL without credentials)."""
        return display_url(self._join(self.url, rel))

    @staticmethod
    def _join(base: str, rel: str) -> str:
        return f"{base.rstrip('/')}/{rel}" if rel else base

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.display()!r})"
