"""The tokenising functions both data paths share: `datasets.map` in core/data/build.py and the
token store's worker processes in core/data/prepare.py. Each turns a batch of texts into a
pyarrow table of ragged `input_ids`."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from core.data.pack import MIN_TOKENS, ragged
from core.data.tokenizers import HFTokenizer


def token_dtype(tokenizer: HFTokenizer) -> str:
    """The narrowest unsigned type holding every id: half the bytes of int32 for most vocabs."""
    return "uint16" if tokenizer.vocab_size <= 2**16 else "uint32"


def encode_bytes(batch: dict[str, list], field: str, seq_len: int, packing: bool) -> pa.Table:
    """datasets.map function: texts -> UTF-8 byte ids (with a newline separator when packing)."""
    records = [(text or "").encode("utf-8") for text in batch[field]]
    records = [r + b"\n" for r in records] if packing else truncate(records, seq_len)
    return pa.table({"input_ids": ragged(records)})  # a Table: map takes no Arrow arrays


def encode_text(
    batch: dict[str, list],
    field: str,
    tokenizer: HFTokenizer,
    seq_len: int,
    packing: bool,
    dtype: str,
) -> pa.Table:
    """datasets.map function: texts -> token ids, the tokenizer's EOS after every document
    (unless its own post-processor put one there). Empty texts are dropped; without packing a
    document is truncated to seq_len and one shorter than 2 tokens is dropped."""
    texts = [t for t in batch[field] if t]
    eos = tokenizer.eos_id
    rows = []
    for ids in tokenizer.encode(texts):
        if not ids or ids[-1] != eos:
            ids.append(eos)
        row = np.asarray(ids if packing else ids[:seq_len], dtype=dtype)
        if len(row) >= MIN_TOKENS:
            rows.append(row)
    return pa.table({"input_ids": ragged(rows, dtype)})


def truncate(records: list[bytes], seq_len: int) -> list[bytes]:
    """Records cut to seq_len; those shorter than MIN_TOKENS dropped."""
    return [r[:seq_len] for r in records if len(r) >= MIN_TOKENS]
