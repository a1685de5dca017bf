"""How state survives: the Stateful protocol, and (later) layout, storage, save and load."""

from checkpointing.stateful import Stateful

__all__ = ["Stateful"]
