"""Hugging Face model directories: what a checkpoint carries to make one, and the export that
`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load.

A run of a transformers model checkpoints one more global entry, `hf` (an `HFFiles`): the files
of the model directory other than the weights (config.json, generation_config.json, the
tokenizer's files), so an export needs nothing but the checkpoint. The export builds the model
from that config.json without allocating it (meta device), assigns the checkpoint's weights,
and writes it with transformers' own `save_pretrained` (sharding, tied weights, naming as
transformers expects); the tokenizer files are copied as they were saved.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from checkpointing.manifest import CheckpointError

logger = logging.getLogger(__name__)

HF_ENTRY = "hf"
DEFAULT_MAX_SHARD_SIZE = "5GB"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class HFFiles:
    """Stateful: the non-weight files of a Hugging Face model directory, by file name. Text
    files are saved as JSON strings, others (a sentencepiece model) as uint8 tensors; nothing is
    pickled. A resume restores the files the run started with."""

    def __init__(self, files: Mapping[str, bytes]) -> None:
        self.files = dict(files)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, data in sorted(self.files.items()):
            try:
                out[name] = data.decode("utf-8")
            except UnicodeDecodeError:
                out[name] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return {"files": out}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        files = state.get("files")
        if not isinstance(files, dict):
            raise CheckpointError("the hf entry holds no files mapping")
        for name in files:
            _check_name(name)
        self.files = {
            name: v.encode("utf-8") if isinstance(v, str) else v.numpy().tobytes()
            for name, v in files.items()
        }


def _check_name(name: str) -> None:
    """A file name inside the model directory: relative, no `..` (the names come from a
    checkpoint, which an export must not let write elsewhere)."""
    parts = Path(name).parts
    if not name or Path(name).is_absolute() or ".." in parts or "\\" in name:
        raise CheckpointError(f"the hf entry names a file outside the model directory: {name!r}")


def _write(root: Path, name: str, data: bytes) -> None:
    _check_name(name)
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)  # additional_chat_templates/<name>.jinja
    path.write_bytes(data)


def _dtype(config: Any) -> torch.dtype:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else torch.float32


def write_hf_model(
    out: str | Path,
    tensors: Mapping[str, torch.Tensor],
    files: Mapping[str, bytes],
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write a directory transformers loads: the model of `files['config.json']` holding
    `tensors` (cast to the config's dtype), saved by save_pretrained, and the tokenizer files
    where `files` has them. Raises CheckpointError when the tensors do not fit the config."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    if "config.json" not in files:
        raise CheckpointError("no config.json among the model's files")
    hf_logging.disable_progress_bar()
    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="hf-export-") as tmp:
        for name, data in files.items():
            _write(Path(tmp), name, data)
        try:
            config = AutoConfig.from_pretrained(tmp, trust_remote_code=False)
        except ValueError as e:  # auto_map: the model's own code would have to run
            raise CheckpointError(
                f"a model with custom code (auto_map) cannot be exported with --hf: {e}"
            ) from e
        dtype = _dtype(config)
        with torch.device("meta"):  # no memory and no random init for weights we replace
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        expected = model.state_dict()
        state = {}
        for name, t in tensors.items():
            target = expected.get(name)
            if target is not None and t.is_floating_point() and t.dtype != target.dtype:
                t = t.to(target.dtype)
            state[name] = t
        try:
            model.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as e:
            raise CheckpointError(f"the weights do not fit config.json: {e}") from e
        model.tie_weights()  # assign replaced the parameters, and with them the tie
        if "generation_config.json" in files:
            model.generation_config = GenerationConfig.from_pretrained(tmp)
        model.save_pretrained(out, max_shard_size=max_shard_size)
        if any(name in files for name in TOKENIZER_FILES):
            for name, data in files.items():
                if name not in ("config.json", "generation_config.json"):
                    _write(out, name, data)
    return out
