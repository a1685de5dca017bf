"""The sources of `python -m launcher prepare` cut into pieces, and one piece tokenised in a
worker process exactly as the in-memory pipeline tokenises it (core/data/encode.py): the files of
data.source (sorted; local or fsspec URLs), the tokenizer identity a store records;
a JSON-lines or text piece is a byte range holding the lines that start in it, a parquet piece a
row group. core/data/prepare.py writes the pieces' tokens in order."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from core.config import DataConfig
from core.data.encode import encode_bytes, encode_text, token_dtype
from core.data.errors import DataError
from core.data.sources import FORMAT_BY_SUFFIX, stdlib_records
from core.data.store import open_source
from core.data.tokenizers import BYTES_VOCAB, HFTokenizer, load_tokenizer


@dataclass(frozen=True)
class Source:
    path: str  # in the source filesystem
    name: str  # relative to the source's directory: what index.json records
    fmt: str
    bytes: int


@dataclass(frozen=True)
class Piece:
    file: int
    start: int  # byte offset (text, json) or row group (parquet)
    end: int
    size: int  # bytes, for the progress bar


def tokenizer_identity(cfg: DataConfig, tokenizer: HFTokenizer | None) -> dict[str, Any]:
    """What a store records of its tokenizer, and what training compares with its own."""
    if tokenizer is None:
        return {"name": "bytes", "fingerprint": "bytes", "vocab_size": BYTES_VOCAB}
    return {
        "name": cfg.tokenizer,
        "fingerprint": tokenizer.fingerprint,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
    }


def store_dtype(tokenizer: HFTokenizer | None) -> str:
    return "uint16" if tokenizer is None else token_dtype(tokenizer)


# -- sources ----------------------------------------------------------------------------------
def resolve_sources(cfg: DataConfig, opened: tuple[Any, str] | None) -> tuple[Any, list[Source]]:
    """(source filesystem, the files of data.source in sorted order); `opened` is data.source
    opened by core/data/store.py:open_source (None: the built-in stdlib corpus, one source)."""
    if opened is not None:
        fs, path = opened
        try:
            if any(ch in path for ch in "*?["):
                paths = sorted(p for p in fs.glob(path) if fs.isfile(p))
                base = path[: min(path.find(ch) for ch in "*?[" if ch in path)].rsplit("/", 1)[0]
            else:
                paths = [path] if fs.isfile(path) else []
                base = path.rsplit("/", 1)[0]
            sizes = [fs.size(p) for p in paths]
        except OSError as e:
            raise DataError(f"data.source: cannot list {cfg.source!r}: {e}") from e
        if not paths:
            raise DataError(f"data.source: no files match {cfg.source!r}")
        sources = []
        for p, size in zip(paths, sizes, strict=True):
            name = p[len(base) + 1 :] if base and p.startswith(base + "/") else p.rsplit("/", 1)[-1]
            sources.append(Source(p, name, _format(cfg, p), size))
        return fs, sources
    size = sum(map(len, stdlib_records(cfg.max_bytes)))
    return None, [Source("stdlib", "stdlib", "stdlib", size)]


def _format(cfg: DataConfig, path: str) -> str:
    if cfg.format == "chat":
        raise DataError(
            "data.format: chat rows train from data.source directly; a token store holds "
            "packed text blocks"
        )
    fmt = cfg.format if cfg.format != "auto" else FORMAT_BY_SUFFIX.get(os.path.splitext(path)[1])
    if fmt is None:
        raise DataError(
            f"data.format: cannot infer the format of {path!r} from its extension; accepted: "
            f"{', '.join(FORMAT_BY_SUFFIX)}, or set data.format"
        )
    return fmt


def pieces(fs: Any, sources: list[Source], piece_bytes: int) -> Iterator[Piece]:
    for i, s in enumerate(sources):
        if s.fmt == "parquet":
            import pyarrow.parquet as pq

            with fs.open(s.path, "rb") as f:
                meta = pq.ParquetFile(f).metadata
            for g in range(meta.num_row_groups):
                yield Piece(i, g, g + 1, meta.row_group(g).total_byte_size)
        else:
            step = s.bytes if s.fmt == "stdlib" else piece_bytes
            for start in range(0, s.bytes, max(1, step)):
                end = min(start + step, s.bytes)
                yield Piece(i, start, end, end - start)


# -- workers ----------------------------------------------------------------------------------
_WORKER: dict[str, Any] = {}


def init_worker(cfg: DataConfig, sources: list[Source]) -> None:
    opened = open_source(cfg)
    fs = None if opened is None else opened[0]
    _WORKER.update(cfg=cfg, sources=sources, fs=fs, tokenizer=load_tokenizer(cfg))


def _lines(fs: Any, source: Source, piece: Piece) -> list[str]:
    """The lines that start in [piece.start, piece.end) (the last one read to its end), as
    datasets' text builder reads them (universal newlines, split on "\\n")."""
    with fs.open(source.path, "rb") as f:
        begin = max(0, piece.start - 1)
        f.seek(begin)
        data = f.read(piece.end - begin)
        if piece.start > 0:
            first = data.find(b"\n")
            data = b"" if first < 0 else data[first + 1 :]
        if data and piece.end < source.bytes and not data.endswith(b"\n"):
            data += f.readline()
    text = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    lines = text.split("\n")
    return lines[:-1] if text.endswith("\n") or not text else lines


def _records(piece: Piece) -> list[Any]:
    cfg, source, fs = _WORKER["cfg"], _WORKER["sources"][piece.file], _WORKER["fs"]
    where = f"data.source: {source.name}"
    if source.fmt == "stdlib":
        return [r.decode("utf-8") for r in stdlib_records(cfg.max_bytes)]
    if source.fmt == "parquet":
        import pyarrow.parquet as pq

        with fs.open(source.path, "rb") as f:
            table = pq.ParquetFile(f).read_row_group(piece.start)
        if cfg.text_field not in table.column_names:
            raise DataError(f"{where}: no column {cfg.text_field!r} (data.text_field)")
        return table.column(cfg.text_field).to_pylist()
    try:
        lines = _lines(fs, source, piece)
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text near byte {piece.start} ({e.reason})") from e
    if source.fmt == "text":
        return lines
    texts = []
    for line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: a line near byte {piece.start} is not JSON ({e})") from e
        value = row.get(cfg.text_field) if isinstance(row, dict) else None
        if not isinstance(row, dict) or not (value is None or isinstance(value, str)):
            raise DataError(f"{where}: rows must be objects with a text {cfg.text_field!r}")
        texts.append(value)
    return texts


def tokenize_piece(piece: Piece) -> tuple[np.ndarray, int]:
    """(the piece's token stream, documents in it), as build_dataset would pack them."""
    cfg, tokenizer = _WORKER["cfg"], _WORKER["tokenizer"]
    texts = _records(piece)
    if _WORKER["sources"][piece.file].fmt == "stdlib" and tokenizer is None:
        # build_dataset joins the stdlib files' bytes without separators.
        ids = np.frombuffer("".join(texts).encode("utf-8"), np.uint8)
        return ids.astype(np.uint16), len(texts)
    batch = {"text": texts}
    if tokenizer is None:
        table = encode_bytes(batch, "text", cfg.seq_len, packing=True)
    else:
        table = encode_text(batch, "text", tokenizer, cfg.seq_len, True, token_dtype(tokenizer))
    column = table.column("input_ids")
    flat = pc.list_flatten(column)
    if isinstance(flat, pa.ChunkedArray):
        flat = flat.combine_chunks()
    return flat.to_numpy(zero_copy_only=False).astype(store_dtype(tokenizer)), len(column)
