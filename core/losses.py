"""Label smoothing (`train.label_smoothing_factor`), in the manner of Hugging Face's LabelSmoother.

The model contract (core.models) lets a model compute its own loss; with label smoothing the labels
are kept from the model and the smoothed cross-entropy is computed here from its `logits`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from core.models import call_model

LOGITS_NEEDED = "train.label_smoothing_factor needs a model that returns logits"


class LabelSmoother:
    """Cross-entropy with label smoothing `epsilon`, averaged over targets not equal to
    `ignore_index` (a batch whose targets are all ignored gives NaN, as F.cross_entropy does).

    The shift is decided from the shapes:
    - logits [B, T, V], labels [B, T]: a causal LM whose labels are unshifted (our model
      contract), so position t predicts label t + 1: logits[:, :-1] against labels[:, 1:];
    - logits [B, C], labels [B]: classification, no shift.
    Anything else raises ValueError. Token classification ([B, T, C] logits whose labels are
    aligned, not shifted) is therefore not supported: it would be read as a causal LM.
    """

    def __init__(self, epsilon: float, ignore_index: int = -100) -> None:
        if not 0.0 <= epsilon < 1.0:
            raise ValueError(f"label smoothing epsilon must be in [0, 1), got {epsilon}")
        self.epsilon = epsilon
        self.ignore_index = ignore_index

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The smoothed loss as a float32 scalar tensor, differentiable w.r.t. `logits`."""
        if logits.dim() == 3 and labels.dim() == 2 and logits.shape[:2] == labels.shape:
            logits, labels = logits[:, :-1], labels[:, 1:]
        elif not (logits.dim() == 2 and labels.dim() == 1 and logits.shape[0] == labels.shape[0]):
            raise ValueError(
                f"label smoothing: cannot pair logits of shape {tuple(logits.shape)} with labels "
                f"of shape {tuple(labels.shape)}; expected logits [B, T, V] with labels [B, T] "
                "(causal LM, unshifted labels) or logits [B, C] with labels [B] (classification)"
            )
        # Reshape before .float(), exactly as TinyGPT computes its own loss, so that epsilon 0
        # reproduces the model's loss bit for bit. float32 because a bf16 log-softmax over a
        # large vocabulary loses the precision the smoothed term needs.
        flat_logits = logits.reshape(-1, logits.shape[-1]).float()
        return F.cross_entropy(
            flat_logits,
            labels.reshape(-1),
            ignore_index=self.ignore_index,
            label_smoothing=self.epsilon,
        )


def compute_loss(
    model: nn.Module,
    batch: Mapping[str, Any],
    label_smoother: LabelSmoother | None,
    label_names: Sequence[str],
) -> torch.Tensor:
    """The training loss of one batch.

    Without a smoother this is `call_model(model, batch)`: the model's own loss. With one, the
    first key of `label_names` present in the batch is withheld from the model (so it does not
    spend a forward on a loss we discard), and the smoothed loss is computed from the `logits`
    the model returns (a mapping key or an attribute). The caller's batch is not modified.
    Raises ValueError when no label key is in the batch (there is nothing to smooth, and falling
    back to an unsmoothed loss would silently ignore the setting) or the model returns no logits.
    """
    if label_smoother is None:
        return call_model(model, batch)
    if not isinstance(batch, Mapping):
        raise TypeError(f"label smoothing needs a mapping batch, got {type(batch).__name__}")
    key = next((name for name in label_names if name in batch), None)
    if key is None:
        raise ValueError(
            "train.label_smoothing_factor needs labels in the batch: none of data.label_names "
            f"{list(label_names)} is among the batch keys {sorted(batch)}"
        )
    inputs = dict(batch)  # shallow copy: the caller's batch keeps its labels
    labels = inputs.pop(key)
    out = model(**inputs)
    if isinstance(out, Mapping):
        logits = out.get("logits")
    else:
        logits = getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise ValueError(
            f"{LOGITS_NEEDED} (out['logits'] or out.logits); {type(model).__name__} returned "
            f"a {type(out).__name__} without them"
        )
    return label_smoother(logits, labels)
