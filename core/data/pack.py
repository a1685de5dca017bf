"""Arrow-level helpers: ragged token columns built from one buffer, and packing into fixed
blocks. No Python int per token anywhere: corpora are millions of tokens."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

MIN_TOKENS = 2  # a causal LM needs an input and a next token
IGNORE = -100  # a label the loss skips


def ragged(rows: list[np.ndarray] | list[bytes], dtype: np.dtype | str = np.uint8) -> pa.ListArray:
    """One list row per record, from one concatenated buffer (bytes records: uint8)."""
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    if rows and isinstance(rows[0], bytes):
        values = np.frombuffer(b"".join(rows), dtype=np.uint8)  # type: ignore[arg-type]
    elif rows:
        values = np.concatenate(rows).astype(dtype, copy=False)  # type: ignore[arg-type]
    else:
        values = np.zeros(0, dtype=dtype)
    if offsets[-1] < 2**31:  # list<> (int32 offsets) unless a batch holds >= 2^31 tokens
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))


def blocks(values: np.ndarray, seq_len: int) -> pa.FixedSizeListArray:
    """Consecutive blocks of exactly seq_len tokens; the remainder is dropped (group_texts)."""
    n = len(values) // seq_len
    return pa.FixedSizeListArray.from_arrays(pa.array(values[: n * seq_len]), seq_len)


def _flat(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    flat = pc.list_flatten(column)
    if isinstance(flat, pa.ChunkedArray):
        flat = flat.combine_chunks()
    return flat.to_numpy(zero_copy_only=False)


def used_rows(table: pa.Table) -> pa.Table:
    """The rows a chat encoding kept (skip == 0), without the skip column."""
    if "skip" not in table.column_names:
        return table
    kept = table.filter(pc.equal(table.column("skip"), 0))
    return kept.drop_columns(["skip"])


def pack_table(table: pa.Table, seq_len: int) -> pa.Table:
    """datasets.map function on Arrow: concatenate every sample and cut seq_len blocks.

    With a labels column (chat), labels are cut alike, and a block with no label after its
    first position is dropped: it would train on nothing (a batch of such blocks has no loss)."""
    table = used_rows(table)
    ids = _flat(table.column("input_ids"))
    out = {"input_ids": blocks(ids, seq_len)}
    if "labels" not in table.column_names:
        return pa.table(out)
    n = len(ids) // seq_len
    labels = _flat(table.column("labels"))[: n * seq_len].reshape(n, seq_len)
    keep = (labels[:, 1:] != IGNORE).any(axis=1)
    ids_blocks = ids[: n * seq_len].reshape(n, seq_len)[keep]
    return pa.table(
        {
            "input_ids": blocks(ids_blocks.reshape(-1), seq_len),
            "labels": blocks(labels[keep].reshape(-1), seq_len),
        }
    )
