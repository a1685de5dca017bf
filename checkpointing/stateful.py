"""The Stateful protocol: everything that must survive a restart.

The checkpoint manager is handed a mapping of names to Stateful objects and decides files,
formats, atomicity and verification; it knows nothing else of the run.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    """`state_dict()` returns everything needed to continue; `load_state_dict(d)` restores it
    exactly, so that `load_state_dict(state_dict())` on a fresh object reproduces the trajectory."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...
