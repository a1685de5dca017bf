"""Builds a training run from a Config: data, sampler, model, optimizer, schedule, engine, loop."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import torch
from torch import nn
from torch.utils.data import Subset

from checkpointing.comm import control_group
from checkpointing.hf_export import HFFiles
from checkpointing.manager import CheckpointManager
from checkpointing.redact import display_url
from checkpointing.storage import Storage, is_private_to_process, open_storage
from core.callbacks import TrainerCallback
from core.checkpoint import RunCheckpointer, trajectory
from core.config import HF_PREFIX, Config, ConfigError, metric_greater_is_better
from core.data import (
    HFTokenizer,
    build_dataset,
    collate,
    dataset_fingerprint,
    load_tokenizer,
    sample_lengths,
)
from core.data.build import check_same_data, main_process_first
from core.data.columns import default_label_names, remove_unused_columns
from core.data.from_store import check_store, open_training_store, store_lengths, store_of
from core.data.sampler import BijectiveSampler, ResumableDistributedSampler
from core.data.stream import StreamPosition, is_stream
from core.data.tokenizers import check_vocab
from core.elastic import fit_world_size, sizing
from core.engines.base import Engine
from core.engines.registry import EngineInputs, engine_spec
from core.evaluation import evaluate
from core.loop import DistInfo, TrainLoop, plan_steps
from core.losses import LabelSmoother, compute_loss
from core.models import build_model, call_model, embedding_rows
from core.models.hf import HFSource, export_files, resolve_hf
from core.optim import build_optimizer, parameter_groups
from core.reporting.line_writer import LineWriter
from core.reporting.memory import StageMemory
from core.reporting.reporters import build_reporters
from core.schedules import Schedule, build_schedule
from core.seeding import enable_full_determinism, set_seed
from core.state import TrainState

logger = logging.getLogger(__name__)


@dataclass
class UserParts:
    """What a Python API user may bring instead of the config's built-in choices."""

    model: nn.Module | None = None
    model_init: Callable[[], nn.Module] | None = None
    train_dataset: Any = None
    eval_dataset: Any = None
    data_collator: Callable[[list[Any]], Any] | None = None
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: Any = None
    optimizer_cls_and_kwargs: tuple[type, dict[str, Any]] | None = None
    compute_metrics: Callable[..., dict[str, float]] | None = None
    preprocess_logits_for_metrics: Callable[..., Any] | None = None


def _make_sampler(
    config: Config, dataset: Any, lengths: np.ndarray | None, dist_info: DistInfo
) -> ResumableDistributedSampler | StreamPosition:
    tc = config.train
    if is_stream(dataset):
        for ok, key, why in (
            (tc.max_steps is not None, "train.max_steps", "an iterable dataset has no length"),
            (config.data.num_workers == 0, "data.num_workers", "must be 0 for an iterable dataset"),
            (not config.data.group_by_length, "data.group_by_length", "needs a map-style dataset"),
        ):
            if not ok:
                raise ConfigError(f"{key}: {why}")
        return StreamPosition(
            dist_info.world_size,
            dist_info.rank,
            tc.per_device_batch_size,
            config.run.seed,
            tc.gradient_accumulation_steps,
        )
    try:
        cls = BijectiveSampler if store_of(dataset) is not None else ResumableDistributedSampler
        return cls(
            num_samples=len(dataset),
            num_replicas=dist_info.world_size,
            rank=dist_info.rank,
            batch_size=tc.per_device_batch_size,
            seed=config.run.seed,
            drop_last=config.data.drop_last,
            lengths=lengths if config.data.group_by_length else None,
            accumulation=tc.gradient_accumulation_steps,
        )
    except ValueError as e:
        raise ConfigError(f"train.per_device_batch_size: {e}") from e


def _dataset_facts(dataset: Any) -> tuple[np.ndarray | None, str]:
    """(per-sample token counts or None, content fingerprint) of a training dataset."""
    if is_stream(dataset):
        # A stream cannot be hashed without reading it all; its type stands in.
        return None, f"stream:{type(dataset).__qualname__}"
    store = store_of(dataset)
    if store is not None:  # fixed-length blocks: no array of N lengths
        return store_lengths(dataset), f"{store.fingerprint}:{len(dataset)}"
    if isinstance(dataset, datasets.Dataset) and "input_ids" in dataset.column_names:
        return np.asarray(sample_lengths(dataset)), dataset_fingerprint(dataset)
    if isinstance(dataset, datasets.Dataset):
        return None, dataset_fingerprint(dataset)
    # A torch map-style dataset has no content hash; its type and size stand in for one.
    return None, f"{type(dataset).__qualname__}:{len(dataset)}"


def _eval_split(
    config: Config, dataset: Any, eval_dataset: Any, tokenizer: HFTokenizer | None, quiet: bool
) -> tuple[Any, Any]:
    """(training data, evaluation data or None) as the eval section asks."""
    if eval_dataset is not None or config.eval.strategy == "no":
        return dataset, eval_dataset
    if config.eval.source != "holdout":
        source = dataclasses.replace(config.data, source=config.eval.source)
        return dataset, build_dataset(source, tokenizer, quiet)
    if is_stream(dataset):
        raise ConfigError(
            "eval.source: holdout needs a map-style training dataset; pass "
            "eval_dataset or set eval.source to a file"
        )
    n, held = len(dataset), config.eval.holdout_samples
    if held >= n:
        raise ConfigError(f"eval.holdout_samples: {held} leaves no training data of {n} samples")
    if isinstance(dataset, datasets.Dataset):
        return dataset.select(range(n - held)), dataset.select(range(n - held, n))
    return Subset(dataset, range(n - held)), Subset(dataset, range(n - held, n))


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


def _build_engine(
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


def open_checkpoint_storage(config: Config, world_size: int) -> Storage:
    """The checkpoint location of a run: checkpoint.dir, or run.output_dir."""
    cc = config.checkpoint
    url = cc.dir or config.run.output_dir
    if world_size > 1 and is_private_to_process(url):
        raise ConfigError(
            f"checkpoint.dir: {display_url(url)} lives in one process's memory; with "
            f"{world_size} ranks use a shared store (a shared filesystem path, s3://, gs://)"
        )
    try:
        return open_storage(url, cc.storage_options, cc.retries)
    except (ImportError, ValueError, TypeError) as e:
        raise ConfigError(f"checkpoint.dir: cannot open {display_url(url)}: {e}") from e


def build_trainer(
    config: Config,
    dist_info: DistInfo,
    device: torch.device,
    callbacks: list[TrainerCallback] | None = None,
    stop_requested: Callable[[], bool] | None = None,
    parts: UserParts | None = None,
    memory: StageMemory | None = None,
) -> TrainLoop:
    """Everything a run needs, built in a fixed order so that seeding decides all of it."""
    parts = parts or UserParts()
    if config.run.full_determinism:
        enable_full_determinism(config.run.seed)
    else:
        set_seed(config.run.seed)

    cc = config.checkpoint
    manager = CheckpointManager(
        open_checkpoint_storage(config, dist_info.world_size),
        dist_info.rank,
        dist_info.world_size,
        save_total_limit=cc.save_total_limit,
        engine=config.engine.name,
        group=control_group(),
        greater_is_better=metric_greater_is_better(
            cc.best_metric or "eval_loss", cc.greater_is_better
        ),
        async_save=cc.async_save,
        storage_options=cc.storage_options,
    )
    # A resume on another number of ranks may change the accumulation: decide before anything
    # is sized by it.
    peeked = manager.peek(cc.resume_from)
    config = fit_world_size(config, peeked, dist_info.world_size)

    # Cheap checks of the model and tokenizer first: a bad name fails before tokenising.
    tokenizer = load_tokenizer(config.data)
    hf = None
    if config.model.name.startswith(HF_PREFIX) and parts.model is None and parts.model_init is None:
        hf = resolve_hf(config.model)
        if parts.train_dataset is None:
            _check_model_fit(config, hf, tokenizer)
    quiet = not dist_info.is_main

    def build_data() -> tuple[Any, Any]:
        data = parts.train_dataset
        if data is None and config.data.store_url is not None:
            data = open_training_store(config.data, tokenizer)
        elif data is None:
            data = build_dataset(config.data, tokenizer, quiet)
        return _eval_split(config, data, parts.eval_dataset, tokenizer, quiet)

    dataset, eval_dataset = main_process_first(build_data, dist_info.rank, dist_info.local_rank)
    store = store_of(dataset)
    if store is not None and parts.train_dataset is None:
        check_store(config.data, store, dist_info.rank, dist_info.world_size)
    lengths, data_fp = _dataset_facts(dataset)
    check_same_data(data_fp, dist_info.rank)
    sampler = _make_sampler(config, dataset, lengths, dist_info)
    if isinstance(sampler, StreamPosition):
        total_steps = config.train.max_steps  # checked by _make_sampler
    else:
        try:
            _, total_steps = plan_steps(config, sampler)
        except ValueError as e:
            raise ConfigError(f"train.per_device_batch_size: {e}") from e

    if parts.model_init is not None:
        model = parts.model_init()  # after seeding, so every train() gets the same init
    elif parts.model is not None:
        model = parts.model
    else:
        model = build_model(config.model, hf)
    if parts.train_dataset is None and tokenizer is not None:
        # Ids from a Hugging Face tokenizer must fit the embedding (a factory's model too).
        check_vocab(tokenizer, embedding_rows(model), config.model.name)
    hf_files = _hf_files(model, tokenizer)
    model = model.to(device)
    label_names = config.data.label_names or default_label_names(model)
    dataset = remove_unused_columns(dataset, model, label_names, config.data.remove_unused_columns)
    evaluator = None
    if eval_dataset is not None and is_stream(eval_dataset):
        # Exactly-once distributed evaluation shards by sample index.
        raise ConfigError(
            "eval_dataset: needs a map-style dataset (datasets.Dataset or a torch "
            "Dataset with __getitem__), not an iterable one"
        )
    if eval_dataset is not None:
        eval_dataset = remove_unused_columns(
            eval_dataset, model, label_names, config.data.remove_unused_columns
        )
        evaluator = functools.partial(
            evaluate,
            model,
            eval_dataset,
            parts.data_collator or collate,
            config.eval.per_device_batch_size or config.train.per_device_batch_size,
            rank=dist_info.rank,
            world_size=dist_info.world_size,
            device=device,
            compute_metrics=parts.compute_metrics,
            preprocess_logits_for_metrics=parts.preprocess_logits_for_metrics,
            label_names=label_names or ["labels"],
            bf16=config.train.bf16,
            num_workers=config.data.num_workers,
            seed=config.run.seed,
            should_stop=stop_requested,
        )
    loss_fn = call_model
    if config.train.label_smoothing_factor > 0:
        loss_fn = functools.partial(
            compute_loss,
            label_smoother=LabelSmoother(config.train.label_smoothing_factor),
            label_names=label_names,
        )
    engine = _build_engine(config, model, parts, device, total_steps, loss_fn, dist_info)
    if evaluator is not None and engine.gathers_in_forward:
        evaluator = functools.partial(evaluator, lockstep=True)
    n_params = sum(p.numel() for p in model.parameters())
    if dist_info.is_main:
        logger.info(
            "model %s: %.2fM parameters; %s samples, %d steps on %d rank(s), device %s",
            type(model).__name__,
            n_params / 1e6,
            "streamed" if is_stream(dataset) else len(dataset),
            total_steps,
            dist_info.world_size,
            device,
        )
    state = TrainState()
    checkpointer = RunCheckpointer(
        config,
        manager,
        engine,
        sampler,
        state,
        trajectory(
            config,
            dist_info.world_size,
            data_fp,
            total_steps,
            tokenizer.fingerprint if tokenizer is not None else None,
        ),
        hf_files,
    )
    checkpointer.sized_for = sizing(peeked)
    reporters: list[TrainerCallback] = []
    writer = None
    if dist_info.is_main:
        writer = LineWriter()
        reporters = build_reporters(
            config, total_steps, dist_info.world_size, dist_info.restart_count, writer
        )
    return TrainLoop(
        config,
        engine,
        dataset,
        sampler,
        parts.data_collator or collate,
        lengths,
        dist_info,
        callbacks=[*reporters, *(callbacks or [])],
        state=state,
        checkpointer=checkpointer,
        stop_requested=stop_requested,
        evaluator=evaluator,
        memory=memory,
        writer=writer,
    )
