"""Dataset columns the model does not accept (`data.remove_unused_columns`, `data.label_names`).

As Hugging Face Trainer's `_set_signature_columns_if_needed` / `_remove_unused_columns`: the
accepted names are the parameters of the model's `forward`, plus the label names, so that a
collate that passes every column as a keyword argument never hands the model an unknown one.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any, TypeVar

import datasets
from torch import nn

logger = logging.getLogger(__name__)

# Always accepted, as in HF: collators rename "label"/"label_ids" to "labels" themselves.
_ALWAYS = ("label", "label_ids")
_QA_LABELS = ("start_positions", "end_positions")

D = TypeVar("D")


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside wrappers: DDP and DeepSpeed keep it in `.module`, torch.compile
    in `._orig_mod`; their own forward is `(*args, **kwargs)` and says nothing about columns."""
    while True:
        inner = getattr(model, "module", None)
        if inner is None:  # not `or`: an empty ModuleList/Sequential is falsy
            inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _forward_parameters(model: nn.Module) -> list[inspect.Parameter]:
    # A bound method's signature already leaves out `self`.
    return list(inspect.signature(unwrap(model).forward).parameters.values())


def accepts_any_column(model: nn.Module) -> bool:
    """True when the (unwrapped) model's forward takes **kwargs: every column is accepted."""
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in _forward_parameters(model))


def signature_columns(model: nn.Module, label_names: Sequence[str] = ()) -> list[str]:
    """Column names the model accepts: the named parameters of the unwrapped `forward`, then
    "label", "label_ids" and `label_names`, without duplicates, in that order.

    *args / **kwargs are not names and are left out; ask `accepts_any_column` whether the
    forward takes **kwargs, in which case this list is not a limit.
    """
    names = [
        p.name
        for p in _forward_parameters(model)
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    return list(dict.fromkeys([*names, *_ALWAYS, *label_names]))


def default_label_names(model: nn.Module) -> list[str]:
    """The label keys when `data.label_names` is unset: start/end_positions for a forward that
    takes both (question answering, as HF), else ["labels"] if the forward accepts `labels`
    (by name or through **kwargs), else []."""
    names = set(signature_columns(model))
    if all(n in names for n in _QA_LABELS):
        return list(_QA_LABELS)
    if "labels" in names or accepts_any_column(model):
        return ["labels"]
    return []


def remove_unused_columns(
    dataset: D, model: nn.Module, label_names: Sequence[str] | None, enabled: bool
) -> D:
    """`dataset` without the columns the model does not accept.

    A `datasets.Dataset` loses those columns (`remove_columns`, a new Dataset; the input is not
    modified) and the dropped names are logged once at INFO. Returned unchanged: when `enabled`
    is false, when the forward takes **kwargs, when nothing is to be dropped, and for any other
    dataset (a torch map-style dataset has no column list; whether its batches are filtered with
    `filter_batch_keys` at collate time is the caller's decision).
    `label_names` None means `default_label_names(model)`.
    Raises ValueError when no column would remain, naming the accepted names and the columns.
    """
    if not enabled or not isinstance(dataset, datasets.Dataset) or accepts_any_column(model):
        return dataset
    if label_names is None:
        label_names = default_label_names(model)
    accepted = signature_columns(model, label_names)
    columns = dataset.column_names
    ignored = [c for c in columns if c not in accepted]  # dataset order: a stable log line
    forward = f"{type(unwrap(model)).__name__}.forward"
    if len(ignored) == len(columns):
        raise ValueError(
            f"data.remove_unused_columns: no dataset column is accepted by {forward}, which "
            f"takes {', '.join(accepted)}; the dataset has {', '.join(columns) or 'no columns'} "
            "(rename the columns, or set data.remove_unused_columns: false)"
        )
    if not ignored:
        return dataset
    logger.info(
        "The following columns in the training set are not accepted by %s and have been "
        "ignored: %s (data.remove_unused_columns: false keeps them)",
        forward,
        ", ".join(ignored),
    )
    return dataset.remove_columns(ignored)


def filter_batch_keys(batch: Mapping[str, Any], accepted: Collection[str]) -> dict[str, Any]:
    """A new dict holding only the keys of `batch` that are in `accepted`, in batch order.

    The collate-side counterpart of `remove_unused_columns` for datasets without columns;
    skip it for a model whose forward takes **kwargs (`accepts_any_column`).
    """
    return {key: value for key, value in batch.items() if key in accepted}
