"""A user model (`model.name: tests.crashy_model:factory`) that crashes one worker once.

It is the built-in TinyGPT; rank `crash_rank` raises in the forward of its `crash_at`-th call
unless `marker` exists, and creates the marker first, so only the first attempt crashes.
"""

from __future__ import annotations

import os
from pathlib import Path

from core.models.tiny_gpt import TinyGPT


class CrashOnce(TinyGPT):
    def __init__(self, marker: str, crash_at: int, crash_rank: int, **sizes) -> None:
        super().__init__(**sizes)
        self.marker, self.crash_at, self.crash_rank = Path(marker), crash_at, crash_rank
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        rank = int(os.environ.get("RANK", "0"))
        if rank == self.crash_rank and self.calls == self.crash_at and not self.marker.exists():
            self.marker.touch()
            raise RuntimeError(f"injected crash on rank {rank} at forward call {self.calls}")
        return super().forward(*args, **kwargs)


def factory(marker: str, crash_at: int, crash_rank: int = 1) -> CrashOnce:
    return CrashOnce(marker, crash_at, crash_rank)
