"""Data path: samples/s of our DataLoader + resumable sampler against a plain torch DataLoader
with a RandomSampler over the same dataset (the tiny config's), the same batch size and collate.

Both sides iterate whole epochs in this one process, alternating (ours, plain, plain, ours,
...), `--reps` times; the figure is the ratio of the medians (target >= 0.98).

    .venv/bin/python bench/data_path.py [--reps 5] [--epochs 3] [--num-workers 0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, RandomSampler

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import figure  # noqa: E402
from core.config import load_config  # noqa: E402
from core.data import build_dataset, collate  # noqa: E402
from core.data.loader import make_dataloader  # noqa: E402
from core.data.sampler import ResumableDistributedSampler  # noqa: E402


def samples_per_s(loader_for_epoch, epochs: int) -> float:
    count, t0 = 0, time.perf_counter()
    for epoch in range(epochs):
        for batch in loader_for_epoch(epoch):
            count += batch["input_ids"].shape[0]
    return count / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--max-bytes", type=int, default=None, help="data.max_bytes")
    args = parser.parse_args()
    overrides = [] if args.max_bytes is None else ["--data.max_bytes", str(args.max_bytes)]
    config = load_config(REPO / "configs" / "tiny.yaml", overrides)
    dataset = build_dataset(config.data)
    batch, seed = config.train.per_device_batch_size, config.run.seed
    sampler = ResumableDistributedSampler(len(dataset), 1, 0, batch, seed)

    def ours(epoch: int) -> DataLoader:
        sampler.set_epoch(epoch)
        return make_dataloader(dataset, sampler, collate, args.num_workers, True, seed, 0)

    def plain(epoch: int) -> DataLoader:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        return DataLoader(
            dataset,
            batch_size=batch,
            sampler=RandomSampler(dataset, generator=g),
            collate_fn=collate,
            num_workers=args.num_workers,
            drop_last=True,
        )

    rates: dict[str, list[float]] = {"ours": [], "plain": []}
    for rep in range(args.reps):
        for name in ("ours", "plain") if rep % 2 == 0 else ("plain", "ours"):
            rates[name].append(samples_per_s(ours if name == "ours" else plain, args.epochs))
    mine, theirs = statistics.median(rates["ours"]), statistics.median(rates["plain"])
    figure(
        "data_path",
        mine,
        "samples/s",
        ratio_to="torch DataLoader + RandomSampler, same dataset and collate",
        ratio=mine / theirs,
        config={
            "samples": len(dataset),
            "batch": batch,
            "epochs": args.epochs,
            "num_workers": args.num_workers,
            "reps": args.reps,
        },
        plain_samples_per_s=theirs,
        ours_all=rates["ours"],
        plain_all=rates["plain"],
    )


if __name__ == "__main__":
    main()
