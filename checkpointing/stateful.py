"""The Stateful protocol: everything that must survive a restart.

The checkpoint manager is handed a mapping of names to Stateful objects and decides files,
formats, atomicity and verification; it knows nothing else of the run.
"""

from __future__ import annotations

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
