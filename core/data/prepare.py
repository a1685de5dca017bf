"""`python -m launcher prepare`: tokenise data.source once into the token store at data.store
(the format: core/data/store.py).

Streamed and parallel, with a result that does not depend on either: the sources (sorted files,
local or fsspec URLs) are cut into pieces of at most `piece_bytes` (a JSON-lines or text piece
is a byte range holding the lines that start in it; a parquet piece is a row group); workers
tokenise pieces exactly as the in-memory pipeline does (core/data/build.py's encode functions:
the same documents, separators and EOS), and this process writes their tokens in piece order as
blocks of seq_len, so memory holds a few pieces and one chunk whatever the corpus size, and the
store is byte-identical for any data.num_proc. datasets' streaming mode would stream, but
cannot tokenise in parallel or resume; its map caches a whole Arrow copy of the corpus.

Resumable: every shard is committed on its own (written, fsynced, renamed; then its .sum; then
the journal, which records the piece and token where the next shard starts), so a killed
prepare relaunched with the same command keeps the committed shards and continues. index.json
is written last; the journal is removed after it.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from tqdm import tqdm

from core.config import DataConfig
from core.data.build import encode_bytes, encode_text, token_dtype
from core.data.errors import DataError
from core.data.sources import FORMAT_BY_SUFFIX, stdlib_records
from core.data.store import (
    FORMAT,
    HASH,
    INDEX,
    VERSION,
    StoreIndex,
    open_fs,
)
from core.data.tokenizers import BYTES_VOCAB, HFTokenizer, load_tokenizer
from core.data.writer import JOURNAL, _Out, _Shards

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
MAX_PIECE_BYTES = 2 << 20
"""Pieces this small balance the workers on any corpus; their per-piece cost is ~1 ms."""


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
def resolve_sources(cfg: DataConfig) -> tuple[Any, list[Source]]:
    """(source filesystem, the files of data.source in sorted order). stdlib: one source."""
    if cfg.source == "stdlib":
        size = sum(map(len, stdlib_records(cfg.max_bytes)))
        return None, [Source("stdlib", "stdlib", "stdlib", size)]
    fs, path = open_fs(cfg.source, cfg.storage_options)
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


def hash_source(fs: Any, source: Source, cfg: DataConfig) -> str:
    """BLAKE3 of a source file's bytes (streamed; stdlib: of its records)."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if fs is None:
        for record in stdlib_records(cfg.max_bytes):
            h.update(record)
        return h.hexdigest()
    with fs.open(source.path, "rb") as f:
        while block := f.read(16 << 20):
            h.update(block)
    return h.hexdigest()


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


def _init_worker(cfg: DataConfig, sources: list[Source]) -> None:
    fs = None if cfg.source == "stdlib" else open_fs(cfg.source, cfg.storage_options)[0]
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


def prepare(cfg: DataConfig, progress: bool = True) -> StoreIndex:
    """Tokenise cfg.source into the store at cfg.store (continuing a killed prepare of the same
    inputs); returns the committed index. DataError for bad input, StoreWriteError when the
    store cannot be written."""
    if not cfg.store:
        raise DataError("data.store: prepare needs the store to write (a path or fsspec URL)")
    if not cfg.packing:
        raise DataError("data.packing: a token store holds packed blocks; set it to true")
    start = time.perf_counter()
    tokenizer = load_tokenizer(cfg)
    if tokenizer is not None and tokenizer.eos_id is None:
        raise DataError(f"data.tokenizer: {tokenizer.spec} has no eos_token to end documents")
    src_fs, sources = resolve_sources(cfg)
    fs, root = open_fs(cfg.store, cfg.storage_options)
    out = _Out(fs, root, cfg.store)
    dtype = store_dtype(tokenizer)
    block_bytes = cfg.seq_len * np.dtype(dtype).itemsize
    settings = {
        "format": FORMAT,
        "version": VERSION,
        "hash": HASH,
        "seq_len": cfg.seq_len,
        "dtype": dtype,
        "blocks_per_shard": max(1, cfg.shard_bytes // block_bytes),
        "chunk_bytes": min(CHUNK_BYTES, max(1, cfg.shard_bytes // block_bytes) * block_bytes),
        "tokenizer": tokenizer_identity(cfg, tokenizer),
        "text_field": cfg.text_field,
    }
    hashed = [
        {"name": s.name, "bytes": s.bytes, "hash": hash_source(src_fs, s, cfg)} for s in sources
    ]
    existing = out.read_json(INDEX)
    if existing is not None:
        if {k: existing.get(k) for k in settings} == settings and existing.get("sources") == hashed:
            logger.info("prepare: %s is already prepared from these sources", cfg.store)
            return StoreIndex.parse(json.dumps(existing).encode(), cfg.store)
        raise DataError(
            f"data.store: {cfg.store} already holds a store prepared from other sources or "
            "settings; give another data.store, or delete it to prepare again"
        )
    journal = out.read_json(JOURNAL)
    if journal is not None and (
        journal.get("settings") != settings or journal.get("sources") != hashed
    ):
        raise DataError(
            f"data.store: {cfg.store} holds an unfinished prepare of other sources or settings "
            f"(see {JOURNAL}); give another data.store, or delete it to start over"
        )
    journal = journal or {"settings": settings, "sources": hashed, "shards": [], "resume": None}
    resume = journal["resume"] or {"piece": 0, "skip": 0, "documents": 0}
    if journal["shards"]:
        logger.info(
            "prepare: continuing after %d committed shard(s), at piece %d",
            len(journal["shards"]),
            resume["piece"],
        )
    piece_bytes = min(MAX_PIECE_BYTES, max(4096, cfg.shard_bytes))
    all_pieces = list(pieces(src_fs, sources, piece_bytes))
    shards = _Shards(out, settings, journal)
    docs = resume["documents"]
    bar = tqdm(
        total=sum(p.size for p in all_pieces),
        initial=sum(p.size for p in all_pieces[: resume["piece"]]),
        unit="B",
        unit_scale=True,
        desc=f"prepare {cfg.store}",
        disable=not progress,
    )
    tokens_done, t0 = 0, time.perf_counter()
    with bar:
        for p, (tokens, n_docs) in _tokenized(cfg, sources, all_pieces, resume["piece"]):
            base = resume["skip"] if p == resume["piece"] else 0
            shards.add(tokens[base:], p, base, docs)
            docs += n_docs
            tokens_done += len(tokens)
            bar.update(all_pieces[p].size)
            bar.set_postfix(
                docs=docs, tok_s=f"{tokens_done / max(1e-9, time.perf_counter() - t0):.3g}"
            )
        shards.commit(resume={"piece": len(all_pieces), "skip": 0, "documents": docs})
    if not journal["shards"]:
        raise DataError(
            f"data.source: {cfg.source!r} holds fewer than one block of {cfg.seq_len} tokens"
        )
    blocks = sum(s["blocks"] for s in journal["shards"])
    index = {
        **settings,
        "blocks": blocks,
        "tokens": blocks * cfg.seq_len,
        "documents": docs,
        "shards": journal["shards"],
        "sources": hashed,
    }
    out.write_json(INDEX, index)
    out.remove(JOURNAL)
    logger.info(
        "prepare: %s: %d documents, %d blocks of %d tokens (%s) in %d shard(s), %.1f s",
        cfg.store,
        docs,
        blocks,
        cfg.seq_len,
        dtype,
        len(journal["shards"]),
        time.perf_counter() - start,
    )
    return StoreIndex.parse(json.dumps(index).encode(), cfg.store)


def _tokenized(
    cfg: DataConfig, sources: list[Source], all_pieces: list[Piece], first: int
) -> Iterator[tuple[int, tuple[np.ndarray, int]]]:
    """(piece number, its tokens) from `first` on, in order; num_proc workers tokenise ahead
    (at most two pieces each, so memory stays bounded)."""
    todo = range(first, len(all_pieces))
    procs = min(cfg.num_proc, len(todo))
    if procs <= 1:
        _init_worker(cfg, sources)
        for p in todo:
            yield p, tokenize_piece(all_pieces[p])
        return
    # spawn: the parent may hold threads (tokenizers', fsspec's event loop) that fork would copy
    # mid-operation.
    context = mp.get_context("spawn")
    # Each worker's tokenizer thread pool is sized by the environment it inherits
    # (launcher.prepare.share_cores: workers x threads = the cores); core reads no environment.
    with ProcessPoolExecutor(procs, context, _init_worker, (cfg, sources)) as pool:
        window: deque[tuple[int, Future]] = deque()
        pending = iter(todo)
        for p in pending:
            window.append((p, pool.submit(tokenize_piece, all_pieces[p])))
            if len(window) >= 2 * procs:
                break
        while window:
            p, future = window.popleft()
            result = future.result()
            nxt = next(pending, None)
            if nxt is not None:
                window.append((nxt, pool.submit(tokenize_piece, all_pieces[nxt])))
            yield p, result
