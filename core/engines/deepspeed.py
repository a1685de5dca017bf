"""The DeepSpeed engine: ZeRO stages 0-3 behind the same Engine interface as DDP.

Our config decides batch size, accumulation, clipping and precision and writes them into the
DeepSpeed config (a conflicting value there is a ConfigError). Our optimizer is passed to
`deepspeed.initialize` unless the DeepSpeed config names one; our schedule (any of the eight) is
stepped by us after DeepSpeed's step, unless the DeepSpeed config names a scheduler, which
DeepSpeed then steps and checkpoints itself.

Checkpoints: DeepSpeed's `save_checkpoint` writes model and optimizer shards into the
`deepspeed/` directory of our temporary checkpoint (with `save_latest=False`: its `latest` file is
never written nor read); our manager hashes every file it wrote into the manifest and commits.
On resume the manager verifies every file's hash first; then DeepSpeed reads its files through
our checkpoint engine, with `torch.load(weights_only=True)` (checkpointing/deepspeed_safe_load.py):
a file that would run code when unpickled is refused, never executed.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from checkpointing.manifest import CheckpointError
from checkpointing.stateful import DirectoryState, Stateful
from core.agreement import any_rank
from core.config import ConfigError
from core.engines.base import Engine
from core.engines.ddp import move_to_device
from core.models import call_model
from core.schedules import Schedule

logger = logging.getLogger(__name__)

TAG = "shards"
"""The tag (sub-directory) DeepSpeed saves under, inside the checkpoint's `deepspeed/`."""


def _skip_shm_op_build() -> None:
    """Stop DeepSpeed JIT-compiling its shared-memory comm op at init on CPU (about 75 s with
    gcc on first use per machine or container): the op serves only `inference_all_reduce`
    (tensor-parallel inference), never training collectives, which go through torch.distributed.
    DeepSpeed has no switch for this, so the builder hook is replaced before the first init."""
    # import_module: `import deepspeed.comm.torch as m` would bind deepspeed.comm's attribute
    # `torch`, which is the torch package itself.
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    ds_torch.build_shm_op = lambda: None


def _load_weights_only(engine: Any) -> None:
    """Make every file DeepSpeed's load_checkpoint reads load with weights_only=True: its
    pluggable checkpoint engine is the one place those loads go through (as we call it: with
    optimizer states, not from a universal checkpoint, whose loads call torch.load directly)."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    from checkpointing.deepspeed_safe_load import WeightsOnlyCheckpointEngine

    if type(engine.checkpoint_engine) is not TorchCheckpointEngine:
        raise ConfigError(
            f"engine.deepspeed_config: DeepSpeed's {type(engine.checkpoint_engine).__name__} is "
            "not supported (checkpoint.writer, datastates); its default torch engine is, and "
            "resumes load through it with weights_only=True"
        )
    if engine.load_universal_checkpoint():
        raise ConfigError(
            "engine.deepspeed_config: checkpoint.load_universal is not supported (DeepSpeed "
            "unpickles universal checkpoints with weights_only=False)"
        )
    engine.checkpoint_engine = WeightsOnlyCheckpointEngine(
        engine.checkpoint_serialization_enabled()
    )


class DeepSpeedShards:
    """The checkpoint entry of DeepSpeed's own files (a directory entry: a collective).

    ZeRO 1-2 shards saved on another number of ranks are loaded through a DeepSpeed universal
    checkpoint converted from them (`elastic`); see core.elastic.fit_world_size for what is
    refused."""

    def __init__(self, engine: Any, load_lr_scheduler: bool) -> None:
        self._engine = engine
        self._load_lr_scheduler = load_lr_scheduler

    @property
    def elastic(self) -> bool:
        return self._engine.zero_optimization_stage() in (1, 2)

    def save_to(self, directory: Path) -> None:
        self._engine.save_checkpoint(str(directory), tag=TAG, save_latest=False)

    def load_from(self, directory: Path) -> None:
        from checkpointing.deepspeed_safe_load import check_deepspeed_files

        check_deepspeed_files(directory / TAG)  # every rank refuses a bad file alike, up front
        saved_ranks = len(list((directory / TAG).glob("*zero_pp_rank_*_optim_states.pt")))
        if self.elastic and saved_ranks != dist.get_world_size():
            self._load_resharded(directory, saved_ranks)
            return
        self._load(directory)

    def _load(self, load_dir: Path | str) -> None:
        """DeepSpeed's load_checkpoint of everything under `load_dir`/TAG."""
        path, _ = self._engine.load_checkpoint(
            str(load_dir),
            tag=TAG,
            load_module_strict=True,
            load_optimizer_states=True,
            load_lr_scheduler_states=self._load_lr_scheduler,
        )
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint in {load_dir}/{TAG}")

    def _load_resharded(self, directory: Path, saved_ranks: int) -> None:
        """Shards of `saved_ranks` ranks on this world size: each rank converts them into a
        universal checkpoint of its own (a temporary directory) and loads that. DeepSpeed's
        universal load calls torch.load itself (weights_only=False): forced to weights_only."""
        from checkpointing.deepspeed_files import universal_copy
        from checkpointing.deepspeed_safe_load import weights_only_torch_loads

        optimizer = type(self._engine.basic_optimizer).__name__
        if "adam" not in optimizer.lower():  # what the universal format holds: Adam moments
            raise CheckpointError(
                f"{directory}: ZeRO shards of {saved_ranks} rank(s) cannot be resharded for "
                f"{optimizer}: DeepSpeed's universal checkpoints hold Adam moments only"
            )
        with tempfile.TemporaryDirectory(prefix="deepspeed-universal-") as tmp:
            error: Exception | None = None
            try:
                universal_copy(directory / TAG, Path(tmp) / TAG)
            except Exception as e:  # e.g. a full local disk on one host
                error = e
            # DeepSpeed's universal load is a collective: every rank goes on, or none does.
            if any_rank([error is not None])[0]:
                raise CheckpointError(
                    f"{directory}: converting ZeRO shards of {saved_ranks} rank(s) for "
                    f"{dist.get_world_size()} failed: {error or 'on another rank'}"
                ) from error
            # DeepSpeed asks engine.load_universal_checkpoint() (its config's flag) while
            # loading; set only for this load, so the engine is otherwise the one configured.
            config = self._engine._config
            config.load_universal_checkpoint = True
            try:
                with weights_only_torch_loads(directory / TAG):
                    self._load(tmp)
            finally:
                config.load_universal_checkpoint = False
        logger.info(
            "loaded ZeRO shards of %d rank(s) on %d through a universal checkpoint",
            saved_ranks,
            dist.get_world_size(),
        )


class _DeepSpeedSchedule(Schedule):
    """A scheduler named in the DeepSpeed config: DeepSpeed steps it in `engine.step()` and
    saves it with its shards, so here step() is a no-op and it is no entry of ours."""

    def step(self) -> None:
        pass


class DeepSpeedEngine(Engine):
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        build_schedule: Callable[[torch.optim.Optimizer], Schedule],
        device: torch.device,
        ds_config: dict[str, Any],
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] = call_model,
    ) -> None:
        """`optimizer` is None when `ds_config` names one; `build_schedule(optimizer)` makes
        ours over whichever optimizer DeepSpeed steps (unused when ds_config names one)."""
        try:
            import deepspeed
        except ImportError as e:
            raise ConfigError(
                "engine.name: deepspeed needs DeepSpeed: pip install -e '.[deepspeed]'"
            ) from e
        if not dist.is_initialized():
            raise ConfigError(
                "engine.name: deepspeed runs under torchrun (even for one process: "
                "torchrun --nproc-per-node 1 -m launcher ...)"
            )
        _skip_shm_op_build()
        self.device = device
        self._loss_fn = loss_fn
        params = [p for p in model.parameters() if p.requires_grad]
        engine, _, _, ds_scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=params if optimizer is None else None,
            config=ds_config,
            dist_init_required=False,
        )
        _load_weights_only(engine)
        self._ds = engine
        # The torch optimizer inside DeepSpeed's wrapper: param_groups (and so the lr) shared.
        self.optimizer = optimizer if optimizer is not None else engine.basic_optimizer
        self._own_schedule = ds_scheduler is None
        if self._own_schedule:
            self.schedule = build_schedule(self.optimizer)
        else:
            self.schedule = _DeepSpeedSchedule(ds_scheduler)
        self._zero_stage = engine.zero_optimization_stage()

    @property
    def model(self) -> nn.Module:
        return self._ds.module

    def train(self, mode: bool = True) -> None:
        self._ds.train(mode)

    def accumulate(self, sync: bool) -> AbstractContextManager[Any]:
        # The loop decides where an optimizer step ends (the last step of an epoch may hold
        # fewer micro-batches than gradient_accumulation_steps): tell DeepSpeed explicitly.
        self._ds.set_gradient_accumulation_boundary(sync)
        return contextlib.nullcontext()

    def forward(self, batch: Any) -> torch.Tensor:
        return self._loss_fn(self._ds, move_to_device(batch, self.device))

    def backward(self, loss: torch.Tensor, num_micro_batches: int) -> None:
        # Scaled by the micro-batches this step really has, as the DDP engine does.
        scaled = loss / num_micro_batches if num_micro_batches > 1 else loss
        self._ds.backward(scaled, scale_wrt_gas=False)

    def optimizer_step(self, max_grad_norm: float) -> torch.Tensor | None:
        # DeepSpeed clips (its gradient_clipping is this max_grad_norm), steps and zeroes.
        self._ds.step()
        if self._own_schedule:
            self.schedule.step()
        if max_grad_norm <= 0:
            return None
        norm = self._ds.get_global_grad_norm()
        return None if norm is None else torch.as_tensor(float(norm))

    def stateful(self) -> dict[str, Stateful | DirectoryState]:
        entries: dict[str, Stateful | DirectoryState] = {
            "deepspeed": DeepSpeedShards(self._ds, load_lr_scheduler=not self._own_schedule)
        }
        if self._own_schedule:
            entries["scheduler"] = self.schedule
        return entries

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer, unsharded, fp32 master values where DeepSpeed keeps
        them (a collective; each rank gets the whole dict)."""
        from deepspeed.utils import safe_get_full_fp32_param

        params = dict(self.model.named_parameters(remove_duplicate=False))
        buffers = dict(self.model.named_buffers(remove_duplicate=False))
        out: dict[str, torch.Tensor] = {}
        for name in self.model.state_dict(keep_vars=True):  # its names, tied ones included
            if name in params:
                full = safe_get_full_fp32_param(params[name]) if self._zero_stage > 0 else None
                value = full if full is not None else params[name].detach().float()
            else:
                value = buffers[name].detach()
            out[name] = value.cpu().clone()
        return out
