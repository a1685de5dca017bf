"""State dicts to files and back, bit-exactly, without pickle.

A state is split by `encode` (checkpointing/encoding.py) into a JSON structure plus a flat dict
of tensors; `save_state` writes them as `<name>.json` and `<name>.safetensors`. Neither format
can run code when read, so a planted file fails with `StateFormatError` instead of executing.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes

from checkpointing.digest import FileDigest, digest_stream, matches, recorded
from checkpointing.encoding import (
    _DTYPES,
    _ST_METADATA,
    StateFormatError,
    _to_cpu,
    decode,
    encode,
)
from checkpointing.retry import retrying
from checkpointing.storage import LocalStorage, Storage, as_storage

# Big enough that syscall and thread hand-off costs vanish, small enough to interleave hashing.
_CHUNK = 16 << 20


# ---------------------------------------------------------------------------- files


def _chunks(t: torch.Tensor) -> tuple[Iterator[memoryview], bool]:
    """Raw bytes of `t` as chunk views into its memory, and whether a CPU copy had to be made."""
    cpu = _to_cpu(t)
    # bfloat16/float8 have no numpy dtype: look at the same memory as bytes instead.
    raw = memoryview(cpu.reshape(-1).view(torch.uint8).numpy())
    return (raw[i : i + _CHUNK] for i in range(0, len(raw), _CHUNK)), cpu.data_ptr() != t.data_ptr()


def _safetensors_prefix(
    tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None
) -> tuple[bytes, list[tuple[str, torch.Tensor]]]:
    """The safetensors length + JSON header, and the tensors in the order the header lays out."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors is little-endian; big-endian hosts are not supported")
    for name, t in tensors.items():
        if not isinstance(name, str) or name == _ST_METADATA or not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor entry {name!r}: expected a str name and a torch.Tensor")
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r}: dtype {t.dtype} not in {sorted(_DTYPES.values())}")
    # Widest elements first: every tensor then starts aligned to its element size.
    order = sorted(tensors.items(), key=lambda kv: -kv[1].element_size())
    header: dict[str, Any] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("safetensors metadata must map str to str")
        header[_ST_METADATA] = dict(metadata)
    offset = 0
    for name, t in order:
        nbytes = t.numel() * t.element_size()
        entry = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape)}
        header[name] = {**entry, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)  # the spec pads the header so data starts 8-aligned
    return struct.pack("<Q", len(head)) + head, order


def store_safetensors(
    storage: Storage,
    rel: str,
    tensors: Mapping[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> FileDigest:
    """Stream `tensors` into a safetensors file `rel` of `storage`; durable when it returns.

    Bytes go straight from each tensor's memory to the file (a tensor is copied only when it is
    not CPU contiguous, one at a time), so peak memory stays near the largest such tensor rather
    than the file size. The hash is computed from the same buffers on a worker thread while
    they are written: the file is never read back. Readable by `safetensors.torch`.
    """
    prefix, order = _safetensors_prefix(tensors, metadata)
    with storage.writer(rel) as w:
        w.write(prefix)
        for _, t in order:
            chunks, copied = _chunks(t)
            for chunk in chunks:
                w.write(chunk)
            if copied:
                w.drain()  # let the copy go before making the next one
    return w.digest()


def write_safetensors(
    path: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> FileDigest:
    """`store_safetensors` into a local file at `path` (fsynced)."""
    path = Path(path)
    return store_safetensors(LocalStorage(path.parent), path.name, tensors, metadata)


def json_bytes(obj: Any) -> bytes:
    """`obj` as UTF-8 JSON (inf/nan as Infinity/NaN)."""
    # ensure_ascii keeps any str (even lone surrogates) encodable and exactly round-tripped.
    return json.dumps(obj, allow_nan=True, indent=1).encode("utf-8")


def write_json(path: str | os.PathLike, obj: Any) -> FileDigest:
    """Write `obj` as JSON to a local file, fsync, return its digest."""
    path = Path(path)
    return LocalStorage(path.parent).write_bytes(path.name, json_bytes(obj))


def parse_json(data: bytes, where: str) -> Any:
    """Parse JSON bytes; anything that is not valid UTF-8 JSON raises StateFormatError."""
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise StateFormatError(f"{where}: not valid UTF-8 JSON ({e})") from e


def read_json(path: str | os.PathLike) -> Any:
    """Parse a local JSON file (StateFormatError when it is not valid UTF-8 JSON)."""
    return parse_json(Path(path).read_bytes(), os.fspath(path))


def _parse_safetensors(storage: Storage, rel: str, data: bytes | None) -> dict[str, torch.Tensor]:
    try:
        if data is None:  # a local file: safetensors maps it
            return safetensors.torch.load_file(storage.local_path(rel), device="cpu")
        return load_safetensors_bytes(data)
    # KeyError/ValueError: a header the Rust side accepts but the torch mapping does not.
    except (SafetensorError, KeyError, ValueError) as e:
        raise StateFormatError(f"{storage.display(rel)}: not a valid safetensors file ({e})") from e


def sync_and_digest(path: Path) -> FileDigest:
    """fsync a local file another writer left, reading it once for its hash meanwhile: the
    fsync waits on the disk while the hash reads the page cache, so they overlap."""
    with open(path, "rb") as f, ThreadPoolExecutor(1, "fsync") as pool:
        synced = pool.submit(os.fsync, f.fileno())
        size, digest = digest_stream(f)
        synced.result()
    return FileDigest(size, digest)


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a local directory so the entries created in it are durable."""
    LocalStorage(path).sync_dir()


def _relative(name: str) -> str:
    parts = name.split("/")
    if len(parts) > 2 or any(p in ("", ".", "..") or "\\" in p for p in parts):
        raise ValueError(f"state name {name!r}: expected 'NAME' or 'DIR/NAME' (one '/' at most)")
    return name


def state_files(name: str, structure: Any, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The files `write_encoded` writes for `name`."""
    rel = _relative(name)
    return ([f"{rel}.safetensors"] if tensors else []) + [f"{rel}.json"]


def write_encoded(
    storage: str | os.PathLike | Storage,
    name: str,
    structure: Any,
    tensors: Mapping[str, torch.Tensor],
) -> dict[str, FileDigest]:
    """Write what `encode` returned as `<name>.json` plus, when there are tensors,
    `<name>.safetensors`; each file is retried on transient store errors. Returns
    {file name relative to the storage: digest}."""
    storage = as_storage(storage)
    rel = _relative(name)
    digests: dict[str, FileDigest] = {}
    if tensors:
        st = f"{rel}.safetensors"
        digests[st] = retrying(
            f"writing {storage.display(st)}",
            lambda: store_safetensors(storage, st, tensors, {"format": "pt"}),
            storage.retries,
        )
    js, data = f"{rel}.json", json_bytes(structure)
    digests[js] = retrying(
        f"writing {storage.display(js)}", lambda: storage.write_bytes(js, data), storage.retries
    )
    return digests


def save_state(
    storage: str | os.PathLike | Storage, name: str, state: Any
) -> dict[str, FileDigest]:
    """Write `state` as `<name>.json` plus, when it holds tensors, `<name>.safetensors`.

    `name` may be "DIR/NAME" (e.g. "rng/rank-00001"); DIR is created. Local files and their
    directory are fsynced. Returns {file name relative to the storage: digest}.
    """
    storage = as_storage(storage)
    digests = write_encoded(storage, name, *encode(state))
    folder = _relative(name).rpartition("/")[0]
    storage.sync_dir(folder)
    if folder:
        storage.sync_dir()  # the new sub-directory's own entry
    return digests


def _read_checked(storage: Storage, rel: str, expected: Mapping[str, Any] | None) -> bytes:
    data = retrying(
        f"reading {storage.display(rel)}", lambda: storage.read_bytes(rel), storage.retries
    )
    if expected is not None:
        meta = expected.get(rel)
        if meta is None or not matches(data, meta):
            algorithm = recorded(meta)[1] if meta is not None else "hash"
            raise StateFormatError(f"{storage.display(rel)}: {algorithm} differs from the manifest")
    return data


def load_state(
    storage: str | os.PathLike | Storage,
    name: str,
    expected: Mapping[str, Any] | None = None,
) -> Any:
    """Read what `save_state(storage, name, ...)` wrote, tensors on CPU. Never unpickles.

    From a store that is not a local filesystem the bytes are read once into memory and, when
    `expected` (the manifest's files) is given, checked against their hash before parsing:
    what is parsed is what was verified. Raises StateFormatError (one line naming the file) for
    a file that is not valid JSON or safetensors, or a structure that references a tensor the
    safetensors file lacks.
    """
    storage = as_storage(storage)
    rel = _relative(name)
    js, st = f"{rel}.json", f"{rel}.safetensors"
    local = storage.local_path() is not None
    raw = _read_checked(storage, js, None if local else expected)
    structure = parse_json(raw, storage.display(js))
    tensors: dict[str, torch.Tensor] = {}
    if storage.exists(st):
        data = None if local else _read_checked(storage, st, expected)
        tensors = _parse_safetensors(storage, st, data)
    try:
        return decode(structure, tensors)
    except StateFormatError as e:
        raise StateFormatError(f"{storage.display(js)} (with {st}): {e}") from e
