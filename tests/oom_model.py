"""A user model (`model.name: tests.oom_model:factory`) that runs out of memory above a batch.

It is the built-in TinyGPT; forward raises torch.OutOfMemoryError for batches larger than
`max_batch`, like a GPU that cannot hold the activations. `OOM_RAISED` counts the raises.
"""

from __future__ import annotations

import torch

from core.models.tiny_gpt import TinyGPT

OOM_RAISED: list[int] = []


class OomAbove(TinyGPT):
    def __init__(self, max_batch: int) -> None:
        super().__init__()
        self.max_batch = max_batch

    def forward(self, input_ids, labels=None):
        if input_ids.shape[0] > self.max_batch:
            OOM_RAISED.append(input_ids.shape[0])
            raise torch.OutOfMemoryError(f"injected: batch {input_ids.shape[0]} > {self.max_batch}")
        return super().forward(input_ids, labels)


def factory(max_batch: int = 4) -> OomAbove:
    return OomAbove(max_batch)
