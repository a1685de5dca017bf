"""Agreement across ranks: what any rank asks for, every rank does, at the same step.

A stop request reaches one rank (a signal), a callback asks another to save, a background save
fails on a third, rank 0 learns the run's lease is lost: each step ends with one small
all-reduce of these flags, so every rank stops, evaluates, saves or fails at the same step and
no rank is left waiting in a collective the others never enter. On one process: no collective.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from checkpointing.comm import control_group


def any_rank(flags: list[bool], group: Any = None) -> list[bool]:
    """For each flag: true on every rank if it is true on any rank (one small all-reduce on the
    control group, so a GPU stream is never synchronised for it)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return list(flags)
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group or control_group())
    return [bool(v) for v in t.tolist()]


@dataclass
class StepRequests:
    """What this rank asks for at the end of a step; `agreed()` is what all ranks asked."""

    signalled: bool = False
    """A stop request (a signal): checkpoint now and stop."""
    stop: bool = False
    """A callback asked the run to stop (control.should_training_stop)."""
    save: bool = False
    """A callback asked for a checkpoint at this step."""
    evaluate: bool = False
    """A callback asked for an evaluation at this step."""
    save_failed: bool = False
    """A background save failed."""
    lease_lost: bool = False
    """This job lost the run's lease: it writes nothing more."""

    def agreed(self) -> StepRequests:
        fields = dataclasses.fields(self)
        values = any_rank([getattr(self, f.name) for f in fields])
        return StepRequests(*values)
