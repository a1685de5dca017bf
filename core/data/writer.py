"""Writing a token store (core/data/store.py has the format): files committed one by one, so a
killed `prepare` leaves only whole files under final names, and shards streamed block by block,
hashed chunk by chunk as the bytes go by (memory: a partial block and one chunk per shard)."""

from __future__ import annotations

import json
import os
from typing import Any

import blake3
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from checkpointing.retry import io_error_types
from core.data.store import digest, shard_name, sums_name

IO_ERRORS = io_error_types()
JOURNAL = "prepare-journal.json"
"""prepare's progress: committed shards and where the next one starts (deleted at the end)."""


class StoreWriteError(OSError):
    """The store could not be written (full disk, unreachable store): committed shards are
    intact and a relaunch continues."""


class _Out:
    """Writes store files: locally to a temporary name, fsynced, then renamed (a crash leaves no
    half file under a final name); to an object store by a put that appears whole or not at all."""

    def __init__(self, fs: Any, root: str, where: str) -> None:
        self.fs, self.root, self.where = fs, root, where
        self.local = isinstance(fs, LocalFileSystem)
        try:
            fs.makedirs(root, exist_ok=True)
            if self.local:  # what a killed prepare left half-written (never under a final name)
                for name in os.listdir(root):
                    if name.startswith(".") and name.endswith(".tmp"):
                        os.unlink(os.path.join(root, name))
        except IO_ERRORS as e:
            raise StoreWriteError(f"prepare: cannot create {where}: {e}") from e

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def stream(self, name: str) -> _Stream:
        return _Stream(self, name)

    def sync_dir(self) -> None:
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write(self, name: str, parts: list[Any]) -> None:
        try:
            if self.local:
                tmp = self.path(f".{name}.tmp")
                try:
                    with open(tmp, "wb") as f:
                        for part in parts:
                            f.write(part)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, self.path(name))
                except BaseException:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
                    raise
                self.sync_dir()
            else:
                self.fs.pipe_file(self.path(name), b"".join(bytes(memoryview(p)) for p in parts))
        except IO_ERRORS as e:
            raise StoreWriteError(
                f"prepare: cannot write {name} to {self.where}: {e}; the shards committed so far "
                "are kept: relaunch the same command to continue"
            ) from e

    def read_json(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads(self.fs.cat_file(self.path(name)))
        except FileNotFoundError:
            return None
        except (*IO_ERRORS, ValueError) as e:
            raise StoreWriteError(f"prepare: cannot read {name} in {self.where}: {e}") from e

    def write_json(self, name: str, value: dict[str, Any]) -> None:
        self.write(name, [json.dumps(value, indent=1, sort_keys=True).encode() + b"\n"])

    def remove(self, name: str) -> None:
        try:
            self.fs.rm_file(self.path(name))
        except FileNotFoundError:
            pass


class _Stream:
    """One store file written piece by piece: locally under a temporary name (fsynced and
    renamed by commit), on an object store as one streamed upload (it appears at commit)."""

    def __init__(self, out: _Out, name: str) -> None:
        self.out, self.name = out, name
        self.tmp = out.path(f".{name}.tmp") if out.local else out.path(name)
        self.f: Any = None
        self._do(
            lambda: setattr(
                self, "f", open(self.tmp, "wb") if out.local else out.fs.open(self.tmp, "wb")
            )
        )

    def _do(self, action: Any) -> None:
        try:
            action()
        except IO_ERRORS as e:
            self.abort()
            raise StoreWriteError(
                f"prepare: cannot write {self.name} to {self.out.where}: {e}; the shards "
                "committed so far are kept: relaunch the same command to continue"
            ) from e

    def write(self, data: memoryview) -> None:
        self._do(lambda: self.f.write(data))

    def commit(self) -> None:
        def finish() -> None:
            if self.out.local:
                self.f.flush()
                os.fsync(self.f.fileno())
                self.f.close()
                os.replace(self.tmp, self.out.path(self.name))
                self.out.sync_dir()
            else:
                self.f.close()

        self._do(finish)

    def abort(self) -> None:
        f, self.f = self.f, None
        if f is None:
            return
        try:
            if hasattr(f, "discard"):  # an object-store upload: abandon it
                f.discard()
            f.close()
        except (*IO_ERRORS, ValueError):
            pass
        if self.out.local and os.path.exists(self.tmp):
            os.unlink(self.tmp)


class _Shards:
    """Cuts the token stream into blocks and the blocks into shards, each streamed to the store
    as its blocks complete (memory: one partial block and the chunk being hashed) and committed
    when full."""

    def __init__(self, out: _Out, settings: dict[str, Any], journal: dict[str, Any]) -> None:
        self.out, self.settings, self.journal = out, settings, journal
        self.seq_len = settings["seq_len"]
        self.per = settings["blocks_per_shard"]
        self.chunk = settings["chunk_bytes"]
        self.dtype = np.dtype(settings["dtype"]).newbyteorder("<")
        self.carry = np.zeros(0, self.dtype)  # tokens short of a whole block
        self.stream: _Stream | None = None
        self.blocks = self.nbytes = self.in_chunk = 0
        self.sums = bytearray()
        self.hasher = blake3.blake3()

    def add(self, tokens: np.ndarray, piece: int, base: int, docs_before: int) -> None:
        """Append `tokens`, piece `piece`'s output from its token `base` on."""
        pos = 0
        while pos < len(tokens):
            room = (self.per - self.blocks) * self.seq_len - len(self.carry)
            take = min(room, len(tokens) - pos)
            data = tokens[pos : pos + take]
            if len(self.carry):
                data = np.concatenate([self.carry, data.astype(self.dtype, copy=False)])
            pos += take
            whole = len(data) // self.seq_len * self.seq_len
            if whole:
                self._write(data[:whole])
            self.carry = data[whole:].astype(self.dtype)
            if self.blocks == self.per:
                self.commit(resume={"piece": piece, "skip": base + pos, "documents": docs_before})

    def _write(self, data: np.ndarray) -> None:
        if self.stream is None:
            self.stream = self.out.stream(shard_name(len(self.journal["shards"])))
        view = memoryview(np.ascontiguousarray(data.astype(self.dtype, copy=False))).cast("B")
        self.stream.write(view)
        i = 0
        while i < len(view):  # chunk digests, as the bytes go by
            n = min(self.chunk - self.in_chunk, len(view) - i)
            self.hasher.update(view[i : i + n])
            self.in_chunk += n
            i += n
            if self.in_chunk == self.chunk:
                self._end_chunk()
        self.blocks += len(data) // self.seq_len
        self.nbytes += len(view)

    def _end_chunk(self) -> None:
        self.sums += self.hasher.digest()
        self.hasher, self.in_chunk = blake3.blake3(), 0

    def commit(self, resume: dict[str, Any] | None) -> None:
        """Commit the open shard (at the end: the tokens short of a block are dropped)."""
        self.carry = self.carry[:0]
        if self.stream is None:
            return
        if self.in_chunk:
            self._end_chunk()
        name, sums = self.stream.name, bytes(self.sums)
        self.stream.commit()
        self.out.write(sums_name(name), [sums])
        self.journal["shards"].append(
            {"name": name, "blocks": self.blocks, "bytes": self.nbytes, "hash": digest(sums).hex()}
        )
        self.journal["resume"] = resume
        self.out.write_json(JOURNAL, self.journal)
        self.stream, self.sums = None, bytearray()
        self.blocks = self.nbytes = 0
