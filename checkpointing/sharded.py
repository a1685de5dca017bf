"""Sharded state: every rank saves only its pieces of distributed tensors (DTensors), and any
number of ranks reads them back, each reading only the regions it needs.

A sharded entry `name` is one pair of files per saving rank, `name/rank-<r>.json` and
`name/rank-<r>.safetensors`, written by `encode` like any per-rank entry: a DTensor becomes
a piece node

    {"__piece__": {"shape": global shape, "offsets": this piece's offsets,
                   "dtype": "F32", "tensor": {"__tensor__": key}}}

and plain tensors and values (replicated on every rank: an optimizer's step count, its
hyperparameters) are stored as usual. `SavedState` reads every rank's description, checks that
the pieces of each tensor tile it exactly, and copies the regions a loading rank asks for
(`read`). A global entry (one file, rank 0's, as the DDP engine writes the model) reads through
the same class, each tensor being one piece that covers it, so the engines' checkpoints cross.

Why not torch.distributed.checkpoint's own format: its `.metadata` file and every non-tensor
value are pickled, and a load unpickles them. Here the descriptions are JSON, the data
safetensors, and both are hashed in the manifest and verified before anything is read.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_safetensors_bytes

from checkpointing.encoding import _DTYPES, TENSOR, StateFormatError, decode_with
from checkpointing.manifest import CheckpointCorruptError
from checkpointing.retry import retrying
from checkpointing.serialize import _read_checked, parse_json
from checkpointing.stateful import rank_name
from checkpointing.storage import Storage

TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}
_MAX_HEADER = 100 << 20  # a safetensors header beyond this is not one we wrote


@dataclass(frozen=True)
class Piece:
    """A block of a tensor held by one saved file."""

    file: int
    key: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass
class SavedTensor:
    """A tensor of a checkpoint, whole or in pieces; read any region of it with SavedState."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece]


def _box(offsets: tuple[int, ...], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    return [(o, o + n) for o, n in zip(offsets, shape, strict=True)]


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
    out = [(max(s0, s1), min(e0, e1)) for (s0, e0), (s1, e1) in zip(a, b, strict=True)]
    return None if any(s >= e for s, e in out) else out


def _slices(box: list[tuple[int, int]], origin: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(s - o, e - o) for (s, e), o in zip(box, origin, strict=True))


def check_tiling(t: SavedTensor) -> None:
    """The pieces of `t` lie inside it, do not overlap, and cover every element exactly once
    (CheckpointCorruptError naming the tensor otherwise)."""
    boxes = []
    for p in t.pieces:
        dims = zip(p.offsets, p.shape, t.shape, strict=False)
        if len({len(p.offsets), len(p.shape), len(t.shape)}) > 1 or any(
            o < 0 or n < 0 or o + n > size for o, n, size in dims
        ):
            raise CheckpointCorruptError(
                f"{t.name}: a piece at offsets {list(p.offsets)} of shape {list(p.shape)} lies "
                f"outside the tensor's shape {list(t.shape)}"
            )
        if math.prod(p.shape):
            boxes.append(_box(p.offsets, p.shape))
    covered = sum(math.prod(e - s for s, e in b) for b in boxes)
    overlap = None
    if len(t.shape) and all(b[1:] == [(0, n) for n in t.shape[1:]] for b in boxes):
        # Split along the first dimension only (FSDP's layout): sorted intervals suffice.
        rows = sorted(b[0] for b in boxes)
        overlap = next((i for i in range(1, len(rows)) if rows[i][0] < rows[i - 1][1]), None)
    else:
        pairs = ((i, j) for i in range(len(boxes)) for j in range(i))
        overlap = next((i for i, j in pairs if _intersect(boxes[i], boxes[j])), None)
    if overlap is not None or covered != math.prod(t.shape):
        raise CheckpointCorruptError(
            f"{t.name}: the saved pieces do not tile the tensor of shape {list(t.shape)} "
            f"exactly ({covered} of {math.prod(t.shape)} elements covered"
            f"{', with overlapping pieces' if overlap is not None else ''})"
        )


class SavedState:
    """A checkpoint entry opened for reading by regions.

    `bases` are the entry's files without extension (`model`, or `optimizer/rank-00000` ...);
    `source` is the index of the file whose non-tensor values and replicated tensors this rank
    takes. `structure` is the source's state with every tensor (or piece) replaced by a
    SavedTensor spanning all files. Files were verified against the manifest before; from a
    store that is not a local filesystem, what `read` parses is hashed again first."""

    def __init__(
        self, where: Storage, files: dict[str, Any], bases: list[str], source: int
    ) -> None:
        self.where = where
        self.files = files
        self.bases = bases
        self._local = where.local_path() is not None
        self._headers: dict[int, dict[str, tuple[torch.dtype, tuple[int, ...]]]] = {}
        pieces: dict[str, SavedTensor] = {}
        structures = [self._structure(i, pieces) for i in range(len(bases))]
        for t in pieces.values():
            check_tiling(t)
        self.structure = structures[source]

    def _structure(self, index: int, pieces: dict[str, SavedTensor]) -> Any:
        base = self.bases[index]
        js = f"{base}.json"
        raw = _read_checked(self.where, js, None if self._local else self.files)
        structure = parse_json(raw, self.where.display(js))

        def leaf(marker: str, value: Any, path: list[str]) -> SavedTensor:
            name = ".".join(path)
            if marker == TENSOR:
                dtype, shape = self._header(index).get(value, (None, None))
                if dtype is None:
                    raise StateFormatError(f"{name}: no tensor {value!r} in {base}.safetensors")
                return SavedTensor(
                    name, shape, dtype, [Piece(index, value, (0,) * len(shape), shape)]
                )
            shape, offsets = tuple(value["shape"]), tuple(value["offsets"])
            dtype = TORCH_DTYPES.get(value["dtype"])
            stored = self._header(index).get(value["tensor"][TENSOR])
            if dtype is None or stored is None or stored[0] != dtype:
                raise StateFormatError(f"{name}: the piece in {base} has no {value['dtype']} data")
            piece = Piece(index, value["tensor"][TENSOR], offsets, stored[1])
            t = pieces.setdefault(name, SavedTensor(name, shape, dtype, []))
            if (t.shape, t.dtype) != (shape, dtype):
                raise CheckpointCorruptError(
                    f"{name}: the saved pieces disagree on the tensor (shape {list(t.shape)} "
                    f"{t.dtype} vs {list(shape)} {dtype} in {base})"
                )
            t.pieces.append(piece)
            return t

        try:
            return decode_with(structure, leaf)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, CheckpointCorruptError | StateFormatError):
                raise
            raise StateFormatError(f"{self.where.display(js)}: malformed piece ({e!r})") from e

    def _header(self, index: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """{key: (dtype, shape)} of a safetensors file, from its JSON header alone."""
        if index in self._headers:
            return self._headers[index]
        rel = f"{self.bases[index]}.safetensors"
        out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        if rel in self.files:

            def head() -> bytes:
                with self.where.open_read(rel) as f:
                    (n,) = struct.unpack("<Q", f.read(8))
                    if n > min(_MAX_HEADER, self.files[rel]["size"]):
                        raise StateFormatError(f"{self.where.display(rel)}: not safetensors")
                    return f.read(n)

            try:
                header = json.loads(retrying(f"reading {rel}", head, self.where.retries))
                for key, meta in header.items():
                    if key != "__metadata__":
                        out[key] = (TORCH_DTYPES[meta["dtype"]], tuple(meta["shape"]))
            except (ValueError, KeyError, TypeError, struct.error) as e:
                raise StateFormatError(
                    f"{self.where.display(rel)}: not a valid safetensors file ({e!r})"
                ) from e
        self._headers[index] = out
        return out

    def read(self, requests: list[tuple[SavedTensor, tuple[int, ...], torch.Tensor]]) -> None:
        """Fill each `out` with the block of its SavedTensor at `offsets` (out's shape), one
        saved file at a time: only overlapping regions are read from local files; a file of
        an object store is fetched (and hashed) once, then dropped."""
        by_file: dict[int, list[tuple[Piece, tuple[slice, ...], torch.Tensor, tuple]]] = {}
        for t, offsets, out in requests:
            if out.dtype != t.dtype:
                raise ValueError(f"{t.name}: saved as {t.dtype}, this run holds {out.dtype}")
            want = _box(offsets, tuple(out.shape))
            for p in t.pieces:
                common = _intersect(want, _box(p.offsets, p.shape)) if out.dim() else []
                if common is None:
                    continue
                src = _slices(common, p.offsets)
                dst = _slices(common, offsets)
                by_file.setdefault(p.file, []).append((p, src, out, dst))
        for index, work in sorted(by_file.items()):
            self._read_file(index, work)

    def _read_file(self, index: int, work: list) -> None:
        rel = f"{self.bases[index]}.safetensors"
        try:
            if self._local:
                with safe_open(self.where.local_path(rel), framework="pt", device="cpu") as f:

                    def get(p: Piece, src: tuple[slice, ...]) -> torch.Tensor:
                        return f.get_slice(p.key)[src] if src else f.get_tensor(p.key)

                    self._copy(work, get)
            else:
                data = _read_checked(self.where, rel, self.files)
                tensors = load_safetensors_bytes(data)
                self._copy(work, lambda p, src: tensors[p.key][src])
        except (SafetensorError, KeyError, ValueError, RuntimeError) as e:
            if isinstance(e, StateFormatError):
                raise
            raise StateFormatError(f"{self.where.display(rel)}: cannot read ({e!r})") from e

    @staticmethod
    def _copy(work: list, get: Callable[[Piece, tuple[slice, ...]], torch.Tensor]) -> None:
        for p, src, out, dst in work:
            block = get(p, src)
            expected = tuple(s.stop - s.start for s in src)
            if tuple(block.shape) != expected or block.dtype != out.dtype:
                raise StateFormatError(f"piece {p.key}: holds {list(block.shape)} {block.dtype}")
            out[dst] = block

    def full(self) -> Any:
        """`structure` with every SavedTensor read whole (on the CPU)."""
        requests: list[tuple[SavedTensor, tuple[int, ...], torch.Tensor]] = []

        def whole(node: Any) -> Any:
            if isinstance(node, SavedTensor):
                out = torch.empty(node.shape, dtype=node.dtype)
                requests.append((node, (0,) * len(node.shape), out))
                return out
            if isinstance(node, dict):
                return {k: whole(v) for k, v in node.items()}
            if isinstance(node, list):
                return [whole(v) for v in node]
            if isinstance(node, tuple):
                return tuple(whole(v) for v in node)
            return node

        state = whole(self.structure)
        self.read(requests)
        return state


def piece_bases(name: str, files: dict[str, Any], world_size: int) -> list[str]:
    """The per-rank files of sharded entry `name` in a manifest's file list, in rank order
    (CheckpointCorruptError when one rank's description is missing)."""
    bases = [rank_name(name, r) for r in range(world_size)]
    missing = [b for b in bases if f"{b}.json" not in files]
    if missing:
        raise CheckpointCorruptError(f"{name}: no description {missing[0]}.json in the manifest")
    return bases


def read_entry(where: Storage, manifest: Any, name: str) -> Any:
    """A global or sharded entry read whole, without a process group (exports, tools)."""
    if manifest.entries.get(name) == "sharded":
        bases = piece_bases(name, manifest.files, manifest.world_size)
        return SavedState(where, manifest.files, bases, 0).full()
    return SavedState(where, manifest.files, [name], 0).full()
