"""FSDP2: PyTorch-native sharding (`fully_shard`, DTensor parameters) for models larger than
one device.

Each wrapped block and then the root are sharded over a 1-D mesh of all ranks; parameters,
gradients and optimizer state live in shards (dim 0 split across ranks), gathered per block
for forward and backward. Checkpoints hold each rank's shards only (checkpointing/sharded.py)
and load on any number of ranks, and from or into a DDP checkpoint, by name.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from checkpointing.sharded import SavedState, SavedTensor
from checkpointing.stateful import DirectoryState, Stateful
from core.config import ConfigError
from core.engines.base import Engine
from core.engines.ddp import move_to_device
from core.engines.named_state import param_names, to_names
from core.engines.registry import EngineInputs
from core.models import call_model
from core.models.tiny_gpt import Block, TinyGPT
from core.schedules import Schedule

logger = logging.getLogger(__name__)


def wrap_classes(model: nn.Module, wrap: list[str] | None) -> list[str]:
    """The module classes sharded as units of their own: `wrap`, or the model's default (a
    transformers model's `_no_split_modules`, TinyGPT's blocks). ConfigError naming the model's
    classes when one of `wrap` matches no module."""
    present = {type(m).__name__ for m in model.modules()}
    if wrap is None:
        if isinstance(model, TinyGPT):
            return [Block.__name__]
        default = getattr(model, "_no_split_modules", None) or []
        return [c for c in default if c in present]
    missing = [c for c in wrap if c not in present]
    if missing:
        raise ConfigError(
            f"engine.fsdp.wrap: {', '.join(missing)} matches no module of "
            f"{type(model).__name__}; its classes are: {', '.join(sorted(present))}"
        )
    return list(wrap)


def _process_group() -> int:
    """The world size; one process without torchrun gets a group of its own (FSDP needs one)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_world_size()


class FSDPEngine(Engine):
    gathers_in_forward = True

    def __init__(
        self,
        model: nn.Module,
        build_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
        make_schedule: Callable[[torch.optim.Optimizer], Schedule],
        device: torch.device,
        wrap: list[str] | None = None,
        reshard_after_forward: bool = True,
        bf16: bool = False,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] = call_model,
    ) -> None:
        self.device = device
        self._loss_fn = loss_fn
        classes = wrap_classes(model, wrap)
        mesh = init_device_mesh(device.type, (_process_group(),))
        # bf16 compute and all-gathers, fp32 gradient reduction, fp32 master weights (the
        # sharded parameters keep the model's dtype).
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if bf16
            else MixedPrecisionPolicy()
        )
        kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward, "mp_policy": policy}
        # Innermost first: a unit's parameters are those not already in a unit below it.
        units = [m for m in reversed(list(model.modules())) if type(m).__name__ in classes]
        for module in units:
            if module is not model:
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)
        if dist.get_rank() == 0:
            logger.info(
                "fsdp: %d unit(s) of %s and the root, sharded over %d rank(s)",
                len(units),
                ", ".join(classes) or "nothing",
                mesh.size(),
            )
        self._model = model
        self.optimizer = build_optimizer(model)  # over the sharded (DTensor) parameters
        self.schedule = make_schedule(self.optimizer)
        self._params = [p for p in model.parameters() if p.requires_grad]

    @property
    def model(self) -> nn.Module:
        return self._model

    def train(self, mode: bool = True) -> None:
        self._model.train(mode)

    @contextlib.contextmanager
    def _sync(self, sync: bool) -> Iterator[None]:
        # Without sync the backward keeps unsharded gradients and skips the reduce-scatter;
        # the last micro-batch reduces the accumulated sum once.
        self._model.set_requires_gradient_sync(sync)  # type: ignore[operator]
        yield

    def accumulate(self, sync: bool) -> contextlib.AbstractContextManager[Any]:
        return self._sync(sync)

    def forward(self, batch: Any) -> torch.Tensor:
        return self._loss_fn(self._model, move_to_device(batch, self.device))

    def backward(self, loss: torch.Tensor, num_micro_batches: int) -> None:
        (loss / num_micro_batches if num_micro_batches > 1 else loss).backward()

    def optimizer_step(self, max_grad_norm: float) -> torch.Tensor | None:
        norm = None
        if max_grad_norm > 0:
            grads = [p.grad for p in self._params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, 2.0)
            if isinstance(norm, DTensor):  # partial norms of the shards -> the global norm
                norm = norm.full_tensor()
            torch.nn.utils.clip_grads_with_norm_(self._params, max_grad_norm, norm)
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def stateful(self) -> dict[str, Stateful | DirectoryState]:
        return {
            "model": ShardedModel(self._model),
            "optimizer": ShardedOptimizer(self._model, self.optimizer),
            "scheduler": self.schedule,
        }

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        full = get_model_state_dict(self._model, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().cpu().clone() for k, v in full.items()}


def _fill(template: Any, saved: Any, requests: list, name: str) -> Any:
    """`template` (this run's state: DTensors, tensors, values) with every tensor replaced by
    an empty one of its local shape queued in `requests` to be read from `saved`'s
    SavedTensor at the same place; values come from `saved`."""
    if isinstance(template, torch.Tensor):
        if not isinstance(saved, SavedTensor):
            raise ValueError(f"{name}: the checkpoint holds no tensor there")
        if tuple(template.shape) != saved.shape:
            raise ValueError(
                f"{name}: saved with shape {list(saved.shape)}, this run's is "
                f"{list(template.shape)}"
            )
        if isinstance(template, DTensor):
            shape, offsets = compute_local_shape_and_global_offset(
                template.shape, template.device_mesh, template.placements
            )
        else:
            shape, offsets = template.shape, (0,) * template.dim()
        out = torch.empty(tuple(shape), dtype=template.dtype)
        requests.append((saved, tuple(offsets), out, template))
        return len(requests) - 1  # replaced once read
    if isinstance(template, dict):
        if not isinstance(saved, dict):
            raise ValueError(f"{name}: the checkpoint holds {type(saved).__name__} there")
        extra = sorted(map(str, set(saved) - set(template)))
        missing = sorted(map(str, set(template) - set(saved)))
        if extra or missing:
            raise ValueError(
                f"{name}: the checkpoint's keys differ from this run's "
                f"(missing {missing[:5]}, unexpected {extra[:5]})"
            )
        return {k: _fill(v, saved[k], requests, f"{name}.{k}") for k, v in template.items()}
    return saved  # a plain value: the checkpoint's


def read_like(template: dict[str, Any], saved: SavedState, structure: Any, name: str) -> Any:
    """`structure` (saved, SavedTensor leaves) read into this run's layout of `template`:
    each DTensor gets exactly its own shard's region, other tensors the whole."""
    requests: list = []
    skeleton = _fill(template, structure, requests, name)
    saved.read([(s, offsets, out) for s, offsets, out, _ in requests])
    values = []
    for _, _, out, like in requests:
        if isinstance(like, DTensor):
            local = out.to(like.to_local().device)
            values.append(
                DTensor.from_local(
                    local,
                    like.device_mesh,
                    like.placements,
                    run_check=False,
                    shape=like.shape,
                    stride=like.stride(),
                )
            )
        else:
            values.append(out.to(like.device))

    def place(node: Any, tmpl: Any) -> Any:
        if isinstance(tmpl, torch.Tensor):
            return values[node]
        if isinstance(tmpl, dict):
            return {k: place(node[k], v) for k, v in tmpl.items()}
        return node

    return place(skeleton, template)


class ShardedModel:
    """The FSDP model's checkpoint entry: each rank's parameter shards, by name."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_pieces(self, saved: SavedState) -> None:
        template = get_model_state_dict(self.model)
        state = read_like(template, saved, saved.structure, "model")
        set_model_state_dict(self.model, state)


class ShardedOptimizer:
    """The FSDP optimizer's checkpoint entry: its state by parameter name, each rank's shards
    (a DDP checkpoint's positional state is translated by name, see named_state.py)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_pieces(self, saved: SavedState) -> None:
        # The template creates the optimizer's state (a step with zero gradients and lr 0)
        # so that every tensor has its place; all of it is then overwritten.
        template = get_optimizer_state_dict(self.model, self.optimizer)
        structure = to_names(saved.structure, param_names(self.model, self.optimizer))
        state = read_like(
            {"state": template["state"]}, saved, {"state": structure["state"]}, "optimizer"
        )
        state["param_groups"] = structure["param_groups"]
        set_optimizer_state_dict(self.model, self.optimizer, state)


def build(inputs: EngineInputs) -> FSDPEngine:
    """The registry's builder (core/engines/__init__.py)."""
    if inputs.ready_optimizer is not None:
        raise ConfigError(
            "optimizer: a ready-made optimizer holds the unsharded parameters; with "
            "engine.name fsdp pass optimizer_cls_and_kwargs (or set the optim section)"
        )
    config = inputs.config
    fc = config.engine.fsdp
    return FSDPEngine(
        inputs.model,
        inputs.make_optimizer,
        inputs.make_schedule,
        inputs.device,
        wrap=fc["wrap"],
        reshard_after_forward=fc["reshard_after_forward"],
        bf16=config.train.bf16,
        loss_fn=inputs.loss_fn,
    )
