"""The model zoo: the built-in tiny GPT, or any user factory named `package.module:factory`.

Model contract: `model(**batch)` (when the batch is a mapping, else `model(batch)`) returns the
loss as a scalar tensor, or a mapping / object holding it as `loss`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from core.config import ConfigError, ModelConfig
from core.models.tiny_gpt import TinyGPT


def build_model(cfg: ModelConfig) -> nn.Module:
    """Build the configured model on the CPU (the engine moves it to its device)."""
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
    return model


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
