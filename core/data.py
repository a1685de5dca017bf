"""Training data as a Hugging Face `datasets.Dataset` of byte-level token ids, and its collate.

The "tokenizer" is the UTF-8 encoding: a sample is a list of ints in 0..255 under `input_ids`.
Sources are the Python standard library's own source (`data.source: stdlib`, no download) or
text / json(l) / parquet files. Sample order depends only on the input, so a sampler position
means the same batch after a restart; `dataset_fingerprint` lets a resume check that.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import sysconfig
import time
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from core.config import DataConfig

logger = logging.getLogger(__name__)

MIN_TOKENS = 2  # a causal LM needs an input and a next token
FORMAT_BY_SUFFIX = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
}
# Directory names pruned from the stdlib walk: third-party code and test suites (idlelib/idle_test).
_STDLIB_SKIP = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})


class DataError(ValueError):
    """Data a user pointed at cannot be used; the message is one line naming the data.* key."""


def build_dataset(cfg: DataConfig) -> datasets.Dataset:
    """Build the training samples described by `cfg`.

    Returns a Dataset with one column `input_ids`: every sample has between 2 and `cfg.seq_len`
    tokens (exactly `cfg.seq_len` when packed), in an order that depends only on the input.
    Raises DataError for a bad source, format or column, or when no sample results.
    """
    start = time.perf_counter()
    if cfg.source == "stdlib":
        records = _stdlib_records(cfg.max_bytes)
        if cfg.packing:
            column = _blocks(np.frombuffer(b"".join(records), np.uint8), cfg.seq_len)
        else:
            column = _ragged(_truncate(records, cfg.seq_len))
        length = cfg.seq_len if cfg.packing else -1
        ds = datasets.Dataset.from_dict({"input_ids": column}, features=_byte_features(length))
        what = f"stdlib corpus, {sum(map(len, records))} bytes"
    else:
        ds, what = _load_files(cfg)
    if len(ds) == 0:
        raise DataError(
            f"data.source: {cfg.source!r} yields no sample of >= {MIN_TOKENS} tokens "
            f"(data.seq_len={cfg.seq_len}, data.packing={cfg.packing})"
        )
    # A content hash, not datasets' own fingerprint: that one is random for in-memory tables and
    # depends on file paths and mtimes, while a resume must compare what the samples hold.
    ds._fingerprint = _content_hash(ds)
    lengths = pc.list_value_length(ds.data.column("input_ids"))
    shortest, longest = pc.min(lengths).as_py(), pc.max(lengths).as_py()
    shape = f"{longest}" if shortest == longest else f"{shortest}..{longest}"
    logger.info(
        "dataset: %s, %d samples of %s tokens, fingerprint %s, built in %.2f s",
        what,
        len(ds),
        shape,
        ds._fingerprint,
        time.perf_counter() - start,
    )
    return ds


def collate(batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack samples into `input_ids` and `labels` LongTensors of shape [B, T], T the longest.

    Shorter samples are padded on the right with 0 in `input_ids` and -100 (ignored by the loss)
    in `labels`; otherwise labels equal input_ids (the model shifts them itself).
    """
    seqs = [sample["input_ids"] for sample in batch]
    lengths = [len(s) for s in seqs]
    longest = max(lengths)
    if min(lengths) == longest:  # packed data: one conversion, no padding
        input_ids = torch.tensor(seqs, dtype=torch.long)
        return {"input_ids": input_ids, "labels": input_ids.clone()}
    input_ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    labels = torch.full((len(seqs), longest), -100, dtype=torch.long)
    for row, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
        values = torch.as_tensor(seq, dtype=torch.long)
        input_ids[row, :n] = values
        labels[row, :n] = values
    return {"input_ids": input_ids, "labels": labels}


def sample_lengths(ds: datasets.Dataset) -> list[int]:
    """The token count of every sample of `ds`, in dataset order (read from Arrow, not rows)."""
    lengths = pc.list_value_length(ds.data.column("input_ids")).to_numpy()
    if ds._indices is not None:  # after select/shuffle rows are a view through an index map
        lengths = lengths[ds._indices.column(0).to_numpy()]
    return lengths.tolist()


def dataset_fingerprint(ds: datasets.Dataset) -> str:
    """A short string that changes when the samples change and is stable across processes.

    For a dataset from `build_dataset` it is a hash of the sample contents; for any other
    dataset it is datasets' own fingerprint.
    """
    return ds._fingerprint


def _stdlib_records(max_bytes: int) -> list[bytes]:
    """The stdlib's *.py files in sorted path order, `max_bytes` bytes in all (0 = all)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP]  # prune whole subtrees
        paths.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    paths.sort(key=lambda p: p.relative_to(root).as_posix())
    records: list[bytes] = []
    total = 0
    for path in paths:
        try:
            data = path.read_bytes()
            data.decode("utf-8")  # the samples are meant to be UTF-8 text
        except (OSError, UnicodeDecodeError) as e:
            logger.debug("stdlib corpus: skipping %s (%s)", path, e.__class__.__name__)
            continue
        if max_bytes:
            data = data[: max_bytes - total]
        records.append(data)
        total += len(data)
        if max_bytes and total >= max_bytes:
            break
    return records


def _load_files(cfg: DataConfig) -> tuple[datasets.Dataset, str]:
    """Load `cfg.source` with datasets' text/json/parquet builder and turn records into samples."""
    fmt = _resolve_format(cfg)
    files = _data_files(cfg.source)
    try:
        raw = datasets.load_dataset(fmt, data_files=files, split="train")
    except (datasets.exceptions.DatasetsError, pa.ArrowException) as e:
        cause = e.__cause__ or e  # DatasetGenerationError wraps the parser's error
        reason = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        raise DataError(
            f"data.source: cannot read {cfg.source!r} as {fmt} "
            f"({cause.__class__.__name__}: {reason})"
        ) from e
    what = f"{len(files)} {fmt} file(s) {cfg.source!r}, {len(raw)} records"
    if "input_ids" in raw.column_names:
        feature = raw.features["input_ids"]
        inner = getattr(feature, "feature", None)
        if not (isinstance(inner, datasets.Value) and pa.types.is_integer(inner.pa_type)):
            raise DataError(f"data.source: column 'input_ids' must hold int lists, got {feature}")
        # Pre-tokenised records are kept one per sample (truncated); packing applies to text only.
        ds = raw.map(
            _truncate_ids,
            batched=True,
            remove_columns=raw.column_names,
            fn_kwargs={"seq_len": cfg.seq_len},
            features=datasets.Features({"input_ids": datasets.List(inner)}),
        )
        return ds, what + " (input_ids used as-is, one sample per record)"
    field = "text" if fmt == "text" else cfg.text_field
    if field not in raw.column_names:
        raise DataError(
            f"data.text_field: no column {field!r} in {cfg.source!r}; "
            f"columns found: {', '.join(raw.column_names)}"
        )
    if raw.features[field] not in (datasets.Value("string"), datasets.Value("large_string")):
        raise DataError(f"data.text_field: column {field!r} holds {raw.features[field]}, not text")
    kwargs = {"field": field, "seq_len": cfg.seq_len, "packing": cfg.packing}
    ds = raw.map(
        _encode_text,
        batched=True,
        remove_columns=raw.column_names,
        fn_kwargs=kwargs,
        features=_byte_features(),
    )
    if cfg.packing:
        # One batch holding the whole column (zero-copy Arrow), so blocks run across records and
        # map batches alike: only the final remainder (< seq_len tokens) is dropped.
        ds = (
            ds.with_format("arrow")
            .map(
                _pack_table,
                batched=True,
                batch_size=None,
                fn_kwargs={"seq_len": cfg.seq_len},
                features=_byte_features(cfg.seq_len),
            )
            .with_format(None)
        )
    return ds, what


def _resolve_format(cfg: DataConfig) -> str:
    if cfg.format != "auto":
        return cfg.format
    suffix = Path(cfg.source).suffix.lower()
    if suffix not in FORMAT_BY_SUFFIX:
        raise DataError(
            f"data.format: cannot infer the format of data.source {cfg.source!r} from extension "
            f"{suffix or '(none)'!r}; accepted extensions: {', '.join(FORMAT_BY_SUFFIX)}, "
            "or set data.format to text, json or parquet"
        )
    return FORMAT_BY_SUFFIX[suffix]


def _data_files(source: str) -> list[str]:
    """The files `source` names, sorted so that the record order is deterministic."""
    if any(ch in source for ch in "*?["):
        files = sorted(f for f in glob.glob(source, recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"data.source: no files match {source!r}")
        return files
    if not os.path.isfile(source):
        raise DataError(f"data.source: {source!r} is not a file; give a file or a glob (d/*.jsonl)")
    return [source]


def _encode_text(batch: dict[str, list], field: str, seq_len: int, packing: bool) -> pa.Table:
    """datasets.map function: texts -> UTF-8 byte ids (with a newline separator when packing)."""
    records = [(text or "").encode("utf-8") for text in batch[field]]
    records = [r + b"\n" for r in records] if packing else _truncate(records, seq_len)
    return pa.table({"input_ids": _ragged(records)})  # a Table: map takes no Arrow arrays


def _truncate_ids(batch: dict[str, list], seq_len: int) -> dict:
    """datasets.map function: pre-tokenised ids, truncated, too-short records dropped."""
    ids = [x[:seq_len] for x in batch["input_ids"] if x is not None and len(x) >= MIN_TOKENS]
    return {"input_ids": ids}


def _pack_table(table: pa.Table, seq_len: int) -> pa.Table:
    """datasets.map function on Arrow: concatenate every sample and cut seq_len blocks."""
    flat = pc.list_flatten(table.column("input_ids"))
    if isinstance(flat, pa.ChunkedArray):
        flat = flat.combine_chunks()
    return pa.table({"input_ids": _blocks(flat.to_numpy(zero_copy_only=False), seq_len)})


def _truncate(records: list[bytes], seq_len: int) -> list[bytes]:
    return [r[:seq_len] for r in records if len(r) >= MIN_TOKENS]


def _blocks(values: np.ndarray, seq_len: int) -> pa.FixedSizeListArray:
    """Consecutive blocks of exactly seq_len tokens; the remainder is dropped (group_texts)."""
    n = len(values) // seq_len
    return pa.FixedSizeListArray.from_arrays(pa.array(values[: n * seq_len]), seq_len)


def _ragged(records: list[bytes]) -> pa.ListArray:
    """One list<uint8> row per record, built from one buffer instead of per-byte Python ints."""
    offsets = np.zeros(len(records) + 1, dtype=np.int32)
    np.cumsum([len(r) for r in records], out=offsets[1:])
    values = np.frombuffer(b"".join(records), dtype=np.uint8)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def _byte_features(length: int = -1) -> datasets.Features:
    """uint8 tokens (1 byte each on disk); length > 0 is a fixed-size list (packed blocks)."""
    return datasets.Features({"input_ids": datasets.List(datasets.Value("uint8"), length=length)})


def _content_hash(ds: datasets.Dataset) -> str:
    """sha256 over the sample lengths and token values, independent of Arrow chunking."""
    column = ds.data.column("input_ids")
    lengths, values = hashlib.sha256(), hashlib.sha256()
    for chunk in column.chunks:
        lengths.update(pc.list_value_length(chunk).to_numpy().astype("<i8").tobytes())
        values.update(np.ascontiguousarray(chunk.flatten().to_numpy(zero_copy_only=False)).data)
    digest = hashlib.sha256(str(column.type).encode() + lengths.digest() + values.digest())
    return digest.hexdigest()[:16]
