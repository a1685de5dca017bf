"""Replicated state saved in shares: every rank writes about 1/W of its bytes.

Under DDP every rank holds the whole model and optimizer state. Written by one rank, a
checkpoint of a 7B model puts a 56 GB optimizer file on one process and one network card while
the others wait. `Balanced` wraps such a Stateful as a sharded entry (checkpointing.sharded):
its tensors are laid end to end in the state's order and cut into W runs of equal bytes at
row boundaries (the first dimension), so a large tensor is split between ranks and every rank's
share is within one row of total / W. Rank r writes `<name>/rank-<r>` holding the whole
structure with its pieces (empty pieces where it holds no rows; 0-dim tensors, a few bytes,
whole on every rank), described like an FSDP engine's shards: one reader serves both, and a
checkpoint written so loads on any number of ranks, under either engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from checkpointing.encoding import Share
from checkpointing.stateful import Stateful


def _tensors(state: Any, out: list[torch.Tensor]) -> None:
    if isinstance(state, torch.Tensor):
        out.append(state)
    elif isinstance(state, Mapping):
        for v in state.values():
            _tensors(v, out)
    elif isinstance(state, list | tuple):
        for v in state:
            _tensors(v, out)


def _view_key(t: torch.Tensor) -> tuple:
    """Identifies a view of memory: tied weights (one tensor under two names) share one split."""
    where = (t.device, t.untyped_storage().data_ptr(), t.storage_offset())
    return (*where, tuple(t.shape), t.stride())


def row_ranges(state: Any, world_size: int) -> dict[tuple, list[tuple[int, int]]]:
    """For each distinct tensor of `state` with at least one dimension: the rows [lo, hi) each
    rank writes. Every rank computes the same ranges from the same (replicated) state."""
    seen: dict[tuple, torch.Tensor] = {}
    tensors: list[torch.Tensor] = []
    _tensors(state, tensors)
    for t in tensors:
        if t.dim() and t.numel():
            seen.setdefault(_view_key(t), t)
    total = sum(t.numel() * t.element_size() for t in seen.values())
    ranges: dict[tuple, list[tuple[int, int]]] = {}
    cursor = 0
    for key, t in seen.items():
        rows = t.shape[0]
        row_bytes = t.numel() // rows * t.element_size()
        # Rank r starts at byte total * r / W of the whole: its first row is the first whose
        # first byte lies there or later (integer arithmetic, times W to stay exact).
        starts = [
            min(rows, max(0, -(-(total * r - cursor * world_size) // (row_bytes * world_size))))
            for r in range(world_size)
        ]
        ends = [*starts[1:], rows]
        ranges[key] = list(zip(starts, ends, strict=True))
        cursor += rows * row_bytes
    return ranges


def share(state: Any, rank: int, world_size: int) -> Any:
    """`state` with every tensor of one or more dimensions replaced by this rank's Share."""
    ranges = row_ranges(state, world_size)

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            if not node.dim():
                return node
            lo, hi = ranges[_view_key(node)][rank] if node.numel() else (0, 0)
            offsets = (lo,) + (0,) * (node.dim() - 1)
            return Share(node[lo:hi], tuple(node.shape), offsets)
        if isinstance(node, Mapping):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, tuple):
            return tuple(walk(v) for v in node)
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(state)


class Balanced:
    """A replicated Stateful saved as a sharded entry: each rank writes its share; a load
    (of this layout on any number of ranks, of an older single-file checkpoint, or of an FSDP
    checkpoint) reads the whole state and hands it to the object."""

    def __init__(self, obj: Stateful, rank: int, world_size: int) -> None:
        self.obj, self.rank, self.world_size = obj, rank, world_size

    def state_dict(self) -> Any:
        return share(self.obj.state_dict(), self.rank, self.world_size)

    def load_pieces(self, saved: Any) -> None:
        self.obj.load_state_dict(saved.full())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.obj.load_state_dict(state)
