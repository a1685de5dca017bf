"""A user model for the Slurm tests (`model.name: tests.deploy.paced_model:factory`): the
built-in TinyGPT with the tiny config's sizes (so the losses are tiny-gpt's), whose forward
sleeps `pace_s` in a Slurm job's first attempt only (SLURM_RESTART_COUNT unset or 0): a signal
or a kill then lands mid-run at a known pace, and the requeued attempt runs at full speed."""

from __future__ import annotations

import os
import time

from core.models.tiny_gpt import TinyGPT


class Paced(TinyGPT):
    def __init__(self, pace_s: float) -> None:
        super().__init__()
        self.pace_s = pace_s if os.environ.get("SLURM_RESTART_COUNT", "0") == "0" else 0.0

    def forward(self, *args, **kwargs):
        time.sleep(self.pace_s)
        return super().forward(*args, **kwargs)


def factory(pace_s: float = 0.0) -> Paced:
    return Paced(pace_s)
