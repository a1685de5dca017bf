"""The Stateful protocol: everything that must survive a restart.

The checkpoint manager is handed a mapping of names to Stateful objects and decides files,
formats, atomicity and verification; it knows nothing else of the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    """`state_dict()` returns everything needed to continue; `load_state_dict(d)` restores it
    exactly, so that `load_state_dict(state_dict())` on a fresh object reproduces the trajectory."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@runtime_checkable
class DirectoryState(Protocol):
    """State that writes its own files (DeepSpeed's shards) into a directory of the checkpoint.

    Both calls are collectives: every rank writes (or reads) its part of `directory`, which all
    ranks see (a shared filesystem). The manager hashes whatever was written into the manifest
    and verifies it before `load_from` is called.
    """

    def save_to(self, directory: Path) -> None: ...

    def load_from(self, directory: Path) -> None: ...


@runtime_checkable
class ShardedState(Protocol):
    """State whose tensors are distributed (DTensors): `state_dict()` holds this rank's pieces,
    each rank writes them as `<name>/rank-<r>`, and `load_pieces(saved)` reads, for this run's
    layout on any number of ranks, the regions it needs (a checkpointing.sharded.SavedState,
    which also opens a global entry of the same state, e.g. one the DDP engine wrote)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_pieces(self, saved: Any) -> None: ...


@dataclass
class Entry:
    """One piece of state: global entries are written once (rank 0), per-rank and sharded
    ones by every rank as `<name>/rank-<r>`; a DirectoryState writes its own files under
    `<name>/`."""

    obj: Stateful | DirectoryState
    per_rank: bool = False
    elastic: bool = False
    """A per-rank entry that may resume on a different number of ranks: rank r then loads the
    piece saved by rank `r mod saved_world_size`. Without it such a resume is refused."""
    optional: bool = False
    """A checkpoint may lack it (one written before the entry existed): the object is then
    left as the run built it. Without it such a checkpoint is refused."""

    @property
    def rank_files(self) -> bool:
        """Whether every rank writes a file of its own."""
        return self.kind in ("per_rank", "sharded")

    @property
    def kind(self) -> str:
        """How the manifest records the entry: global, per_rank, sharded or directory."""
        if isinstance(self.obj, ShardedState):
            return "sharded"
        if isinstance(self.obj, DirectoryState) and not isinstance(self.obj, Stateful):
            return "directory"
        return "per_rank" if self.per_rank else "global"


def rank_name(name: str, rank: int) -> str:
    """The file name (without extension) of a per-rank entry's piece."""
    return f"{name}/rank-{rank:05d}"


def split_by_size(sized: list[tuple[int, str]], world_size: int, rank: int) -> list[str]:
    """This rank's share of files: largest first, each to the rank with the fewest bytes so far.
    Every rank computes the same split from the same list."""
    load = [0] * world_size
    mine = []
    for size, rel in sorted(sized, reverse=True):
        r = min(range(world_size), key=lambda i: (load[i], i))
        load[r] += size
        if r == rank:
            mine.append(rel)
    return mine
