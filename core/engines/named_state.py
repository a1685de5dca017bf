"""Optimizer state keyed by parameter names, so that checkpoints cross between engines.

torch's `Optimizer.state_dict()` keys parameters by their position in the param groups (0, 1,
...); torch.distributed.checkpoint's `get_optimizer_state_dict` (the FSDP engine) keys them by
fully qualified name. Both engines build their groups with core.optim.parameter_groups, in the
order of `model.named_parameters()`, so position i is the i-th name of the flattened groups:
these functions translate one form into the other. The DDP engine keeps torch's form on disk
(in shares, checkpointing.balanced) and accepts the named one when it loads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter of `optimizer`, in the flattened order of its groups."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("the optimizer holds a parameter that is not the model's")
            out.append(names[id(p)])
    return out


def is_named(state: dict[str, Any]) -> bool:
    """Whether an optimizer state dict keys its parameters by name."""
    ids = [p for g in state.get("param_groups", []) for p in g["params"]]
    return bool(ids) and all(isinstance(p, str) for p in ids)


def _check_groups(state: dict[str, Any], names: list[str]) -> None:
    saved = sum(len(g["params"]) for g in state["param_groups"])
    if saved != len(names):
        raise ValueError(
            f"the checkpoint's optimizer holds {saved} parameters, this model {len(names)}"
        )


def to_names(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """torch's positional form -> the named form (unchanged when already named)."""
    if is_named(state):
        return state
    _check_groups(state, names)
    return {
        "state": {names[i]: v for i, v in state["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]
        ],
    }


def to_positions(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The named form -> torch's positional form, numbered as this optimizer's groups are."""
    if not is_named(state):
        return state
    _check_groups(state, names)
    index = {n: i for i, n in enumerate(names)}
    unknown = sorted({p for g in state["param_groups"] for p in g["params"]} - set(index))
    if unknown:
        raise ValueError(f"the checkpoint's optimizer names parameters this model lacks: {unknown}")
    return {
        "state": {index[n]: v for n, v in state["state"].items()},
        "param_groups": [
            {**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]
        ],
    }


class OptimizerState:
    """A plain optimizer's checkpoint entry: torch's own state dict, loaded from either form."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if is_named(state):  # saved by the FSDP engine
            state = to_positions(state, param_names(self.model, self.optimizer))
        self.optimizer.load_state_dict(state)
