"""Evaluation over a dataset sharded across ranks, independent of the world size and batching.

Each rank evaluates dataset indices rank, rank+W, ... (no padding samples, uneven shards allowed)
and keeps one record per sample: its global index, its own loss, and (for compute_metrics) its
predictions and labels. Rank 0 gathers the records, orders them by index and reduces in float64,
so 1 and N processes give exactly equal results whenever the per-sample logits are equal. The
training RNG streams and the model's train/eval modes are left exactly as they were.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from checkpointing.comm import broadcast_object, gather_objects
from checkpointing.rng import RNGState
from core.agreement import any_rank
from core.data.loader import WorkerSeeder, derive_seed
from core.engines.ddp import move_to_device

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
Arrays = Any  # a torch.Tensor / np.ndarray, or a tuple of them (several logits or label keys)


@dataclass
class EvalPrediction:
    """What compute_metrics receives, as in the Hugging Face Trainer: one row per sample, in
    global index order; variable-length rows are padded on the right with -100."""

    predictions: np.ndarray | tuple[np.ndarray, ...]
    label_ids: np.ndarray | tuple[np.ndarray, ...] | None

    def __iter__(self) -> Iterator[Any]:  # `preds, labels = eval_pred`, as with HF
        return iter((self.predictions, self.label_ids))


def loss_and_logits(out: Any) -> tuple[torch.Tensor | None, Any]:
    """(loss, logits) of a model output: a loss tensor, or a mapping/object with loss/logits."""
    if isinstance(out, torch.Tensor):
        return out, None
    if isinstance(out, Mapping):
        return out.get("loss"), out.get("logits")
    return getattr(out, "loss", None), getattr(out, "logits", None)


def evaluate(
    model: nn.Module,
    dataset: Any,
    collate_fn: Callable[[list[Any]], Any],
    batch_size: int,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    compute_metrics: Callable[[EvalPrediction], Mapping[str, Any]] | None = None,
    preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None = None,
    label_names: Sequence[str] = ("labels",),
    bf16: bool = False,
    num_workers: int = 0,
    seed: int = 0,
    should_stop: Callable[[], bool] | None = None,
    poll_every: int = 8,
    prefix: str = "eval",
    lockstep: bool = False,
) -> dict[str, float] | None:
    """Evaluate `model` on `dataset`; every rank must call this together and gets the same dict.

    Pass the unwrapped module (engine.model), not a DDP wrapper. Batches (mappings) are moved to
    `device` and the model is called as `model(**batch)`. A sample's loss is computed from the
    logits and its labels: logits [B, T, V] with labels [B, T] are a causal LM (shifted inside:
    logits[:, :-1] vs labels[:, 1:]), logits [B, C] with labels [B] a classifier; -100 is ignored
    and a sample without any labelled target has no loss. Otherwise (no logits, other shapes,
    several label keys) every sample gets its batch's loss, which then depends on the batching.
    `eval_loss` is the float64 mean over samples in index order (a mean of per-sample means),
    absent when no sample has a loss. [B, T, C] logits are always shifted (a token classifier's
    per-sample loss would be wrong).

    `preprocess_logits_for_metrics(logits, labels)` runs per batch on each rank before the gather;
    `compute_metrics(EvalPrediction)` runs on rank 0 and its keys get the `prefix_`. Returns
    {prefix}_loss, _samples, _runtime, _samples_per_second and those metrics, or None when
    `should_stop` (polled on all ranks together every `poll_every` batches) asked to stop.
    `lockstep`: every rank calls the model once per batch slot, a rank whose shard has run out
    on a throwaway batch (a sharded model gathers its parameters in forward, a collective).
    """
    n = len(dataset)
    if n == 0 or batch_size < 1 or poll_every < 1:
        raise ValueError(f"evaluate: {n} samples, batch_size {batch_size}, poll_every {poll_every}")
    start = time.perf_counter()
    # Our own generator: an iterator would otherwise draw its base seed from the global RNG.
    generator = torch.Generator()
    generator.manual_seed(derive_seed(seed, rank))
    indices = list(range(rank, n, world_size))
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=indices,  # in order; a list is a valid sampler
        collate_fn=collate_fn,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
        generator=generator,
        worker_init_fn=WorkerSeeder(seed, 0, rank) if num_workers > 0 else None,
    )
    # Rank 0 holds the most samples: every rank walks that many batch slots so that all of
    # them reach each poll point (a collective) even when their shard is shorter.
    max_batches = math.ceil(math.ceil(n / world_size) / batch_size)
    keep, preprocess = compute_metrics is not None, preprocess_logits_for_metrics
    rng = RNGState()
    rng_before = rng.state_dict()
    modes = [m.training for m in model.modules()]
    records: list[tuple[int, float | None, Any, Any]] = []
    model.eval()
    try:
        with torch.no_grad():
            batches = iter(loader)
            for b in range(max_batches):
                ids = indices[b * batch_size : (b + 1) * batch_size]
                if ids:
                    batch = move_to_device(next(batches), device)
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                        out = model(**batch)
                    records += _records(out, batch, ids, label_names, keep, preprocess)
                elif lockstep:
                    model(**move_to_device(collate_fn([dataset[0]]), device))
                if should_stop is not None and (b + 1) % poll_every == 0:
                    if any_rank([should_stop()])[0]:
                        logger.warning("%s: stop requested after %d batches", prefix, b + 1)
                        return None
    finally:
        for m, mode in zip(model.modules(), modes, strict=True):
            m.training = mode  # the attribute, not .train(): restore each module exactly
        rng.load_state_dict(rng_before)
    gathered = gather_objects(records)
    metrics = None
    if gathered:  # rank 0 (other ranks get an empty list)
        metrics = _summarise(gathered, n, compute_metrics, prefix, start)
    return broadcast_object(metrics)


def _records(
    out: Any,
    batch: Mapping[str, Any],
    ids: list[int],
    label_names: Sequence[str],
    keep: bool,
    preprocess: Callable[[Any, Any], Any] | None,
) -> list[tuple[int, float | None, Any, Any]]:
    """One record (index, loss, predictions, labels) per sample of a batch's model output `out`;
    predictions and labels only when `keep`, with the padding stripped per sample."""
    present = [batch[k] for k in label_names if k in batch]
    labels = present[0] if len(present) == 1 else tuple(present) or None
    loss, logits = loss_and_logits(out)
    losses = _sample_losses(loss, logits, labels, len(ids))
    if not keep:
        return [(i, v, None, None) for i, v in zip(ids, losses, strict=True)]
    if logits is None:
        raise TypeError("compute_metrics needs logits; the model returned none (return .logits)")
    preds = preprocess(logits, labels) if preprocess is not None else logits
    lengths, width = None, None
    if isinstance(labels, torch.Tensor) and labels.dim() == 2:
        # A sample ends at its last labelled position: trailing -100 is the collate's padding.
        pos = torch.arange(1, labels.shape[1] + 1, device=labels.device)
        lengths = ((labels != IGNORE_INDEX) * pos).amax(dim=1).tolist()
        width = labels.shape[1]
    preds_np, labels_np = _numpy(preds), _numpy(labels)
    out = []
    for row, (i, v) in enumerate(zip(ids, losses, strict=True)):
        n = None if lengths is None else lengths[row]
        out.append((i, v, _row(preds_np, row, n, width), _row(labels_np, row, n, width)))
    return out


def _sample_losses(
    loss: torch.Tensor | None, logits: Any, labels: Any, size: int
) -> list[float | None]:
    if isinstance(logits, torch.Tensor) and isinstance(labels, torch.Tensor):
        pairs = None
        if logits.dim() == 3 and labels.dim() == 2 and logits.shape[:2] == labels.shape:
            pairs = [(logits[r, :-1], labels[r, 1:]) for r in range(size)]
        elif logits.dim() == 2 and labels.dim() == 1:
            pairs = [(logits[r : r + 1], labels[r : r + 1]) for r in range(size)]
        if pairs is not None:
            # One F.cross_entropy per sample (float32, mean over its targets), the same call a
            # one-sample batch makes; one host sync for the batch. NaN = no labelled target.
            per = [F.cross_entropy(x.float(), y, ignore_index=IGNORE_INDEX) for x, y in pairs]
            return [None if math.isnan(v) else v for v in torch.stack(per).tolist()]
    if loss is None:
        return [None] * size
    return [loss.float().item()] * size  # fallback: the batch's loss, batching-dependent


def _numpy(x: Arrays) -> Arrays:
    if isinstance(x, (tuple, list)):
        return tuple(_numpy(v) for v in x)
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()  # numpy has no bf16
    return None if x is None else np.asarray(x)


def _row(x: Arrays, row: int, length: int | None, width: int | None) -> Arrays:
    """Sample `row` of x, cut to `length` along dim 1 when that dim is the labels' length."""
    if isinstance(x, tuple):
        return tuple(_row(v, row, length, width) for v in x)
    if x is None:
        return None
    if length is not None and x.ndim >= 2 and x.shape[1] == width:
        return x[row, :length].copy()
    return x[row].copy()  # a copy, so the gather pickles this row and not the whole batch


def _summarise(
    gathered: list[list[tuple[int, float | None, Any, Any]]],
    n: int,
    compute_metrics: Callable[[EvalPrediction], Mapping[str, Any]] | None,
    prefix: str,
    start: float,
) -> dict[str, float]:
    samples = sorted((s for part in gathered for s in part), key=lambda s: s[0])
    if [s[0] for s in samples] != list(range(n)):
        raise RuntimeError(f"{prefix}: gathered {len(samples)} samples, not each of {n} once")
    metrics: dict[str, Any] = {}
    losses = [s[1] for s in samples if s[1] is not None]
    if losses:
        metrics[f"{prefix}_loss"] = float(np.mean(np.asarray(losses, dtype=np.float64)))
    if compute_metrics is not None:
        labels = _stack([s[3] for s in samples]) if samples[0][3] is not None else None
        result = compute_metrics(EvalPrediction(_stack([s[2] for s in samples]), labels))
        for key, value in result.items():
            name = key if key.startswith(f"{prefix}_") else f"{prefix}_{key}"
            metrics[name] = _plain(value)
    runtime = time.perf_counter() - start
    metrics[f"{prefix}_samples"] = n
    metrics[f"{prefix}_runtime"] = runtime
    metrics[f"{prefix}_samples_per_second"] = n / runtime if runtime > 0 else 0.0
    return metrics


def _stack(rows: list[Any]) -> Arrays:
    """Rows in order as one array, right-padded with -100 where shapes differ (as HF pads)."""
    if isinstance(rows[0], tuple):
        return tuple(_stack(list(col)) for col in zip(*rows, strict=True))
    shapes = {r.shape for r in rows}
    if len(shapes) == 1:
        return np.stack(rows)
    if len({len(s) for s in shapes}) != 1:
        raise ValueError(f"per-sample predictions differ in rank: {sorted(shapes)}")
    dtype = np.result_type(*rows)
    dtype = np.int64 if dtype.kind in "ub" else dtype  # -100 must fit
    out = np.full((len(rows), *np.max([list(s) for s in shapes], axis=0)), IGNORE_INDEX, dtype)
    for i, r in enumerate(rows):
        out[(i, *(slice(0, d) for d in r.shape))] = r
    return out


def _plain(value: Any) -> Any:
    """A metric as a Python int/float (tensors, numpy scalars), so it logs as JSON."""
    value = value.item() if hasattr(value, "item") else value
    return value if isinstance(value, int) and not isinstance(value, bool) else float(value)
