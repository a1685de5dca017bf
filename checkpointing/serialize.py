"""State dicts to files and back, bit-exactly, without pickle.

A state (nested dicts/lists/tuples of tensors, ints, floats incl. inf/nan, bools, None, str) is
split by `encode` into a JSON structure plus a flat dict of tensors; `save_state` writes them as
`<name>.json` and `<name>.safetensors`. Neither format can run code when read, so a planted file
fails with `StateFormatError` instead of executing.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from checkpointing.digest import FileDigest, digest_stream, matches, recorded
from checkpointing.retry import retrying
from checkpointing.storage import LocalStorage, Storage, as_storage

TENSOR, TUPLE, DICT = "__tensor__", "__tuple__", "__dict__"
PIECE = "__piece__"
"""One rank's piece of a sharded tensor (a DTensor, or a Share of a replicated one): its global
shape, offsets and dtype."""
_MARKERS = (TENSOR, TUPLE, DICT, PIECE)
_SCALARS = (bool, int, float, str, type(None))
# Reserved by the safetensors header for free-form metadata; never a tensor name.
_ST_METADATA = "__metadata__"
# Big enough that syscall and thread hand-off costs vanish, small enough to interleave hashing.
_CHUNK = 16 << 20


@dataclass(frozen=True)
class Share:
    """Rows `offsets[0]` to `offsets[0] + local.shape[0]` of a tensor of `shape` that every rank
    holds whole, saved as this rank's piece (checkpointing.balanced)."""

    local: torch.Tensor
    shape: tuple[int, ...]
    offsets: tuple[int, ...]


_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}


class StateFormatError(ValueError):
    """A file that should hold saved state is not valid JSON/safetensors, or does not decode."""


# ---------------------------------------------------------------------------- encode / decode


def _to_cpu(t: torch.Tensor, keep_cuda: bool = False) -> torch.Tensor:
    """Plain, contiguous CPU tensor with the same values; no copy when `t` already is one.
    `keep_cuda`: a CUDA tensor stays on its device (contiguous), for the caller to copy."""
    if t.layout != torch.strided or t.is_meta:
        raise TypeError(f"cannot save a {t.layout} tensor on {t.device}: only dense data")
    t = t.detach()
    if not (keep_cuda and t.is_cuda):
        t = t.to("cpu")
    return t.resolve_conj().resolve_neg().contiguous()


class _Encoder:
    def __init__(self, keep_cuda: bool = False) -> None:
        self.keep_cuda = keep_cuda
        self.tensors: dict[str, torch.Tensor] = {}
        # Identical views (tied weights) map to one key; byte extents per storage detect overlaps.
        self._views: dict[tuple, str] = {}
        self._extents: dict[tuple, list[tuple[int, int]]] = {}
        self.live: set[str] = set()
        """Keys whose tensor is a view of the caller's memory, not a copy."""

    def _key(self, path: list[str]) -> str:
        base = ".".join(path) or "tensor"
        key, n = base, 0
        while key in self.tensors or key == _ST_METADATA:  # paths can collide: {"a.b"} vs a->b
            n += 1
            key = f"{base}~{n}"
        return key

    def _tensor(self, t: torch.Tensor, path: list[str]) -> dict[str, str]:
        storage = (t.device, t.untyped_storage().data_ptr())
        view = (*storage, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and view in self._views:  # empty tensors may all sit at address 0
            return {TENSOR: self._views[view]}
        out = _to_cpu(t, self.keep_cuda)
        if t.numel() > 0 and out.data_ptr() == t.data_ptr():  # still a view, not a fresh copy
            start = t.storage_offset() * t.element_size()
            span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
            end = start + span * t.element_size()
            extents = self._extents.setdefault(storage, [])
            if any(s < end and start < e for s, e in extents):
                # safetensors refuses overlapping entries, and a load would not re-alias them.
                out = out.clone()
            else:
                extents.append((start, end))
        key = self._key(path)
        self.tensors[key] = out
        if out.numel() and out.data_ptr() == t.data_ptr():
            self.live.add(key)
        self._views[view] = key
        return {TENSOR: key}

    def _share(self, t: DTensor, path: list[str]) -> Share:
        """This rank's block of a DTensor and where it sits in the whole."""
        local = t.to_local()
        # The DTensor layout's own arithmetic (torch.distributed.checkpoint uses it too).
        shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if tuple(shape) != tuple(local.shape):
            raise TypeError(
                f"cannot save {'.'.join(path)}: a DTensor whose local shape "
                f"{tuple(local.shape)} is not its layout's {tuple(shape)}"
            )
        return Share(local, tuple(t.shape), tuple(int(o) for o in offsets))

    def _piece(self, s: Share, path: list[str]) -> dict[str, Any]:
        """One rank's piece of a tensor and where it sits in the whole: the description a load
        on any number of ranks reads (see checkpointing/sharded.py)."""
        return {
            "shape": list(s.shape),
            "offsets": list(s.offsets),
            "dtype": _DTYPES[s.local.dtype],
            "tensor": self._tensor(s.local, path),
        }

    def __call__(self, obj: Any, path: list[str]) -> Any:
        if isinstance(obj, DTensor):
            return {PIECE: self._piece(self._share(obj, path), path)}
        if isinstance(obj, Share):
            return {PIECE: self._piece(obj, path)}
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path)
        if isinstance(obj, _SCALARS):
            return obj
        if isinstance(obj, tuple):
            return {TUPLE: [self(v, [*path, str(i)]) for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [self(v, [*path, str(i)]) for i, v in enumerate(obj)]
        if isinstance(obj, Mapping):
            if all(isinstance(k, str) and k not in _MARKERS for k in obj):
                return {k: self(v, [*path, k]) for k, v in obj.items()}
            # Non-str keys (optimizer param ids) or keys that look like our markers: pair list.
            pairs = []
            for i, (k, v) in enumerate(obj.items()):
                if isinstance(k, torch.Tensor):
                    raise TypeError(f"cannot save a tensor used as a dict key at {'.'.join(path)}")
                label = str(k) if isinstance(k, _SCALARS) else str(i)
                pairs.append([self(k, [*path, "key"]), self(v, [*path, label])])
            return {DICT: pairs}
        where = ".".join(path) or "<root>"
        raise TypeError(
            f"cannot save {type(obj).__name__} at {where}: accepted are tensors, dict, list, "
            "tuple, int, float, bool, None, str"
        )


def encode(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split `state` into a JSON-serialisable structure and a dict of CPU contiguous tensors.

    Each tensor becomes `{"__tensor__": key}`, key its dotted path ("state.0.exp_avg"), made
    unique with a "~n" suffix. Tuples become `{"__tuple__": [...]}`; dicts with non-str keys or a
    marker key become `{"__dict__": [[k, v], ...]}`. Identical views of one storage (tied weights)
    share one key; other overlapping views are cloned, so the tensors share no memory that
    safetensors would refuse. Mapping subclasses decode as plain dicts; other types raise TypeError.
    CPU contiguous tensors come back as views, not copies: write them before the state changes.
    """
    structure, tensors, _ = encode_views(state)
    return structure, tensors


def encode_views(
    state: Any, keep_cuda: bool = False
) -> tuple[Any, dict[str, torch.Tensor], set[str]]:
    """`encode`, plus the keys of the tensors that are views of `state`'s memory (the ones an
    asynchronous save must copy before training changes them). `keep_cuda`: CUDA tensors are
    left on their device for the caller to copy (checkpointing.staging), not copied here."""
    enc = _Encoder(keep_cuda)
    return enc(state, []), enc.tensors, enc.live


def decode(structure: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of `encode`: `decode(*encode(x))` equals `x`, tied tensors are one object again.

    Raises StateFormatError for a malformed marker, a missing tensor key, or a piece of a
    sharded tensor (read those with checkpointing.sharded).
    """

    def leaf(marker: str, value: Any, path: list[str]) -> Any:
        if marker == PIECE:
            raise StateFormatError(f"{'.'.join(path)} is one rank's piece of a sharded tensor")
        return tensors[value]

    return decode_with(structure, leaf)


def decode_with(structure: Any, leaf: Callable[[str, Any, list[str]], Any]) -> Any:
    """`decode` with `leaf(marker, value, path)` standing in for every tensor (TENSOR) or piece
    (PIECE) node; `path` is the node's keys from the root, as strings."""
    return _decode(structure, leaf, [])


def _decode(structure: Any, leaf: Callable[[str, Any, list[str]], Any], path: list[str]) -> Any:
    if isinstance(structure, list):
        return [_decode(v, leaf, [*path, str(i)]) for i, v in enumerate(structure)]
    if not isinstance(structure, dict):
        return structure
    if len(structure) == 1:
        ((marker, value),) = structure.items()
        try:
            if marker in (TENSOR, PIECE):
                return leaf(marker, value, path)
            if marker == TUPLE:
                return tuple(_decode(v, leaf, [*path, str(i)]) for i, v in enumerate(value))
            if marker == DICT:
                out = {}
                for k, v in value:
                    key = _decode(k, leaf, [*path, "key"])
                    out[key] = _decode(v, leaf, [*path, str(key)])
                return out
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, StateFormatError):
                raise
            raise StateFormatError(f"malformed {marker} entry {value!r:.80}: {e!r}") from e
    return {k: _decode(v, leaf, [*path, k]) for k, v in structure.items()}


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
