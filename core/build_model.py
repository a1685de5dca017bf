"""Building a run, the model stage: cheap checks of the model and tokenizer before any data is
tokenised (`check_inputs`), then the model itself with its loss, its label names and the datasets
trimmed to what its forward takes (`build_model`). The engine that wraps and steps it is the next
stage (core/build_engine.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from checkpointing.hf_export import HFFiles
from core.build_data import DataParts
from core.config import HF_PREFIX, Config, ConfigError
from core.data import HFTokenizer, load_tokenizer
from core.data.columns import default_label_names, remove_unused_columns
from core.losses import LabelSmoother, compute_loss
from core.models import build_model as build_named_model
from core.models import call_model, check_vocab, embedding_rows
from core.models.hf import HFSource, export_files, resolve_hf

if TYPE_CHECKING:
    from core.run import UserParts

Loss = Callable[[nn.Module, Any], torch.Tensor]


@dataclass
class ModelParts:
    model: nn.Module
    """On the run's device, not yet wrapped by the engine."""
    hf_files: HFFiles | None
    """What an export of a transformers model needs (None for other models)."""
    label_names: list[str]
    loss_fn: Loss
    dataset: Any
    """The training data with the columns the model's forward does not take removed."""
    eval_dataset: Any


def check_inputs(config: Config, parts: UserParts) -> tuple[HFTokenizer | None, HFSource | None]:
    """Cheap checks of the model and tokenizer first: a bad name fails before tokenising.
    Returns the tokenizer and, for an hf: model built here, its resolved source."""
    tokenizer = load_tokenizer(config.data)
    hf = None
    if config.model.name.startswith(HF_PREFIX) and parts.model is None and parts.model_init is None:
        hf = resolve_hf(config.model)
        limit = hf.max_positions
        if parts.train_dataset is None:  # what is tokenised must fit the model
            check_vocab(tokenizer, hf.vocab_size, config.model.name)
            if limit is not None and config.data.seq_len > limit:
                raise ConfigError(
                    f"data.seq_len: {config.data.seq_len} exceeds the {limit} positions of "
                    f"{config.model.name} (max_position_embeddings)"
                )
    return tokenizer, hf


def build_model(
    config: Config,
    parts: UserParts,
    hf: HFSource | None,
    tokenizer: HFTokenizer | None,
    device: torch.device,
    data: DataParts,
) -> ModelParts:
    """The model (the user's, their factory's, or the config's) on `device`, its loss and label
    names, and `data`'s datasets trimmed to the model's inputs."""
    if parts.model_init is not None:
        model = parts.model_init()  # after seeding, so every train() gets the same init
    elif parts.model is not None:
        model = parts.model
    else:
        model = build_named_model(config.model, hf)
    if parts.train_dataset is None and tokenizer is not None:
        # Ids from a Hugging Face tokenizer must fit the embedding (a factory's model too).
        check_vocab(tokenizer, embedding_rows(model), config.model.name)
    label_names = config.data.label_names or default_label_names(model)
    smoothing = config.train.label_smoothing_factor
    loss_fn: Loss = call_model
    if smoothing > 0:
        smoother = LabelSmoother(smoothing)
        loss_fn = functools.partial(compute_loss, label_smoother=smoother, label_names=label_names)
    drop = config.data.remove_unused_columns
    dataset = remove_unused_columns(data.dataset, model, label_names, drop)
    eval_dataset = data.eval_dataset
    if eval_dataset is not None:  # map-style (core/build_data.py refuses a stream)
        eval_dataset = remove_unused_columns(eval_dataset, model, label_names, drop)
    files = None  # what a checkpoint carries to export a transformers model
    if hasattr(model, "config") and hasattr(model, "save_pretrained"):
        files = HFFiles({**export_files(model), **(tokenizer.files() if tokenizer else {})})
    return ModelParts(model.to(device), files, label_names, loss_fn, dataset, eval_dataset)
