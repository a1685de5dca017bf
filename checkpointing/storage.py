"""Where checkpoints live: one small interface over a local directory or any fsspec URL.

Every checkpoint read and write in the project goes through a `Storage`, a directory handle
addressed by relative posix paths. Two implementations:

- `LocalStorage` (a path or `file://`): plain files, fsynced as written; a checkpoint commits by
  renaming its temp directory (atomic on a POSIX filesystem).
- `FsspecStorage` (`s3://`, `gs://`, `memory://`, any fsspec protocol): object-store semantics.
  There is no atomic rename, so a checkpoint commits by writing its manifest last, after every
  other object is confirmed written; deleting one removes the manifest first.

fsspec itself cannot fsync a local file or rename a directory atomically, which the local commit
protocol needs; that is why local paths get their own implementation.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from checkpointing.digest import FileDigest
from checkpointing.redact import display_url
from checkpointing.writers import DirectFile, HashingWriter

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Object-store parts: large enough that per-request overhead vanishes.
_BLOCK = 64 << 20


# --------------------------------------------------------------------------- storages


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


class FsspecStorage(Storage):
    """Any fsspec filesystem, used with object-store semantics (no rename, manifest last)."""

    def __init__(self, fs: Any, root: str, url: str, retries: int = 3) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url.rstrip("/")
        self.retries = retries

    def _p(self, rel: str) -> str:
        return self._join(self.root, rel)

    def child(self, rel: str) -> FsspecStorage:
        return FsspecStorage(self.fs, self._p(rel), self._join(self.url, rel), self.retries)

    def _fresh(self) -> None:
        # Listings are cached per filesystem instance; other processes write the same store.
        self.fs.invalidate_cache()

    def exists(self, rel: str) -> bool:
        self._fresh()
        return self.fs.exists(self._p(rel))

    def isdir(self, rel: str = "") -> bool:
        self._fresh()
        return self.fs.isdir(self._p(rel))

    def size(self, rel: str) -> int:
        self._fresh()
        return int(self.fs.size(self._p(rel)))

    def listdir(self, rel: str = "") -> list[str]:
        self._fresh()
        try:
            entries = self.fs.ls(self._p(rel), detail=False)
        except FileNotFoundError:
            return []
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries})

    def files(self, rel: str = "") -> list[str]:
        self._fresh()
        base = self._p(rel)
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        strip = self.fs._strip_protocol(self.root).rstrip("/") + "/"
        return sorted(p[len(strip) :] for p in found if p.startswith(strip))

    def open_read(self, rel: str) -> Any:
        return self.fs.open(self._p(rel), "rb", block_size=_BLOCK)

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self._p(rel))

    @contextmanager
    def writer(self, rel: str) -> Iterator[HashingWriter]:
        f = self.fs.open(self._p(rel), "wb", block_size=_BLOCK)
        w = HashingWriter(f)
        try:
            yield w
        except BaseException:
            w.abandon()
            # Never complete a partial upload: buffered object-store files abort it, and the
            # others store nothing until closed.
            discard = getattr(f, "discard", None)
            if discard is not None:
                discard()
            raise
        f.close()  # completes the upload; errors here propagate

    def remove(self, rel: str) -> None:
        self._fresh()
        path = self._p(rel)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def replace_bytes(self, rel: str, data: bytes) -> None:
        # One put of the whole content (a streamed writer can show a partial file meanwhile,
        # as memory:// does).
        self.fs.pipe_file(self._p(rel), data)

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        path = self._p(rel)
        if hasattr(self.fs, "call_s3"):
            # S3 (and compatible stores) honour a conditional put: PreconditionFailed (s3fs
            # raises FileExistsError) when the key exists.
            bucket, key, _ = self.fs.split_path(path)
            try:
                self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
            except FileExistsError:
                return False
            self._fresh()
            return True
        if _protocol(self.fs) == "memory":
            # One process's store: a lock makes check-then-write atomic.
            with _MEMORY_LOCK:
                if self.fs.exists(path):
                    return False
                self.fs.pipe_file(path, data)
                return True
        return super().create_exclusive(rel, data)


_MEMORY_LOCK = threading.Lock()
# link(2) refused by the filesystem (some FUSE and SMB mounts), not by an existing name.
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS}


def _protocol(fs: Any) -> str:
    protocol = fs.protocol
    return protocol if isinstance(protocol, str) else protocol[0]


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
