"""checkpointing.writers: a file written past the page cache holds exactly the bytes given, its
digest is that of those bytes, and a filesystem that refuses O_DIRECT gets them buffered."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import blake3
import pytest

from checkpointing import writers
from checkpointing.digest import FileDigest
from checkpointing.storage import LocalStorage
from checkpointing.writers import BOUNCE, DirectFile, HashingWriter

SIZES = [0, 1, 4095, 4096, BOUNCE - 1, BOUNCE, BOUNCE + 1, 2 * BOUNCE + 4097]


def pieces(data: bytes) -> list[memoryview]:
    """`data` cut at sizes that fall across the gathering buffer's edges."""
    out, i, sizes = [], 0, [1000, 3 << 20, 5, 16 << 20, 4096]
    view = memoryview(data)
    while i < len(data):
        n = sizes[len(out) % len(sizes)]
        out.append(view[i : i + n])
        i += n
    return out


def direct_io_allowed(directory: Path) -> bool:
    """Whether `directory`'s filesystem accepts O_DIRECT, asked without the code under test."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / "probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return True


def write(path: Path, data: bytes) -> tuple[FileDigest, bool]:
    with DirectFile(path) as f:
        w = HashingWriter(f)
        for piece in pieces(data):
            w.write(piece)
        f.finish()
        os.fsync(f.fileno())
        return w.digest(), f.direct


@pytest.mark.parametrize("size", SIZES)
def test_a_file_holds_exactly_what_was_written(tmp_path, size):
    data = os.urandom(size)
    digest, direct = write(tmp_path / "f.bin", data)
    assert (tmp_path / "f.bin").read_bytes() == data
    assert digest == FileDigest(size, blake3.blake3(data).hexdigest())
    # Files of a buffer or more skip the page cache where the filesystem allows; smaller
    # ones are not worth a device round trip.
    assert direct == (size >= BOUNCE and direct_io_allowed(tmp_path))


def test_local_storage_writes_through_it(tmp_path):
    data = os.urandom(BOUNCE + 12345)
    storage = LocalStorage(tmp_path)
    with storage.writer("sub/f.bin") as w:
        for piece in pieces(data):
            w.write(piece)
    assert w.digest() == FileDigest(len(data), blake3.blake3(data).hexdigest())
    assert (tmp_path / "sub" / "f.bin").read_bytes() == data


def test_a_filesystem_without_o_direct_gets_the_bytes_buffered(tmp_path, monkeypatch):
    monkeypatch.setattr(writers, "_O_DIRECT", 0)
    data = os.urandom(2 * BOUNCE + 7)
    digest, direct = write(tmp_path / "f.bin", data)
    assert not direct and (tmp_path / "f.bin").read_bytes() == data
    assert digest == FileDigest(len(data), blake3.blake3(data).hexdigest())


def test_a_direct_write_refused_late_goes_on_buffered(tmp_path, monkeypatch):
    """Accepted by fcntl, refused by the write (as with blocks over 4 KiB): the rest of the
    file is written buffered from the same offset."""
    if not direct_io_allowed(tmp_path):
        pytest.skip("this filesystem has no O_DIRECT")
    real_pwrite, refused = os.pwrite, []

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and offset >= BOUNCE:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(writers.os, "pwrite", pwrite)
    data = os.urandom(3 * BOUNCE + 100)
    digest, direct = write(tmp_path / "f.bin", data)
    assert refused == [BOUNCE] and not direct
    assert (tmp_path / "f.bin").read_bytes() == data
    assert digest == FileDigest(len(data), blake3.blake3(data).hexdigest())


def test_a_write_error_other_than_a_refusal_is_raised(tmp_path, monkeypatch):
    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writers.os, "pwrite", pwrite)
    with pytest.raises(OSError, match="No space"):
        with LocalStorage(tmp_path).writer("f.bin") as w:
            for piece in pieces(os.urandom(3 * BOUNCE + 1)):
                w.write(piece)
