"""The sections that say what is trained on what: the model and the data."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from core.config.checks import ConfigError, _check, _one_of
from core.config.roles import NEUTRAL, TRAJECTORY, Added

DATA_FORMATS = ("auto", "text", "json", "parquet", "chat")
MODEL_DTYPES = ("float32", "bfloat16")
HF_PREFIX = "hf:"
"""`model.name` / `data.tokenizer`: a Hugging Face model or tokenizer (directory or hub id)."""


@dataclass
class ModelConfig:
    name: Annotated[str, TRAJECTORY] = "tiny-gpt"
    """'tiny-gpt' (built in), 'hf:<directory or hub id>' (transformers AutoModelForCausalLM) or
    'package.module:factory' returning an nn.Module."""
    pretrained: Annotated[bool | None, Added(None)] = None
    """hf: load the weights (model.safetensors); false builds from config.json alone, randomly
    initialised after seeding. Default: true for hf: models."""
    dtype: Annotated[str, Added("float32")] = "float32"
    """Parameter dtype: float32 or bfloat16 (the weights train in it; train.bf16 is autocast)."""
    attn_implementation: Annotated[str | None, Added(None)] = None
    """hf: the attention kernel, passed to transformers (eager, sdpa, flash_attention_2, ...)."""
    trust_remote_code: Annotated[bool, Added(False)] = False
    """hf: run the Python code a model directory ships (auto_map in config.json)."""
    n_layer: Annotated[int, TRAJECTORY] = 2
    """tiny-gpt: number of transformer blocks."""
    n_head: Annotated[int, TRAJECTORY] = 2
    """tiny-gpt: attention heads per block."""
    n_embd: Annotated[int, TRAJECTORY] = 64
    """tiny-gpt: embedding width (divisible by n_head)."""
    block_size: Annotated[int, TRAJECTORY] = 64
    """tiny-gpt: maximum sequence length (positions)."""
    dropout: Annotated[float, TRAJECTORY] = 0.1
    """tiny-gpt: dropout probability in attention and MLP."""
    bias: Annotated[bool, TRAJECTORY] = True
    """tiny-gpt: use biases in Linear and LayerNorm layers."""
    gradient_checkpointing: Annotated[bool, TRAJECTORY] = False
    """Recompute block activations in backward (tiny-gpt, hf: models, or a model with the same
    hook)."""
    kwargs: Annotated[dict[str, Any], TRAJECTORY] = field(default_factory=dict)
    """Keyword arguments passed to a user factory."""

    @property
    def loads_weights(self) -> bool:
        """model.pretrained, with its default (true for hf: models) applied."""
        return self.pretrained if self.pretrained is not None else self.is_hf

    @property
    def is_hf(self) -> bool:
        return self.name.startswith(HF_PREFIX)

    def __post_init__(self) -> None:
        hf = self.is_hf
        _check(
            self.name == "tiny-gpt" or ":" in self.name,
            "model.name",
            f"unknown model {self.name!r}; accepted: tiny-gpt, 'hf:<directory or hub id>' or "
            "'package.module:factory'",
        )
        _check(not hf or len(self.name) > len(HF_PREFIX), "model.name", "hf: needs a directory")
        for key in ("pretrained", "trust_remote_code", "attn_implementation"):
            value = getattr(self, key)
            _check(
                hf or value in (False, None),
                f"model.{key}",
                f"is for hf: models, not {self.name!r}",
            )
        _one_of(self.dtype, "model.dtype", MODEL_DTYPES)
        for key in ("n_layer", "n_head", "n_embd", "block_size"):
            _check(getattr(self, key) > 0, f"model.{key}", "must be > 0")
        _check(
            self.n_embd % self.n_head == 0,
            "model.n_embd",
            f"must be divisible by model.n_head ({self.n_head}), got {self.n_embd}",
        )
        _check(0.0 <= self.dropout < 1.0, "model.dropout", "must be in [0, 1)")


@dataclass
class DataConfig:
    source: Annotated[str, TRAJECTORY] = "stdlib"
    """'stdlib' (the Python standard library's source, no download), a file path or glob, an
    fsspec URL or glob (s3://bucket/corpus/*.jsonl: for prepare), or a token store."""
    store: Annotated[str | None, NEUTRAL] = None
    """A token store (a path or fsspec URL) that `python -m launcher prepare` writes from
    data.source and training reads: O(1) resume at any position, any number of ranks."""
    storage_options: Annotated[dict[str, Any], NEUTRAL] = field(default_factory=dict)
    """fsspec options for an s3:// (or other URL) data.source or data.store (endpoint_url,
    key, secret, ...)."""
    shard_bytes: Annotated[int, NEUTRAL] = 256 << 20
    """prepare: bytes per store shard (whole blocks); sample i is block i for any value."""
    store_cache_bytes: Annotated[int, NEUTRAL] = 256 << 20
    """Reading a store from an object store: verified chunks kept per process (LRU)."""
    format: Annotated[str, TRAJECTORY] = "auto"
    """File format: auto (from the extension), text, json (json/jsonl), parquet, or chat
    (json/jsonl/parquet rows with a `messages` list of {role, content})."""
    text_field: Annotated[str, TRAJECTORY] = "text"
    """Column holding the text in json/parquet files."""
    tokenizer: Annotated[str, Added("bytes")] = "bytes"
    """bytes (UTF-8 bytes, 256 ids) or 'hf:<directory or hub id>' (a fast tokenizer)."""
    num_proc: Annotated[int, NEUTRAL] = 1
    """Processes that tokenise (datasets.map num_proc); the result is the same for any value."""
    train_on: Annotated[str, Added("assistant")] = "assistant"
    """format chat: assistant (only assistant tokens are labels) or all."""
    chat_template: Annotated[str | None, Added(None)] = None
    """format chat: a Jinja chat template, or a file holding one, in place of the tokenizer's
    own (read at start, so config.yaml records it)."""
    seq_len: Annotated[int, TRAJECTORY] = 64
    """Tokens per sample."""
    packing: Annotated[bool, TRAJECTORY] = True
    """Concatenate all text and cut fixed seq_len blocks; false keeps one sample per record."""
    max_bytes: Annotated[int, TRAJECTORY] = 2_000_000
    """stdlib source: bytes of the corpus to use (0 = all)."""
    num_workers: Annotated[int, NEUTRAL] = 0
    """DataLoader worker processes."""
    drop_last: Annotated[bool, TRAJECTORY] = True
    """Drop the last incomplete batch of an epoch."""
    group_by_length: Annotated[bool, TRAJECTORY] = False
    """Batch samples of similar length together (useful with packing: false)."""
    remove_unused_columns: Annotated[bool, TRAJECTORY] = True
    """Drop dataset columns the model's forward does not accept (logged once)."""
    label_names: Annotated[list[str] | None, TRAJECTORY] = None
    """Batch keys that hold labels (default: labels, when the model accepts it)."""

    def __post_init__(self) -> None:
        _one_of(self.format, "data.format", DATA_FORMATS)
        _check(self.seq_len > 1, "data.seq_len", f"must be > 1, got {self.seq_len}")
        _check(self.max_bytes >= 0, "data.max_bytes", "must be >= 0")
        _check(self.num_workers >= 0, "data.num_workers", f"must be >= 0, got {self.num_workers}")
        _check(self.num_proc >= 1, "data.num_proc", f"must be >= 1, got {self.num_proc}")
        _check(self.shard_bytes > 0, "data.shard_bytes", f"must be > 0, got {self.shard_bytes}")
        _check(self.store_cache_bytes >= 0, "data.store_cache_bytes", "must be >= 0")
        _check(
            isinstance(self.storage_options, dict),
            "data.storage_options",
            "must be a mapping of fsspec options",
        )
        _check(
            self.tokenizer == "bytes"
            or (self.tokenizer.startswith(HF_PREFIX) and len(self.tokenizer) > len(HF_PREFIX)),
            "data.tokenizer",
            f"unknown tokenizer {self.tokenizer!r}; accepted: bytes or 'hf:<directory or hub id>'",
        )
        _one_of(self.train_on, "data.train_on", ("assistant", "all"))
        if self.format == "chat":
            _check(
                self.tokenizer != "bytes",
                "data.format",
                "chat needs a tokenizer with a chat template: set data.tokenizer hf:<dir or id>",
            )
            _check(self.source != "stdlib", "data.source", "format chat needs chat files")
        if self.chat_template is not None:
            _check(
                self.format == "chat",
                "data.chat_template",
                f"is for data.format chat, not {self.format}",
            )
            self.chat_template = _read_template(self.chat_template)
        if self.store is not None or self.uses_store:
            for ok, key, why in (
                (self.format != "chat", "data.format", "chat rows cannot train from a store"),
                (self.packing, "data.packing", "a token store holds packed blocks"),
                (
                    not self.group_by_length,
                    "data.group_by_length",
                    "store blocks are all seq_len long: there is nothing to group",
                ),
            ):
                _check(ok, key, why)
        if (
            self.source != "stdlib"
            and "://" not in self.source
            and not any(ch in self.source for ch in "*?[")
        ):
            _check(Path(self.source).exists(), "data.source", f"no such file {self.source!r}")

    @property
    def uses_store(self) -> bool:
        """data.source itself names a token store (a directory holding index.json)."""
        return Path(self.source, "index.json").is_file()

    @property
    def store_url(self) -> str | None:
        """The token store training reads: data.store, or a data.source that is one."""
        return self.store or (self.source if self.uses_store else None)


def _read_template(value: str) -> str:
    """A Jinja template given inline, or the text of the file it names."""
    if "{{" in value or "{%" in value:
        return value
    p = Path(value)
    _check(
        p.is_file(),
        "data.chat_template",
        f"no such file {value!r} (give a file, or a Jinja template holding {{% or {{{{)",
    )
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"data.chat_template: cannot read {value!r} as UTF-8 text ({e})") from e
