"""`python -m launcher prepare`: tokenise data.source once into the token store at data.store
(the format: core/data/store.py).

Streamed and parallel, with a result that does not depend on either: the sources (sorted files,
local or fsspec URLs) are cut into pieces of at most `piece_bytes` (a JSON-lines or text piece
is a byte range holding the lines that start in it; a parquet piece is a row group); workers
tokenise pieces exactly as the in-memory pipeline does (core/data/pieces.py, with the encode
functions of core/data/encode.py: the same documents, separators and EOS), and this process
writes their tokens in piece order as blocks of seq_len, so memory holds a few pieces and one
chunk whatever the corpus size, and the store is byte-identical for any data.num_proc.
datasets' streaming mode would stream, but cannot tokenise in parallel or resume; its map
caches a whole Arrow copy of the corpus.

Resumable: every shard is committed on its own (written, fsynced, renamed; then its .sum; then
the journal, which records the piece and token where the next shard starts), so a killed
prepare relaunched with the same command keeps the committed shards and continues. index.json
is written last; the journal is removed after it.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor

import numpy as np
from tqdm import tqdm

from core.config import DataConfig
from core.data.errors import DataError
from core.data.pieces import (
    Piece,
    Source,
    init_worker,
    pieces,
    resolve_sources,
    store_dtype,
    tokenize_piece,
    tokenizer_identity,
)
from core.data.sources import hash_source
from core.data.store import (
    FORMAT,
    HASH,
    INDEX,
    VERSION,
    StoreIndex,
    open_fs,
    open_source,
)
from core.data.tokenizers import load_tokenizer
from core.data.writer import JOURNAL, _Out, _Shards

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
MAX_PIECE_BYTES = 2 << 20
"""Pieces this small balance the workers on any corpus; their per-piece cost is ~1 ms."""


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
    opened = open_source(cfg)
    src_fs, sources = resolve_sources(cfg, opened)
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
        init_worker(cfg, sources)
        for p in todo:
            yield p, tokenize_piece(all_pieces[p])
        return
    # spawn: the parent may hold threads (tokenizers', fsspec's event loop) that fork would copy
    # mid-operation.
    context = mp.get_context("spawn")
    # Each worker's tokenizer thread pool is sized by the environment it inherits
    # (launcher.prepare.share_cores: workers x threads = the cores); core reads no environment.
    with ProcessPoolExecutor(procs, context, init_worker, (cfg, sources)) as pool:
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
