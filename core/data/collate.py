"""Samples to a batch: `input_ids` and `labels` LongTensors of shape [B, T]."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from core.data.pack import IGNORE


def block_batch(rows: np.ndarray, pin_memory: bool = False) -> dict[str, torch.Tensor]:
    """The batch of equal-length token rows without labels (token store blocks, uint16/uint32):
    one widening copy to int64 input_ids, labels a copy of them."""
    input_ids = torch.from_numpy(rows.astype(np.int64))
    if pin_memory:
        input_ids = input_ids.pin_memory()
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def collate(batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack samples into `input_ids` and `labels` LongTensors of shape [B, T], T the longest.

    Labels are the samples' own `labels` where they have them (chat data: -100 on tokens that
    are not trained on), else equal to input_ids (the model shifts them itself). Shorter samples
    are padded on the right with 0 in `input_ids` and -100 (ignored by the loss) in `labels`.
    """
    seqs = [sample["input_ids"] for sample in batch]
    given = [sample.get("labels") for sample in batch]
    if isinstance(seqs[0], np.ndarray) and given[0] is None and len({len(s) for s in seqs}) == 1:
        return block_batch(np.stack(seqs))
    lengths = [len(s) for s in seqs]
    longest = max(lengths)
    if min(lengths) == longest:  # packed data: one conversion, no padding
        input_ids = torch.tensor(seqs, dtype=torch.long)
        if given[0] is None:
            return {"input_ids": input_ids, "labels": input_ids.clone()}
        return {"input_ids": input_ids, "labels": torch.tensor(given, dtype=torch.long)}
    input_ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    labels = torch.full((len(seqs), longest), IGNORE, dtype=torch.long)
    for row, (seq, own, n) in enumerate(zip(seqs, given, lengths, strict=True)):
        values = torch.as_tensor(seq, dtype=torch.long)
        input_ids[row, :n] = values
        labels[row, :n] = values if own is None else torch.as_tensor(own, dtype=torch.long)
    return {"input_ids": input_ids, "labels": labels}
