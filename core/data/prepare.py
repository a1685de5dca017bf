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
from fsspec.implementations.local import LocalFileSystem
from tqdm import tqdm

from checkpointing.storage import io_error_types
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
    digest,
    open_fs,
    shard_name,
    sums_name,
)
from core.data.tokenizers import BYTES_VOCAB, HFTokenizer, load_tokenizer

logger = logging.getLogger(__name__)
IO_ERRORS = io_error_types()

JOURNAL = "prepare-journal.json"
CHUNK_BYTES = 1 << 20
MAX_PIECE_BYTES = 2 << 20
"""Pieces this small balance the workers on any corpus; their per-piece cost is ~1 ms."""


class StoreWriteError(OSError):
    """The store could not be written (full disk, unreachable store): committed shards are
    intact and a relaunch continues."""


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


def _init_worker(cfg: DataConfig, sources: list[Source], threads: int = 0) -> None:
    if threads:  # before the tokenizer's thread pool starts: workers x threads = the cores
        os.environ["RAYON_NUM_THREADS"] = str(threads)
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


# -- writing ----------------------------------------------------------------------------------
class _Out:
    """Writes store files: locally to a temporary name, fsynced, then renamed (a crash leaves no
    half file under a final name); to an object store by a put that appears whole or not at all."""

    def __init__(self, fs: Any, root: str, where: str) -> None:
        self.fs, self.root, self.where = fs, root, where
        self.local = isinstance(fs, LocalFileSystem)
        try:
            fs.makedirs(root, exist_ok=True)
            if self.local:  # what a killed prepare left half-written (never under a final name)
                for name in os.listdir(root):
                    if name.startswith(".") and name.endswith(".tmp"):
                        os.unlink(os.path.join(root, name))
        except IO_ERRORS as e:
            raise StoreWriteError(f"prepare: cannot create {where}: {e}") from e

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def stream(self, name: str) -> _Stream:
        return _Stream(self, name)

    def sync_dir(self) -> None:
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write(self, name: str, parts: list[Any]) -> None:
        try:
            if self.local:
                tmp = self.path(f".{name}.tmp")
                try:
                    with open(tmp, "wb") as f:
                        for part in parts:
                            f.write(part)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, self.path(name))
                except BaseException:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
                    raise
                self.sync_dir()
            else:
                self.fs.pipe_file(self.path(name), b"".join(bytes(memoryview(p)) for p in parts))
        except IO_ERRORS as e:
            raise StoreWriteError(
                f"prepare: cannot write {name} to {self.where}: {e}; the shards committed so far "
                "are kept: relaunch the same command to continue"
            ) from e

    def read_json(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads(self.fs.cat_file(self.path(name)))
        except FileNotFoundError:
            return None
        except (*IO_ERRORS, ValueError) as e:
            raise StoreWriteError(f"prepare: cannot read {name} in {self.where}: {e}") from e

    def write_json(self, name: str, value: dict[str, Any]) -> None:
        self.write(name, [json.dumps(value, indent=1, sort_keys=True).encode() + b"\n"])

    def remove(self, name: str) -> None:
        try:
            self.fs.rm_file(self.path(name))
        except FileNotFoundError:
            pass


class _Stream:
    """One store file written piece by piece: locally under a temporary name (fsynced and
    renamed by commit), on an object store as one streamed upload (it appears at commit)."""

    def __init__(self, out: _Out, name: str) -> None:
        self.out, self.name = out, name
        self.tmp = out.path(f".{name}.tmp") if out.local else out.path(name)
        self.f: Any = None
        self._do(
            lambda: setattr(
                self, "f", open(self.tmp, "wb") if out.local else out.fs.open(self.tmp, "wb")
            )
        )

    def _do(self, action: Any) -> None:
        try:
            action()
        except IO_ERRORS as e:
            self.abort()
            raise StoreWriteError(
                f"prepare: cannot write {self.name} to {self.out.where}: {e}; the shards "
                "committed so far are kept: relaunch the same command to continue"
            ) from e

    def write(self, data: memoryview) -> None:
        self._do(lambda: self.f.write(data))

    def commit(self) -> None:
        def finish() -> None:
            if self.out.local:
                self.f.flush()
                os.fsync(self.f.fileno())
                self.f.close()
                os.replace(self.tmp, self.out.path(self.name))
                self.out.sync_dir()
            else:
                self.f.close()

        self._do(finish)

    def abort(self) -> None:
        f, self.f = self.f, None
        if f is None:
            return
        try:
            if hasattr(f, "discard"):  # an object-store upload: abandon it
                f.discard()
            f.close()
        except (*IO_ERRORS, ValueError):
            pass
        if self.out.local and os.path.exists(self.tmp):
            os.unlink(self.tmp)


class _Shards:
    """Cuts the token stream into blocks and the blocks into shards, each streamed to the store
    as its blocks complete (memory: one partial block and the chunk being hashed) and committed
    when full."""

    def __init__(self, out: _Out, settings: dict[str, Any], journal: dict[str, Any]) -> None:
        self.out, self.settings, self.journal = out, settings, journal
        self.seq_len = settings["seq_len"]
        self.per = settings["blocks_per_shard"]
        self.chunk = settings["chunk_bytes"]
        self.dtype = np.dtype(settings["dtype"]).newbyteorder("<")
        self.carry = np.zeros(0, self.dtype)  # tokens short of a whole block
        self.stream: _Stream | None = None
        self.blocks = self.nbytes = self.in_chunk = 0
        self.sums = bytearray()
        self.hasher = blake3.blake3()

    def add(self, tokens: np.ndarray, piece: int, base: int, docs_before: int) -> None:
        """Append `tokens`, piece `piece`'s output from its token `base` on."""
        pos = 0
        while pos < len(tokens):
            room = (self.per - self.blocks) * self.seq_len - len(self.carry)
            take = min(room, len(tokens) - pos)
            data = tokens[pos : pos + take]
            if len(self.carry):
                data = np.concatenate([self.carry, data.astype(self.dtype, copy=False)])
            pos += take
            whole = len(data) // self.seq_len * self.seq_len
            if whole:
                self._write(data[:whole])
            self.carry = data[whole:].astype(self.dtype)
            if self.blocks == self.per:
                self.commit(resume={"piece": piece, "skip": base + pos, "documents": docs_before})

    def _write(self, data: np.ndarray) -> None:
        if self.stream is None:
            self.stream = self.out.stream(shard_name(len(self.journal["shards"])))
        view = memoryview(np.ascontiguousarray(data.astype(self.dtype, copy=False))).cast("B")
        self.stream.write(view)
        i = 0
        while i < len(view):  # chunk digests, as the bytes go by
            n = min(self.chunk - self.in_chunk, len(view) - i)
            self.hasher.update(view[i : i + n])
            self.in_chunk += n
            i += n
            if self.in_chunk == self.chunk:
                self._end_chunk()
        self.blocks += len(data) // self.seq_len
        self.nbytes += len(view)

    def _end_chunk(self) -> None:
        self.sums += self.hasher.digest()
        self.hasher, self.in_chunk = blake3.blake3(), 0

    def commit(self, resume: dict[str, Any] | None) -> None:
        """Commit the open shard (at the end: the tokens short of a block are dropped)."""
        self.carry = self.carry[:0]
        if self.stream is None:
            return
        if self.in_chunk:
            self._end_chunk()
        name, sums = self.stream.name, bytes(self.sums)
        self.stream.commit()
        self.out.write(sums_name(name), [sums])
        self.journal["shards"].append(
            {"name": name, "blocks": self.blocks, "bytes": self.nbytes, "hash": digest(sums).hex()}
        )
        self.journal["resume"] = resume
        self.out.write_json(JOURNAL, self.journal)
        self.stream, self.sums = None, bytearray()
        self.blocks = self.nbytes = 0


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
    threads = max(1, (os.cpu_count() or 1) // procs)
    with ProcessPoolExecutor(procs, context, _init_worker, (cfg, sources, threads)) as pool:
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
