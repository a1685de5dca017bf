"""Hugging Face causal LMs (`model.name: hf:<directory or hub id>`), built by transformers'
AutoModelForCausalLM: the model code is transformers', none of it copied here.

`model.pretrained` loads the weights with `from_pretrained(use_safetensors=True)`: weights are
only ever read from safetensors, never unpickled. Otherwise the model is built from config.json
alone and initialised by transformers after our seeding (so identically on every rank and run).
Everything a user can get wrong is checked before anything is built, with one line naming the
key: a missing directory, no config.json, pickle-only weights, code that needs
`trust_remote_code`, an architecture that is no causal LM.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.config import ConfigError, ModelConfig, first_line
from core.hub import HFLocation, hf_location

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "*.bin", "*.pt", "*.pth")
SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")


@dataclass(frozen=True)
class HFSource:
    """A checked `hf:` model: where it is and its transformers config."""

    location: HFLocation
    config: Any
    """transformers.PretrainedConfig."""

    def _text(self, key: str) -> int | None:
        """A field of the language model's config (the text part of a multimodal one)."""
        text = getattr(self.config, "get_text_config", lambda: self.config)()
        return getattr(text, key, None)

    @property
    def vocab_size(self) -> int | None:
        return self._text("vocab_size")

    @property
    def max_positions(self) -> int | None:
        return self._text("max_position_embeddings")


def _check_local(where: Path, cfg: ModelConfig) -> None:
    config_file = where / "config.json"
    if not config_file.is_file():
        raise ConfigError(
            f"model.name: {where} has no config.json (a model directory is what "
            "save_pretrained writes)"
        )
    try:
        values = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.name: {config_file} is not valid JSON ({first_line(e)})") from e
    from transformers import CONFIG_MAPPING

    model_type = values.get("model_type")
    if values.get("auto_map") and not cfg.trust_remote_code and model_type not in CONFIG_MAPPING:
        raise ConfigError(
            f"model.trust_remote_code: {where} needs the Python code it ships (auto_map "
            f"{sorted(values['auto_map'])} in config.json) to build {model_type!r}; set "
            "model.trust_remote_code true only if you trust that code"
        )
    if not cfg.loads_weights:
        return
    if any((where / name).is_file() for name in SAFETENSORS):
        return
    pickled = sorted({p.name for pattern in PICKLE_WEIGHTS for p in where.glob(pattern)})
    if pickled:
        raise ConfigError(
            f"model.pretrained: {where} holds weights only as pickle ({', '.join(pickled)}), "
            "which can run code when loaded; convert them once where you trust the file: "
            'python -c "from transformers import AutoModelForCausalLM as M; '
            f"M.from_pretrained('{where}').save_pretrained('{where}')\" (writes model.safetensors)"
        )
    raise ConfigError(
        f"model.pretrained: {where} holds no model.safetensors; set model.pretrained false to "
        "start from config.json alone"
    )


def resolve_hf(cfg: ModelConfig) -> HFSource:
    """Check an `hf:` model.name and read its config (cheap: no weights are read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    location = hf_location(cfg.name, "model.name")
    if location.local is not None:
        _check_local(location.local, cfg)
    try:
        config = AutoConfig.from_pretrained(location.where, trust_remote_code=cfg.trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise ConfigError(
                f"model.trust_remote_code: {location} needs the Python code it ships; set "
                "model.trust_remote_code true only if you trust that code"
            ) from e
        raise ConfigError(
            f"model.name: cannot read the config of {location}: {first_line(e)}"
        ) from e
    except (OSError, KeyError) as e:
        where = "directory" if location.local is not None else "Hugging Face Hub model"
        raise ConfigError(
            f"model.name: cannot load {location} as a {where}: {first_line(e)}"
        ) from e
    mapping = AutoModelForCausalLM._model_mapping
    remote = getattr(config, "auto_map", None) or {}
    if type(config) not in mapping and "AutoModelForCausalLM" not in remote:
        raise ConfigError(
            f"model.name: {location} is a {type(config).__name__} ({config.model_type}), "
            "which transformers has no causal language model for"
        )
    return HFSource(location, config)


def build_hf_model(source: HFSource, cfg: ModelConfig) -> nn.Module:
    """The model, on the CPU, in model.dtype, ready to train (no KV cache in forward)."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {
        "dtype": DTYPES[cfg.dtype],
        "trust_remote_code": cfg.trust_remote_code,
    }
    if cfg.attn_implementation is not None:
        kwargs["attn_implementation"] = cfg.attn_implementation
    try:
        if cfg.loads_weights:
            model = AutoModelForCausalLM.from_pretrained(
                source.location.where, config=source.config, use_safetensors=True, **kwargs
            )
        else:
            model = AutoModelForCausalLM.from_config(source.config, **kwargs)
    except (OSError, ValueError, ImportError) as e:
        key = "model.attn_implementation" if "attn" in str(e) else "model.name"
        raise ConfigError(f"{key}: cannot build {source.location}: {first_line(e)}") from e
    # Inference caches are no use in training (forward would allocate one per step).
    model.config.use_cache = False
    return model


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute each block in backward, non-reentrant (works under DDP and with frozen
    inputs); transformers >= 5.20 names it activation checkpointing."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def export_files(model: nn.Module) -> dict[str, bytes]:
    """The files save_pretrained writes beside the weights (config.json and, where the model
    has one, generation_config.json), as the model was built: what an export needs."""
    with tempfile.TemporaryDirectory(prefix="hf-config-") as tmp:
        config = model.config
        use_cache, config.use_cache = config.use_cache, True  # as users expect it to generate
        try:
            config.save_pretrained(tmp)
        finally:
            config.use_cache = use_cache
        generation = getattr(model, "generation_config", None)
        if generation is not None and getattr(model, "can_generate", lambda: False)():
            generation.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}
