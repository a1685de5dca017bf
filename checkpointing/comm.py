"""The few collectives checkpointing needs, on a CPU-capable group; no-ops on one process.

Control messages (digests, the chosen checkpoint) are small Python objects. They
go over a gloo group even when training uses nccl, so they never synchronise the GPU stream.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

_CONTROL_GROUP: Any = None


def control_group() -> Any:
    """A gloo group over all ranks (the default group when it is gloo). Every rank must call
    this at the same point the first time, as with any group creation."""
    global _CONTROL_GROUP
    if not dist.is_initialized():
        return None
    if _CONTROL_GROUP is None:
        _CONTROL_GROUP = (
            dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        )
    return _CONTROL_GROUP


def reset_control_group() -> None:
    """Forget the group (after destroy_process_group)."""
    global _CONTROL_GROUP
    _CONTROL_GROUP = None


def _active() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def barrier(group: Any = None) -> None:
    if _active():
        dist.barrier(group=group or control_group())


def broadcast_object(obj: Any, group: Any = None) -> Any:
    """Rank 0's `obj` on every rank."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group or control_group())
    return box[0]


def gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj`, in rank order, on rank 0 (other ranks get an empty list)."""
    if not _active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(
        obj, out if dist.get_rank() == 0 else None, dst=0, group=group or control_group()
    )
    return out
