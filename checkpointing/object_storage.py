"""`FsspecStorage`: a checkpoint store on any fsspec filesystem (`s3://`, `gs://`, `memory://`)
with object-store semantics. There is no atomic rename, so a checkpoint commits by writing its
manifest last, after every other object is confirmed written; deleting one removes the manifest
first."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from checkpointing.storage_api import Storage
from checkpointing.writers import HashingWriter

# Object-store parts: large enough that per-request overhead vanishes.
_BLOCK = 64 << 20
_MEMORY_LOCK = threading.Lock()


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


def _protocol(fs: Any) -> str:
    protocol = fs.protocol
    return protocol if isinstance(protocol, str) else protocol[0]
