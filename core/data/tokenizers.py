"""Tokenizers: UTF-8 bytes (`data.tokenizer: bytes`, 256 ids) or a Hugging Face fast tokenizer
(`hf:<directory or hub id>`, loaded with AutoTokenizer).

The byte "tokenizer" is the encoding itself and has no object here (`None` stands for it). A
Hugging Face tokenizer is wrapped with what the data pipeline and the checkpoint need of it: its
id range, EOS, a content fingerprint (a resume with another tokenizer is refused) and its files
(carried in every checkpoint, so an export holds the tokenizer the model was trained with).
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from core.config import DataConfig, first_line
from core.data.errors import DataError
from core.hub import hf_location

logger = logging.getLogger(__name__)

BYTES_VOCAB = 256


class HFTokenizer:
    """A fast (Rust) tokenizer of `transformers`, with the facts the pipeline asks of it."""

    def __init__(self, spec: str, tokenizer: Any) -> None:
        self.spec = spec
        self.hf = tokenizer
        self._backends()
        special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
        identity = {
            "tokenizer.json": tokenizer.backend_tokenizer.to_str(),
            "special_tokens": special,
            "chat_template": tokenizer.chat_template,
        }
        self.fingerprint = hashlib.sha256(
            json.dumps(identity, sort_keys=True).encode()
        ).hexdigest()[:16]
        """Changes when the ids any text maps to, or the chat rendering, could change."""

    def __getstate__(self) -> dict[str, Any]:
        # datasets.map ships this object to its worker processes: the backend is rebuilt there
        # from the transformers tokenizer (which pickles through its own JSON form).
        return {"spec": self.spec, "hf": self.hf, "fingerprint": self.fingerprint}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._backends()

    def _backends(self) -> None:
        """Private copies of the Rust tokenizer: `backend` without the truncation or padding a
        tokenizer.json may switch on (every document whole, no pad ids, the same ids however
        rows are batched); `chat_backend` also without its post-processor, whose offsets a
        ByteLevel `trim_offsets` would shift off a token's leading space (chat labels compare
        offsets with turn boundaries; with add_special_tokens=False it adds no id)."""
        from tokenizers import Tokenizer

        text = self.hf.backend_tokenizer.to_str()
        self.backend = Tokenizer.from_str(text)
        self.backend.no_truncation()
        self.backend.no_padding()
        self.chat_backend = Tokenizer.from_str(text)
        self.chat_backend.no_truncation()
        self.chat_backend.no_padding()
        self.chat_backend.post_processor = None

    @property
    def vocab_size(self) -> int:
        """Ids run from 0 to vocab_size - 1 (added tokens included)."""
        return len(self.hf)

    @property
    def eos_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def chat_template(self) -> str | None:
        return self.hf.chat_template

    def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text (the tokenizer's own special tokens, such as a BOS, added)."""
        fast = getattr(self.backend, "encode_batch_fast", None)  # tokenizers >= 0.20: no offsets
        encode = fast or self.backend.encode_batch
        return [e.ids for e in encode(texts, add_special_tokens=add_special_tokens)]

    def files(self) -> dict[str, bytes]:
        """The files `save_pretrained` writes (tokenizer.json, tokenizer_config.json, ...)."""
        with tempfile.TemporaryDirectory(prefix="tokenizer-") as tmp:
            self.hf.save_pretrained(tmp)
            return {
                p.relative_to(tmp).as_posix(): p.read_bytes()
                for p in sorted(Path(tmp).rglob("*"))
                if p.is_file()
            }


def load_tokenizer(cfg: DataConfig) -> HFTokenizer | None:
    """The configured tokenizer: None for bytes. A missing directory, an unreachable hub id or
    a slow (Python-only) tokenizer is a DataError naming data.tokenizer."""
    if cfg.tokenizer == "bytes":
        return None
    where = hf_location(cfg.tokenizer, "data.tokenizer", DataError)
    if where.local is not None and not any(
        (where.local / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        raise DataError(
            f"data.tokenizer: {where} holds no tokenizer.json or tokenizer_config.json "
            "(write one with tokenizer.save_pretrained)"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(where.where, trust_remote_code=False)
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise DataError(f"data.tokenizer: cannot load {where}: {first_line(e)}") from e
    if not getattr(tokenizer, "is_fast", False) or not hasattr(tokenizer, "backend_tokenizer"):
        raise DataError(
            f"data.tokenizer: {where} loads as a slow (Python) tokenizer "
            f"({type(tokenizer).__name__}); only fast tokenizers (tokenizer.json) are supported"
        )
    return HFTokenizer(cfg.tokenizer, tokenizer)
