"""Where checkpoints live: one small interface over a local directory or any fsspec URL, and
`open_storage`, which picks the implementation for a path or URL.

Every checkpoint read and write in the project goes through a `Storage`, a directory handle
addressed by relative posix paths. Two implementations:

- `LocalStorage` (a path or `file://`): plain files, fsynced as written; a checkpoint commits by
  renaming its temp directory (atomic on a POSIX filesystem).
- `FsspecStorage` (`s3://`, `gs://`, `memory://`, any fsspec protocol; in
  checkpointing/object_storage.py): object-store semantics. There is no atomic rename, so a
  checkpoint commits by writing its manifest last, after every other object is confirmed
  written; deleting one removes the manifest first.

The interface itself is checkpointing/storage_api.py; both are importable from here.

fsspec itself cannot fsync a local file or rename a directory atomically, which the local commit
protocol needs; that is why local paths get their own implementation.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from checkpointing.object_storage import FsspecStorage
from checkpointing.storage_api import Storage
from checkpointing.writers import DirectFile, HashingWriter

logger = logging.getLogger(__name__)

T = TypeVar("T")


class LocalStorage(Storage):
    atomic_rename = True

    def __init__(self, root: str | os.PathLike, retries: int = 3) -> None:
        self.root = Path(root)
        self.url = str(self.root)
        self.retries = retries

    def _p(self, rel: str) -> Path:
        return self.root / rel if rel else self.root

    def child(self, rel: str) -> LocalStorage:
        return LocalStorage(self._p(rel), self.retries)

    def exists(self, rel: str) -> bool:
        return self._p(rel).exists()

    def isdir(self, rel: str = "") -> bool:
        return self._p(rel).is_dir()

    def size(self, rel: str) -> int:
        return self._p(rel).stat().st_size

    def listdir(self, rel: str = "") -> list[str]:
        p = self._p(rel)
        return sorted(c.name for c in p.iterdir()) if p.is_dir() else []

    def files(self, rel: str = "") -> list[str]:
        base = self._p(rel)
        return sorted(p.relative_to(self.root).as_posix() for p in base.rglob("*") if p.is_file())

    def open_read(self, rel: str) -> BinaryIO:
        return self._p(rel).open("rb")

    def read_bytes(self, rel: str) -> bytes:
        return self._p(rel).read_bytes()

    @contextmanager
    def writer(self, rel: str) -> Iterator[HashingWriter]:
        path = self._p(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        with DirectFile(path) as f:  # past the page cache where the filesystem allows
            w = HashingWriter(f)
            try:
                yield w
                f.finish()
                os.fsync(f.fileno())  # the hasher catches up meanwhile
            except BaseException:
                w.abandon()
                raise

    def remove(self, rel: str) -> None:
        p = self._p(rel)
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()

    def rename(self, src: str, dst: str) -> None:
        self._p(src).rename(self._p(dst))

    def _write_aside(self, rel: str, data: bytes) -> Path:
        """`data` in a durable file of a unique name beside `rel`."""
        path = self._p(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        aside = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            with open(aside, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:  # a full disk: leave nothing behind
            aside.unlink(missing_ok=True)
            raise
        return aside

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        # link(2) of a complete file fails with EEXIST when the name exists: atomic on local
        # filesystems and on NFS (where O_EXCL has not always been), and a reader never sees
        # the file half written, as it could after O_CREAT|O_EXCL then write.
        aside = self._write_aside(rel, data)
        try:
            os.link(aside, self._p(rel))
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in _NO_HARD_LINKS:
                raise
            return self._create_excl(rel, data)
        finally:
            aside.unlink()
        self._sync_parent(rel)
        return True

    def _create_excl(self, rel: str, data: bytes) -> bool:
        """O_CREAT|O_EXCL, for filesystems without hard links: a reader may briefly see the
        file empty (a lease reader then takes it as held and looks again)."""
        try:
            fd = os.open(self._p(rel), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:  # write() of a file object writes every byte
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self._sync_parent(rel)
        return True

    def _sync_parent(self, rel: str) -> None:
        self.sync_dir(str(Path(rel).parent) if "/" in rel else "")

    def replace_bytes(self, rel: str, data: bytes) -> None:
        aside = self._write_aside(rel, data)
        try:
            os.replace(aside, self._p(rel))
        except BaseException:
            aside.unlink(missing_ok=True)
            raise
        self._sync_parent(rel)

    def sync_dir(self, rel: str = "") -> None:
        fd = os.open(self._p(rel), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def local_path(self, rel: str = "") -> Path:
        return self._p(rel)


# link(2) refused by the filesystem (some FUSE and SMB mounts), not by an existing name.
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS}


def open_storage(
    url: str | os.PathLike, options: dict[str, Any] | None = None, retries: int = 3
) -> Storage:
    """A Storage for a local path, `file://` URL or any fsspec URL (`s3://bucket/run`).

    `options` are the fsspec filesystem's keyword arguments (s3fs: key, secret, endpoint_url,
    client_kwargs...); credentials may equally come from the environment, as the client reads it.
    """
    if isinstance(url, Storage):
        return url
    text = os.fspath(url)
    path = local_path(text)
    if path is not None:
        return LocalStorage(path, retries)
    import fsspec

    fs, root = fsspec.core.url_to_fs(text, **(options or {}))
    return FsspecStorage(fs, root, text, retries)


def local_path(url: str) -> str | None:
    """The filesystem path of a plain path or `file://` URL; None for any other URL."""
    if url.startswith("file://"):
        return url[len("file://") :]
    return None if "://" in url else url


def as_storage(where: str | os.PathLike | Storage) -> Storage:
    """A Storage as is, or a LocalStorage / fsspec storage for a path or URL."""
    return where if isinstance(where, Storage) else open_storage(where)


def is_private_to_process(url: str) -> bool:
    """True for stores that live in one process's memory (every rank would see its own)."""
    return os.fspath(url).startswith("memory://")


__all__ = [
    "FsspecStorage",
    "LocalStorage",
    "Storage",
    "as_storage",
    "is_private_to_process",
    "local_path",
    "open_storage",
]
