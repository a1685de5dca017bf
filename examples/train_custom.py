"""A custom model, dataset, collator and metrics through the Python API, under torchrun:

    torchrun --standalone --nproc-per-node 2 examples/train_custom.py [--section.key VALUE ...]

It classifies 32-byte chunks of the Python standard library's source: does the chunk hold the
keyword `def`? Relaunching the same command resumes from the newest checkpoint, bit-exactly.
"""

from __future__ import annotations

import json
import sys

import datasets
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from core.callbacks import EarlyStoppingCallback
from core.config import DataConfig, load_config
from core.data import build_dataset
from core.evaluation import EvalPrediction
from core.trainer import Trainer
from launcher.session import session

SEQ = 32


class ChunkClassifier(nn.Module):
    """Bytes -> embedding -> mean over the chunk -> MLP -> 2 classes."""

    def __init__(self, width: int = 64, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, width), nn.GELU(), nn.Dropout(dropout), nn.Linear(width, 2)
        )

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.mlp(self.embed(input_ids).mean(dim=1))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def chunks(max_bytes: int, offset: int) -> datasets.Dataset:
    """Labelled chunks; `text` is kept to show data.remove_unused_columns dropping it."""
    ids = build_dataset(DataConfig(seq_len=SEQ, max_bytes=max_bytes))["input_ids"][offset:]
    text = [bytes(row).decode("utf-8", "replace") for row in ids]
    return datasets.Dataset.from_dict(
        {"input_ids": ids, "labels": [int("def" in t) for t in text], "text": text}
    )


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.tensor([r["input_ids"] for r in rows]),
        "labels": torch.tensor([r["labels"] for r in rows]),
    }


def accuracy(pred: EvalPrediction) -> dict[str, float]:
    return {"accuracy": float(np.mean(pred.predictions == pred.label_ids))}


def main(argv: list[str]) -> int:
    config = load_config(
        None,
        [
            "--run.output_dir",
            "runs/custom",
            "--train.max_steps",
            "60",
            "--train.per_device_batch_size",
            "32",
            "--eval.strategy",
            "steps",
            "--eval.steps",
            "20",
            "--checkpoint.save_steps",
            "20",
            "--checkpoint.best_metric",
            "eval_accuracy",
            *argv,
        ],
    )
    data = chunks(400_000, 0)
    train_ds, eval_ds = (
        data.select(range(len(data) - 500)),
        data.select(range(len(data) - 500, len(data))),
    )
    with session(config.engine, config.run.log_level) as s:
        trainer = Trainer(
            model_init=ChunkClassifier,
            args=config,
            train_dataset=train_ds,
            eval_dataset=eval_ds,
            data_collator=collate,
            compute_metrics=accuracy,
            preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(dim=-1),
            callbacks=[EarlyStoppingCallback(patience=3)],
            dist_info=s.info,
            device=s.device,
            stop_requested=s.stop,
        )
        result = trainer.train()
        metrics = trainer.evaluate()
        if s.info.is_main:
            print(
                json.dumps(
                    {
                        "global_step": result.global_step,
                        "training_loss": result.training_loss,
                        **metrics,
                    }
                )
            )
    return 75 if trainer.preempted else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
