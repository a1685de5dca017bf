"""Optimizers with Hugging Face Trainer-style parameter groups."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from core.config import ConfigError, OptimConfig


def _is_norm(module: nn.Module) -> bool:
    norm_types = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)
    if hasattr(nn, "RMSNorm"):
        norm_types = (*norm_types, nn.RMSNorm)
    # User models often bring their own RMSNorm/LayerNorm classes.
    return isinstance(module, norm_types) or "norm" in type(module).__name__.lower()


def decay_parameter_names(model: nn.Module) -> set[str]:
    """Names of the parameters that get weight decay: all but biases and normalisation weights."""
    names: set[str] = set()
    for module_name, module in model.named_modules():
        if _is_norm(module):
            continue
        for name, _ in module.named_parameters(recurse=False):
            if not name.endswith("bias"):
                names.add(f"{module_name}.{name}" if module_name else name)
    return names


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups (decay, no decay) of trainable parameters, in model order; a tied parameter
    appears once under its first name, as in `model.named_parameters()`."""
    decay = decay_parameter_names(model)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in params if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, device: torch.device
) -> torch.optim.Optimizer:
    """Build `cfg.name` over the model's parameter groups (parameters already on `device`)."""
    groups = parameter_groups(model, cfg.weight_decay)
    if cfg.name == "adamw_torch":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if cfg.name == "adamw_torch_fused":
        try:
            return torch.optim.AdamW(
                groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True
            )
        except RuntimeError as e:
            raise ConfigError(
                f"optim.name: adamw_torch_fused is not supported on {device.type} ({e}); "
                "use adamw_torch"
            ) from e
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    if cfg.name == "adagrad":
        return torch.optim.Adagrad(groups, lr=cfg.lr, eps=cfg.eps)
    if cfg.name == "adafactor":
        if not hasattr(torch.optim, "Adafactor"):
            raise ConfigError("optim.name: adafactor needs torch >= 2.5")
        return torch.optim.Adafactor(groups, lr=cfg.lr)
    raise ConfigError(f"optim.name: unknown optimizer {cfg.name!r}")
