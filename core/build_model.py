"""Building a run, the model stages: the model (checked against the tokenizer and data), its
loss, the engine that wraps and steps it (from the registry, core/engines/registry.py), and the
evaluator. Each is a function of the config, the user's parts and what the earlier stages built.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from checkpointing.hf_export import HFFiles
from core.config import HF_PREFIX, Config, ConfigError
from core.data import HFTokenizer, collate, load_tokenizer
from core.data.columns import default_label_names
from core.data.stream import is_stream
from core.data.tokenizers import check_vocab
from core.dist_info import DistInfo
from core.engines.base import Engine
from core.engines.registry import EngineInputs, engine_spec
from core.evaluation import evaluate
from core.losses import LabelSmoother, compute_loss
from core.models import build_model as build_named_model
from core.models import call_model, embedding_rows
from core.models.hf import HFSource, export_files, resolve_hf
from core.optim import build_optimizer, parameter_groups
from core.schedules import Schedule, build_schedule

if TYPE_CHECKING:
    from core.run import UserParts


def check_inputs(config: Config, parts: UserParts) -> tuple[HFTokenizer | None, HFSource | None]:
    """Cheap checks of the model and tokenizer first: a bad name fails before tokenising.
    Returns the tokenizer and, for an hf: model built here, its resolved source."""
    tokenizer = load_tokenizer(config.data)
    hf = None
    if config.model.name.startswith(HF_PREFIX) and parts.model is None and parts.model_init is None:
        hf = resolve_hf(config.model)
        if parts.train_dataset is None:
            _check_model_fit(config, hf, tokenizer)
    return tokenizer, hf


def build_model(
    config: Config,
    parts: UserParts,
    hf: HFSource | None,
    tokenizer: HFTokenizer | None,
    device: torch.device,
) -> tuple[nn.Module, HFFiles | None, list[str]]:
    """(the model on `device`, what an export of it needs, its label names)."""
    if parts.model_init is not None:
        model = parts.model_init()  # after seeding, so every train() gets the same init
    elif parts.model is not None:
        model = parts.model
    else:
        model = build_named_model(config.model, hf)
    if parts.train_dataset is None and tokenizer is not None:
        # Ids from a Hugging Face tokenizer must fit the embedding (a factory's model too).
        check_vocab(tokenizer, embedding_rows(model), config.model.name)
    files = _hf_files(model, tokenizer)
    label_names = config.data.label_names or default_label_names(model)
    return model.to(device), files, label_names


def loss_function(
    config: Config, label_names: list[str]
) -> Callable[[nn.Module, Any], torch.Tensor]:
    if config.train.label_smoothing_factor <= 0:
        return call_model
    return functools.partial(
        compute_loss,
        label_smoother=LabelSmoother(config.train.label_smoothing_factor),
        label_names=label_names,
    )


def build_evaluator(
    config: Config,
    parts: UserParts,
    eval_dataset: Any,
    model: nn.Module,
    engine: Engine,
    label_names: list[str],
    dist_info: DistInfo,
    stop_requested: Callable[[], bool] | None,
) -> Callable[[], dict[str, float] | None] | None:
    """Evaluation of `model` (as `engine` trains it) on `eval_dataset` (None: nothing to
    evaluate)."""
    if eval_dataset is None:
        return None
    if is_stream(eval_dataset):  # exactly-once distributed evaluation shards by sample index
        raise ConfigError(
            "eval_dataset: needs a map-style dataset (datasets.Dataset or a torch "
            "Dataset with __getitem__), not an iterable one"
        )
    return functools.partial(
        evaluate,
        model,
        eval_dataset,
        parts.data_collator or collate,
        config.eval.per_device_batch_size or config.train.per_device_batch_size,
        rank=dist_info.rank,
        world_size=dist_info.world_size,
        device=engine.device,
        compute_metrics=parts.compute_metrics,
        preprocess_logits_for_metrics=parts.preprocess_logits_for_metrics,
        label_names=label_names or ["labels"],
        bf16=config.train.bf16,
        num_workers=config.data.num_workers,
        seed=config.run.seed,
        should_stop=stop_requested,
        lockstep=engine.gathers_in_forward,
    )


def build_engine(
    config: Config,
    model: nn.Module,
    parts: UserParts,
    device: torch.device,
    total_steps: int,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    dist_info: DistInfo,
) -> Engine:
    """The engine config.engine.name names, from the registry (core/engines/registry.py)."""

    def make_optimizer(module: nn.Module) -> torch.optim.Optimizer:
        if parts.optimizer is not None:
            return parts.optimizer
        if parts.optimizer_cls_and_kwargs is not None:
            cls, kwargs = parts.optimizer_cls_and_kwargs
            return cls(parameter_groups(module, config.optim.weight_decay), **kwargs)
        return build_optimizer(module, config.optim, device)

    def make_schedule(optimizer: torch.optim.Optimizer) -> Schedule:
        if parts.lr_scheduler is not None:
            return Schedule(parts.lr_scheduler)
        sc = config.scheduler
        try:
            return build_schedule(
                optimizer, sc.name, total_steps, sc.warmup_steps, sc.warmup_ratio, sc.kwargs
            )
        except ValueError as e:
            raise ConfigError(f"scheduler.kwargs: {e}") from e

    inputs = EngineInputs(
        config,
        model,
        device,
        dist_info.world_size,
        loss_fn,
        make_optimizer,
        make_schedule,
        ready_optimizer=parts.optimizer,
        custom_optimizer=parts.optimizer is not None or parts.optimizer_cls_and_kwargs is not None,
    )
    return engine_spec(config.engine.name).build(inputs)


def _hf_files(model: nn.Module, tokenizer: HFTokenizer | None) -> HFFiles | None:
    """What a checkpoint carries to export a transformers model: its config (and generation
    config) and the tokenizer's files; None for other models."""
    if not hasattr(model, "config") or not hasattr(model, "save_pretrained"):
        return None
    files = export_files(model)
    if tokenizer is not None:
        files.update(tokenizer.files())
    return HFFiles(files)


def _check_model_fit(config: Config, hf: HFSource, tokenizer: HFTokenizer | None) -> None:
    """Before anything is tokenised: the tokenizer's ids and data.seq_len fit the model."""
    check_vocab(tokenizer, hf.vocab_size, config.model.name)
    limit = hf.max_positions
    if limit is not None and config.data.seq_len > limit:
        raise ConfigError(
            f"data.seq_len: {config.data.seq_len} exceeds the {limit} positions of "
            f"{config.model.name} (max_position_embeddings)"
        )
