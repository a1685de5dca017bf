"""Training samples as a Hugging Face `datasets.Dataset` with an `input_ids` column (and `labels`
for chat data): read (core/data/sources.py), tokenised (core/data/encode.py), packed,
fingerprinted.

Tokenisers: UTF-8 bytes (one id per byte, the default) or a Hugging Face fast tokenizer. With
the latter, tokenisation is a batched `datasets.map` over `data.num_proc` processes whose
result datasets caches under a fingerprint of the input files, the tokenizer and the settings:
the first rank to build a dataset tokenises it (core/data/ranks.py), every later build (other
ranks, a resume) loads the cached Arrow files. Sample order depends only on the input, so a
sampler position means the same batch after a restart; `dataset_fingerprint` lets a resume
check that.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from core.config import DataConfig
from core.data.chat import SKIP_REASONS, check_template, encode_chat, skip_report
from core.data.encode import encode_bytes, encode_text, token_dtype, truncate
from core.data.errors import DataError
from core.data.pack import MIN_TOKENS, blocks, pack_table, ragged, used_rows
from core.data.sources import load_records, stdlib_records, text_column
from core.data.tokenizers import HFTokenizer, load_tokenizer

logger = logging.getLogger(__name__)

"""How long ranks wait for another to build the datasets (tokenising a corpus)."""
PIPELINE_VERSION = 1
"""Part of every cache fingerprint: bump when a tokenisation step changes what it produces."""


def build_dataset(
    cfg: DataConfig, tokenizer: HFTokenizer | None = None, quiet: bool = False
) -> datasets.Dataset:
    """Build the training samples described by `cfg` (`tokenizer`: the loaded data.tokenizer;
    loaded here when None and the config names one).

    Returns a Dataset with an `input_ids` column, plus `labels` for chat data: every sample has
    between 2 and `cfg.seq_len` tokens (exactly `cfg.seq_len` when packed), in an order that
    depends only on the input. Raises DataError for a bad source, format or column, or when no
    sample results. `quiet`: report skipped rows at debug level (ranks after the first).
    """
    start = time.perf_counter()
    if tokenizer is None and cfg.tokenizer != "bytes":
        tokenizer = load_tokenizer(cfg)
    if cfg.format == "chat":
        assert tokenizer is not None  # the config refuses chat with byte tokens
        ds, what = _chat(cfg, tokenizer, quiet)
    elif cfg.source == "stdlib" and tokenizer is None:
        records = stdlib_records(cfg.max_bytes)
        if cfg.packing:
            column = blocks(np.frombuffer(b"".join(records), np.uint8), cfg.seq_len)
        else:
            column = ragged(truncate(records, cfg.seq_len))
        length = cfg.seq_len if cfg.packing else -1
        ds = datasets.Dataset.from_dict({"input_ids": column}, features=_features("uint8", length))
        what = f"stdlib corpus, {sum(map(len, records))} bytes"
    else:
        ds, what = _text(cfg, tokenizer)
    if len(ds) == 0:
        raise DataError(
            f"data.source: {cfg.source!r} yields no sample of >= {MIN_TOKENS} tokens "
            f"(data.seq_len={cfg.seq_len}, data.packing={cfg.packing})"
        )
    # A content hash, not datasets' own fingerprint: that one is random for in-memory tables and
    # depends on file paths and mtimes, while a resume must compare what the samples hold.
    ds._fingerprint = _content_hash(ds, tokenizer)
    lengths = pc.list_value_length(ds.data.column("input_ids"))
    shortest, longest = pc.min(lengths).as_py(), pc.max(lengths).as_py()
    shape = f"{longest}" if shortest == longest else f"{shortest}..{longest}"
    logger.info(
        "dataset: %s, %d samples of %s tokens, tokenizer %s, fingerprint %s, built in %.2f s",
        what,
        len(ds),
        shape,
        cfg.tokenizer,
        ds._fingerprint,
        time.perf_counter() - start,
    )
    return ds


def _text(cfg: DataConfig, tokenizer: HFTokenizer | None) -> tuple[datasets.Dataset, str]:
    """Text records (files, or the stdlib corpus for a Hugging Face tokenizer) to samples."""
    if cfg.source == "stdlib":
        texts = [r.decode("utf-8") for r in stdlib_records(cfg.max_bytes)]
        raw, fmt = datasets.Dataset.from_dict({"text": texts}), "text"
        what = f"stdlib corpus, {sum(map(len, texts))} characters"
    else:
        raw, fmt, what = load_records(cfg)
    if "input_ids" in raw.column_names:
        return _pretokenised(cfg, raw), what + " (input_ids used as-is, one per record)"
    field = text_column(raw, cfg, fmt)
    if tokenizer is None:
        kwargs: dict[str, Any] = {"field": field, "seq_len": cfg.seq_len, "packing": cfg.packing}
        ds = raw.map(
            encode_bytes,
            batched=True,
            remove_columns=raw.column_names,
            fn_kwargs=kwargs,
            features=_features("uint8"),
        )
    else:
        dtype = token_dtype(tokenizer)
        if tokenizer.eos_id is None:
            raise DataError(
                f"data.tokenizer: {tokenizer.spec} has no eos_token to end each document with; "
                "set one in its tokenizer_config.json"
            )
        kwargs = {
            "field": field,
            "tokenizer": tokenizer,
            "seq_len": cfg.seq_len,
            "packing": cfg.packing,
            "dtype": dtype,
        }
        ds = raw.map(
            encode_text,
            batched=True,
            num_proc=_procs(cfg, raw),
            remove_columns=raw.column_names,
            fn_kwargs=kwargs,
            features=_features(dtype),
            new_fingerprint=_step(
                "text", raw, tokenizer.fingerprint, field, cfg.seq_len, cfg.packing
            ),
            desc=f"tokenising {cfg.source}",
        )
        what += f", {tokenizer.vocab_size} token vocabulary"
    return (_pack(ds, cfg.seq_len) if cfg.packing else ds), what


def _chat(cfg: DataConfig, tokenizer: HFTokenizer, quiet: bool) -> tuple[datasets.Dataset, str]:
    raw, _, what = load_records(cfg)
    if "messages" not in raw.column_names:
        raise DataError(
            f"data.source: no column 'messages' in {cfg.source!r} (data.format chat reads rows "
            f"holding a messages list); columns found: {', '.join(raw.column_names)}"
        )
    template = cfg.chat_template or tokenizer.chat_template
    if template is None:
        raise DataError(
            f"data.chat_template: the tokenizer {tokenizer.spec} has no chat template; give "
            "one (a Jinja template, or a file holding one) as data.chat_template"
        )
    check_template(tokenizer, cfg.chat_template)
    dtype = token_dtype(tokenizer)
    kwargs = {
        "tokenizer": tokenizer,
        "template": cfg.chat_template,
        "train_on": cfg.train_on,
        "seq_len": cfg.seq_len,
        "packing": cfg.packing,
        "dtype": dtype,
    }
    ds = raw.map(
        encode_chat,
        batched=True,
        num_proc=_procs(cfg, raw),
        remove_columns=raw.column_names,
        fn_kwargs=kwargs,
        features=datasets.Features(
            {
                "input_ids": datasets.List(datasets.Value(dtype)),
                "labels": datasets.List(datasets.Value("int32")),
                "skip": datasets.Value("uint8"),
            }
        ),
        new_fingerprint=_step(
            "chat", raw, tokenizer.fingerprint, template, cfg.train_on, cfg.seq_len, cfg.packing
        ),
        desc=f"rendering and tokenising {cfg.source}",
    )
    counts = np.bincount(ds.data.column("skip").to_numpy(), minlength=len(SKIP_REASONS))
    report = skip_report(counts, len(raw))
    if counts[0] == 0:
        raise DataError(f"data.source: no usable chat row in {cfg.source!r}: {report}")
    if report:
        logger.log(logging.DEBUG if quiet else logging.WARNING, "data: %s", report)
    what += f", {int(counts[0])} conversations, train_on {cfg.train_on}"
    if cfg.packing:
        return _pack(ds, cfg.seq_len), what
    kept = (
        ds.with_format("arrow")
        .map(
            used_rows, batched=True, new_fingerprint=_step("used", ds), desc="dropping skipped rows"
        )
        .with_format(None)
    )
    return kept, what


def _pack(ds: datasets.Dataset, seq_len: int) -> datasets.Dataset:
    """One batch holding the whole column (zero-copy Arrow), so blocks run across records and
    map batches alike: only the final remainder (< seq_len tokens) is dropped."""
    dtype = ds.features["input_ids"].feature.dtype
    features = {"input_ids": datasets.List(datasets.Value(dtype), length=seq_len)}
    if "labels" in ds.column_names:
        features["labels"] = datasets.List(datasets.Value("int32"), length=seq_len)
    return (
        ds.with_format("arrow")
        .map(
            pack_table,
            batched=True,
            batch_size=None,
            fn_kwargs={"seq_len": seq_len},
            features=datasets.Features(features),
            new_fingerprint=_step("pack", ds, seq_len),
            desc=f"packing {seq_len}-token blocks",
            remove_columns=[c for c in ds.column_names if c not in features],
        )
        .with_format(None)
    )


def _pretokenised(cfg: DataConfig, raw: datasets.Dataset) -> datasets.Dataset:
    """Records that hold input_ids already: kept one per sample (truncated); packing applies to
    text only."""
    feature = raw.features["input_ids"]
    inner = getattr(feature, "feature", None)
    if not (isinstance(inner, datasets.Value) and pa.types.is_integer(inner.pa_type)):
        raise DataError(f"data.source: column 'input_ids' must hold int lists, got {feature}")
    return raw.map(
        _truncate_ids,
        batched=True,
        remove_columns=raw.column_names,
        fn_kwargs={"seq_len": cfg.seq_len},
        features=datasets.Features({"input_ids": datasets.List(inner)}),
    )


def _procs(cfg: DataConfig, raw: datasets.Dataset) -> int | None:
    n = min(cfg.num_proc, max(1, len(raw)))
    return n if n > 1 else None


def _step(*parts: Any) -> str:
    """A cache fingerprint for one map step: the input's fingerprint and the step's settings."""
    values = [p._fingerprint if isinstance(p, datasets.Dataset) else p for p in parts]
    blob = json.dumps([PIPELINE_VERSION, *values], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _truncate_ids(batch: dict[str, list], seq_len: int) -> dict:
    """datasets.map function: pre-tokenised ids, truncated, too-short records dropped."""
    ids = [x[:seq_len] for x in batch["input_ids"] if x is not None and len(x) >= MIN_TOKENS]
    return {"input_ids": ids}


def _features(dtype: str, length: int = -1) -> datasets.Features:
    """Token ids of `dtype`; length > 0 is a fixed-size list (packed blocks)."""
    return datasets.Features({"input_ids": datasets.List(datasets.Value(dtype), length=length)})


def sample_lengths(ds: datasets.Dataset) -> list[int]:
    """The token count of every sample of `ds`, in dataset order (read from Arrow, not rows)."""
    lengths = pc.list_value_length(ds.data.column("input_ids")).to_numpy()
    if ds._indices is not None:  # after select/shuffle rows are a view through an index map
        lengths = lengths[ds._indices.column(0).to_numpy()]
    return lengths.tolist()


def dataset_fingerprint(ds: datasets.Dataset) -> str:
    """A short string that changes when the samples change and is stable across processes.

    For a dataset from `build_dataset` it is a hash of the sample contents (and the tokenizer);
    for any other dataset it is datasets' own fingerprint.
    """
    return ds._fingerprint


def _content_hash(ds: datasets.Dataset, tokenizer: HFTokenizer | None) -> str:
    """sha256 over the sample lengths and token values (and labels, and the tokenizer's
    fingerprint, where there are), independent of Arrow chunking."""
    parts = []
    for name in ("input_ids", "labels"):
        if name not in ds.column_names:
            continue
        column = ds.data.column(name)
        lengths, values = hashlib.sha256(), hashlib.sha256()
        for chunk in column.chunks:
            lengths.update(pc.list_value_length(chunk).to_numpy().astype("<i8").tobytes())
            values.update(np.ascontiguousarray(chunk.flatten().to_numpy(zero_copy_only=False)).data)
        parts.append(str(column.type).encode() + lengths.digest() + values.digest())
    if tokenizer is not None:
        parts.append(tokenizer.fingerprint.encode())
    return hashlib.sha256(b"".join(parts)).hexdigest()[:16]
