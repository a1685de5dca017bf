"""How a checkpoint file's bytes reach storage: hashed as written, and past the page cache.

`HashingWriter` writes buffers to a file object while a worker thread hashes the same buffers
(BLAKE3 and raw writes release the GIL), so a file is never read back to learn its digest.

`DirectFile` is the file object of a new local file. Its bytes are gathered in page-aligned
buffers and written with O_DIRECT, straight from them to the device, skipping the kernel's copy
into the page cache and its writeback. Writing 683 MB and fsyncing it on this project's 2-core
CI machine took 0.17-1.66 s of CPU buffered (the spread is the page cache's reclaim and
writeback) and 0.07-0.11 s through O_DIRECT, our copy into the aligned buffers included. That
CPU is what an asynchronous save takes from the training step beside it, and a checkpoint
written buffered also evicts the page cache's other pages (the training data's). Python's file
objects offer no aligned writes, hence this class. Where O_DIRECT is refused (tmpfs on older
kernels, some network or FUSE filesystems, a device with blocks over 4 KiB, not Linux) the
same file is written buffered from then on; every file is fsynced by its caller either way.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from checkpointing.digest import FileDigest, hasher

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_ALIGN = 4096  # O_DIRECT needs memory, offset and length aligned to the device's block
BOUNCE = 8 << 20
"""Bytes gathered before each direct write (as large as a typical storage I/O; the buffer's
pages are touched only as it fills, so a small file costs a page)."""


class HashingWriter:
    """Writes buffers to `f` (a raw file object) while a thread hashes them."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self._hash = hasher()
        self._size = 0
        self._pool = ThreadPoolExecutor(1, "checkpoint-hash")
        self._pending: list[Future] = []

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        self._pending.append(self._pool.submit(self._hash.update, view))
        self._size += view.nbytes
        while view:  # a raw write may be partial
            n = self._f.write(view)
            view = view[n if n is not None else len(view) :]

    def drain(self) -> None:
        """Wait until the hasher has caught up (so the caller may free what it wrote)."""
        for fut in self._pending:
            fut.result()
        self._pending.clear()

    def digest(self) -> FileDigest:
        self.drain()
        self._pool.shutdown()
        return FileDigest(self._size, self._hash.hexdigest())

    def abandon(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class DirectFile:
    """A new file at `path`, written through O_DIRECT where the filesystem allows (see the
    module's docstring). `write` returns how many bytes it took (it may be fewer than given);
    `finish` writes what is left; the caller then fsyncs `fileno()`.

    Two page-aligned buffers: while a thread writes a full one to the device, the caller
    fills the other (a numpy copy, which releases the GIL: the training thread's Python never
    waits for a writer copying bytes)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self._maps: list[mmap.mmap] = [mmap.mmap(-1, BOUNCE)]  # the second one at the first flush
        self._arrays: list[np.ndarray] = [np.frombuffer(self._maps[0], np.uint8)]
        self._cur = 0
        self._fill = 0
        self._offset = 0  # the file offset of the current buffer's first byte
        self._io: ThreadPoolExecutor | None = None
        self._writing: list[Future | None] = [None, None]
        self._direct: bool | None = None  # switched on at the first full buffer

    def fileno(self) -> int:
        return self._fd

    @property
    def direct(self) -> bool:
        """Whether the bytes written so far went through O_DIRECT."""
        return bool(self._direct)

    def write(self, data: memoryview) -> int:
        n = min(len(data), BOUNCE - self._fill)
        buf = self._arrays[self._cur]
        np.copyto(buf[self._fill : self._fill + n], np.frombuffer(data[:n], np.uint8))
        self._fill += n
        if self._fill == BOUNCE:
            self._flush_full()
        return n

    def _flush_full(self) -> None:
        """Hand the full current buffer to the I/O thread; continue in the other one once the
        device has taken what it held before."""
        if self._io is None:
            self._direct = self._set_direct(True)
            self._io = ThreadPoolExecutor(1, "checkpoint-write")
            self._maps.append(mmap.mmap(-1, BOUNCE))
            self._arrays.append(np.frombuffer(self._maps[1], np.uint8))
        self._writing[self._cur] = self._io.submit(self._put, self._cur, BOUNCE, self._offset)
        self._offset += BOUNCE
        self._cur ^= 1
        self._fill = 0
        self._wait(self._cur)

    def _wait(self, i: int) -> None:
        pending, self._writing[i] = self._writing[i], None
        if pending is not None:
            pending.result()  # raises the I/O thread's error here

    def finish(self) -> None:
        """Write the bytes still gathered: a file smaller than the buffer is written buffered
        (not worth a device round trip); a direct file's last block is padded to the
        alignment, then the file is cut back to its true length."""
        self._wait(0)
        self._wait(1)
        size = self._offset + self._fill
        if self._direct:
            pad = -self._fill % _ALIGN
            self._arrays[self._cur][self._fill : self._fill + pad] = 0
            self._put(self._cur, self._fill + pad, self._offset)
            os.ftruncate(self._fd, size)
        else:
            self._put(self._cur, self._fill, self._offset)
        self._offset, self._fill = size, 0

    def close(self) -> None:
        if self._io is not None:  # an error left a write running: it ends before the unmap
            self._io.shutdown(wait=True, cancel_futures=True)
        self._arrays = []
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view still held by a traceback: unmapped when it goes
                pass
        os.close(self._fd)

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _put(self, i: int, n: int, offset: int) -> None:
        """pwrite buffer `i`'s first `n` bytes at `offset`."""
        with memoryview(self._maps[i]) as view:
            done = 0
            while done < n:
                try:
                    done += os.pwrite(self._fd, view[done:n], offset + done)
                except OSError as e:
                    # Accepted by fcntl but refused by the write (a block size over 4 KiB, a
                    # filesystem that checks late): the rest of this file is written buffered.
                    if e.errno != errno.EINVAL or not self._direct:
                        raise
                    self._direct = self._set_direct(False)

    def _set_direct(self, on: bool) -> bool:
        """Turn O_DIRECT on or off for this file; whether it is now on."""
        if not _O_DIRECT:
            return False
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags | _O_DIRECT if on else flags & ~_O_DIRECT)
        except OSError:  # the filesystem has no O_DIRECT
            return False
        return on
