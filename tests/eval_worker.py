"""Worker for tests/test_core/test_evaluation.py: evaluates a seeded TinyGPT on a fixed dataset and
writes rank 0's metrics as JSON to argv[1]. Under torchrun it joins a gloo group; run plainly it
is one process without a group. The builders are shared with the in-process tests.
"""

from __future__ import annotations

import json
import math
import os
import sys

import datasets
import numpy as np
import torch
import torch.distributed as dist

from checkpointing.comm import reset_control_group
from core.agreement import any_rank
from core.data import collate
from core.evaluation import EvalPrediction, evaluate
from core.models.tiny_gpt import TinyGPT
from launcher.dist import exit_worker

NUM_SAMPLES = 21  # odd: two ranks get 11 and 10 samples


def make_model(dropout: float = 0.0) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(n_layer=1, n_head=2, n_embd=32, block_size=32, dropout=dropout)


def make_dataset(n: int = NUM_SAMPLES) -> datasets.Dataset:
    """n byte sequences of 2..32 tokens (so batches are padded), from a fixed local generator."""
    gen = np.random.default_rng(0)
    rows = [gen.integers(0, 256, int(gen.integers(2, 33))).tolist() for _ in range(n)]
    return datasets.Dataset.from_dict({"input_ids": rows})


def argmax_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def next_token_metrics(p: EvalPrediction) -> dict[str, float]:
    """Next-token accuracy, and a sum that changes if the rows come in another order."""
    preds, labels = p
    target = labels[:, 1:]
    mask = target != -100
    accuracy = (preds[:, :-1] == target)[mask].mean()
    order = sum(i * int(row[row != -100].sum()) for i, row in enumerate(labels))
    return {"accuracy": float(accuracy), "order": float(order)}


def main(out_path: str) -> None:
    torch.set_num_threads(1)  # the same kernels in every process, so logits match bit for bit
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    try:
        rank = dist.get_rank() if distributed else 0
        world = dist.get_world_size() if distributed else 1
        model, ds = make_model(), make_dataset()
        common = {"rank": rank, "world_size": world, "device": torch.device("cpu")}
        metrics = {"nproc": world}
        for bs in (1, 4):
            metrics[f"bs{bs}"] = evaluate(
                model,
                ds,
                collate,
                bs,
                **common,
                compute_metrics=next_token_metrics,
                preprocess_logits_for_metrics=argmax_logits,
                should_stop=lambda: False,
                poll_every=1,  # a poll after every batch slot, also past a short shard's end
            )
        # Only the last rank asks to stop, at the one poll point: past that rank's last batch.
        stopped = evaluate(
            model,
            ds,
            collate,
            1,
            **common,
            should_stop=lambda: rank == world - 1,
            poll_every=math.ceil(len(ds) / world),
        )
        metrics["stopped_on_every_rank"] = not any_rank([stopped is not None])[0]
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(metrics, f)
    finally:
        if distributed:
            dist.destroy_process_group()
            reset_control_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_worker(0)
