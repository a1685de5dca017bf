"""What each config field means to a checkpoint, declared beside the field itself.

Every field of every section is annotated `Annotated[type, ROLE]` with one of:

- `TRAJECTORY`: the field decides the run's trajectory (the bits of every step). A checkpoint
  records it, and a resume with another value is refused unless checkpoint.allow_config_change.
- `NEUTRAL`: the field does not change what is computed (where files go, how often a line is
  logged, how data is read); a resume may change it freely.
- `Added(old)`: a trajectory field introduced after checkpoints were first written; `old` is the
  value every run had before it, which an older checkpoint without the field is taken to record.

The trajectory (core/checkpoint.py) and its compatibility check derive from these declarations;
tests/test_config.py fails for a field declared without one.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, eq=False)
class Role:
    kind: str
    """trajectory, neutral or added."""
    old: Any = None
    """For an added field: the value checkpoints written before it are taken to hold."""

    @property
    def in_trajectory(self) -> bool:
        return self.kind != "neutral"


TRAJECTORY = Role("trajectory")
NEUTRAL = Role("neutral")


def Added(old: Any) -> Role:
    """A trajectory field added later; older checkpoints are taken to record `old`."""
    return Role("added", old)


def field_roles(cls: type) -> dict[str, Role | None]:
    """{field name: its declared Role, or None where the field declares none} of a section."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out: dict[str, Role | None] = {}
    for f in dataclasses.fields(cls):
        extras = getattr(hints[f.name], "__metadata__", ())
        roles = [m for m in extras if isinstance(m, Role)]
        out[f.name] = roles[0] if len(roles) == 1 else None
    return out
