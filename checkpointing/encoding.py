"""Saved state as a JSON structure plus a flat dict of tensors, and back, without pickle.

`encode` splits a state (nested dicts/lists/tuples of tensors, ints, floats incl. inf/nan,
bools, None, str; DTensors and Shares as one rank's pieces) into what checkpointing/serialize.py
writes as `<name>.json` and `<name>.safetensors`; `decode` puts it back together.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

TENSOR, TUPLE, DICT = "__tensor__", "__tuple__", "__dict__"
PIECE = "__piece__"
"""One rank's piece of a sharded tensor (a DTensor, or a Share of a replicated one): its global
shape, offsets and dtype."""
_MARKERS = (TENSOR, TUPLE, DICT, PIECE)
_SCALARS = (bool, int, float, str, type(None))
# Reserved by the safetensors header for free-form metadata; never a tensor name.
_ST_METADATA = "__metadata__"


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
