"""Loading DeepSpeed's checkpoint files with `torch.load(weights_only=True)`: no code runs.

DeepSpeed 0.19 reads its files with `torch.load(weights_only=False)`, a full pickle. Here every
such load is restricted to tensors, containers, numbers, strings and the three plain DeepSpeed
types its files hold, found by saving ZeRO 0-3 checkpoints (fp32, bf16, bf16 with fp32 gradient
accumulation, DeepSpeed-named AdamW/Adam with WarmupLR, WarmupDecayLR and OneCycle) and listing
each file's pickle globals with `torch.serialization.get_unsafe_globals_in_checkpoint`:

- `mp_rank_*_model_states.pt` (ZeRO 0-2) and `zero_pp_rank_*_model_states.pt` (ZeRO 3): none
  beyond torch's defaults; the stored ds_config and a DeepSpeed scheduler's state are dicts.
- `[bf16_]zero_pp_rank_*_optim_states.pt`, ZeRO 1-2: LossScaler, ZeroStageEnum,
  fragment_address; ZeRO 3: LossScaler, ZeroStageEnum; the bf16 optimizer (ZeRO 1 with
  data_types.grad_accum_dtype fp32): fragment_address.

One list serves every kind: zero_to_fp32 loads model and optimizer files under one setting, and
the three are plain data (an int enum, looked up by value; two classes rebuilt from their
attributes, no method called).
This module imports DeepSpeed: import it only where DeepSpeed is in use.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from checkpointing.manifest import CheckpointCorruptError

DEEPSPEED_GLOBALS = (LossScaler, ZeroStageEnum, fragment_address)
"""The only non-torch types a DeepSpeed 0.19 file may unpickle to (plain data: no callables)."""

_TORCH_BOILERPLATE = ("Weights only load failed", "Check the documentation", "Please file an issue")


def _reason(error: pickle.UnpicklingError) -> str:
    """The line of torch's long weights_only message that says what was refused."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    kept = [line for line in lines if not line.startswith(_TORCH_BOILERPLATE)]
    return " ".join(kept) or lines[0]


def _allowing_deepspeed_globals() -> contextlib.AbstractContextManager[Any]:
    """torch's safe_globals for DEEPSPEED_GLOBALS, unless an enclosing one is active: on exit
    safe_globals removes its entries from the process-wide set, so a nested one would take the
    enclosing one's allow-list away (seen: a universal load refused LossScaler)."""
    active = set(torch.serialization.get_safe_globals())
    if all(g in active for g in DEEPSPEED_GLOBALS):
        return contextlib.nullcontext()
    return torch.serialization.safe_globals(list(DEEPSPEED_GLOBALS))


def load_deepspeed_file(path: Path, map_location: Any = None, mmap: bool = False) -> Any:
    """torch.load(weights_only=True) of one DeepSpeed file, allowing DEEPSPEED_GLOBALS; a file
    that pickles anything else is a CheckpointCorruptError naming it."""
    try:
        with _allowing_deepspeed_globals():
            return torch.load(path, map_location=map_location, mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointCorruptError(
            f"{path}: refused, it is not a DeepSpeed file of tensors and plain state "
            f"(loaded with weights_only=True: {_reason(e)})"
        ) from None


def check_deepspeed_files(tag_dir: Path) -> None:
    """Load every file in `tag_dir` as load_deepspeed_file does, without reading tensor data
    (mmap). Every rank sees the same files, so every rank refuses the same file with the same
    line, before DeepSpeed starts loads and collectives a lone failing rank would break."""
    for path in sorted(p for p in tag_dir.iterdir() if p.is_file()):
        load_deepspeed_file(path, map_location="cpu", mmap=zipfile.is_zipfile(path))


class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch.save engine, unchanged for saving; loads go through
    load_deepspeed_file. Set as `engine.checkpoint_engine`: every file DeepSpeed's
    load_checkpoint reads (model states, ZeRO partitions) goes through its `load`."""

    def __init__(self, zipfile_serialization: bool) -> None:
        super().__init__(None)
        self.zipfile_serialization = zipfile_serialization

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_deepspeed_file(Path(path), map_location)


@contextlib.contextmanager
def weights_only_torch_loads(where: Path) -> Iterator[None]:
    """Inside: every torch.load in this process is weights_only=True (with DEEPSPEED_GLOBALS
    allowed), even one that asks for weights_only=False, and a refusal is a
    CheckpointCorruptError naming `where`. For DeepSpeed code that calls torch.load itself and
    takes no loader (zero_to_fp32): torch's own switch, TORCH_FORCE_WEIGHTS_ONLY_LOAD, rather
    than replacing torch.load. Process-wide while inside: for one-shot tools only."""
    names = ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    saved = {name: os.environ.get(name) for name in names}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)  # both set is an error in torch
    try:
        with _allowing_deepspeed_globals():
            yield
    except pickle.UnpicklingError as e:
        raise CheckpointCorruptError(
            f"{where}: refused a file that is not DeepSpeed's tensors and plain state "
            f"(loaded with weights_only=True: {_reason(e)})"
        ) from None
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
