"""The model zoo: the built-in tiny GPT, Hugging Face causal LMs (`hf:`, core/models/hf.py), or
any user factory named `package.module:factory`.

Model contract: `model(**batch)` (when the batch is a mapping, else `model(batch)`) returns the
loss as a scalar tensor, or a mapping / object holding it as `loss`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from core.config import HF_PREFIX, ConfigError, ModelConfig
from core.data.errors import DataError
from core.data.tokenizers import BYTES_VOCAB, HFTokenizer
from core.models.hf import (
    DTYPES,
    HFSource,
    build_hf_model,
    enable_gradient_checkpointing,
    resolve_hf,
)
from core.models.tiny_gpt import TinyGPT


def build_model(cfg: ModelConfig, hf: HFSource | None = None) -> nn.Module:
    """Build the configured model on the CPU (the engine moves it to its device), in
    model.dtype. `hf`: the checked source of an `hf:` model (resolved here when None)."""
    if cfg.name.startswith(HF_PREFIX):
        model = build_hf_model(hf or resolve_hf(cfg), cfg)
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        return model
    if cfg.name == "tiny-gpt":
        model: Any = TinyGPT(
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_embd=cfg.n_embd,
            block_size=cfg.block_size,
            dropout=cfg.dropout,
            bias=cfg.bias,
        )
    else:
        model = _load_factory(cfg.name)(**cfg.kwargs)
        if not isinstance(model, nn.Module):
            raise ConfigError(
                f"model.name: {cfg.name} returned {type(model).__name__}, expected an nn.Module"
            )
    if cfg.gradient_checkpointing:
        if not hasattr(model, "gradient_checkpointing_enable"):
            raise ConfigError(
                "model.gradient_checkpointing: the model has no gradient_checkpointing_enable()"
            )
        model.gradient_checkpointing_enable()
    # float32 leaves a model as its factory built it (a factory may mix dtypes on purpose).
    return model if cfg.dtype == "float32" else model.to(DTYPES[cfg.dtype])


def check_vocab(tokenizer: HFTokenizer | None, rows: int | None, model: str) -> None:
    """Refuse a tokenizer whose ids would index past a model's embedding (`rows` ids; None:
    the model does not say): the model's side of the data it is given, checked before any
    of it is tokenised where the model's size is known from its config (core/build_model.py)."""
    n = BYTES_VOCAB if tokenizer is None else tokenizer.vocab_size
    if rows is not None and n > rows:
        name = "bytes" if tokenizer is None else tokenizer.spec
        raise DataError(
            f"data.tokenizer: {name} produces ids up to {n - 1} ({n} tokens), but the model "
            f"{model} has an embedding of {rows} rows; use the model's own tokenizer, or a "
            f"model with vocab_size >= {n}"
        )


def embedding_rows(model: nn.Module) -> int | None:
    """Token ids the model's input embedding can look up (None when it does not say)."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else getattr(model, "wte", None)
    return embedding.num_embeddings if isinstance(embedding, nn.Embedding) else None


def _load_factory(spec: str) -> Any:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"model.name: cannot import {module_name!r} ({e})") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"model.name: {module_name} has no callable {attr!r}")
    return factory


def call_model(model: nn.Module, batch: Any) -> torch.Tensor:
    """Run the model on one batch and return its scalar loss (the model contract above)."""
    out = model(**batch) if isinstance(batch, Mapping) else model(batch)
    if isinstance(out, torch.Tensor):
        return out
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"the model returned {type(out).__name__} without a loss; return the loss tensor, "
            "or a mapping/object with .loss (pass labels in the batch)"
        )
    return loss
