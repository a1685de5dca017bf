"""Training from a token store: open it, and check before the first step that it is what the run
expects (its tokenizer and seq_len are the run's, its sources have not changed since prepare,
every shard matches its index). The checks are split across ranks (each hashes a share of the
shards and sources) and every rank stops with the same error when one fails."""

from __future__ import annotations

import logging
import time
from typing import Any

from fsspec.implementations.local import LocalFileSystem
from torch.utils.data import Subset

from checkpointing.comm import broadcast_object, gather_objects
from core.config import DataConfig
from core.data.errors import DataError
from core.data.pieces import resolve_sources, tokenizer_identity
from core.data.sources import hash_source
from core.data.store import StoreError, is_store, open_fs, open_source, verify_shard
from core.data.store_reader import TokenStore, UniformLengths
from core.data.tokenizers import HFTokenizer

logger = logging.getLogger(__name__)


def open_training_store(cfg: DataConfig, tokenizer: HFTokenizer | None) -> TokenStore:
    """The store of cfg.store_url, refused (DataError naming both sides) when it was prepared
    with another tokenizer or seq_len."""
    url = cfg.store_url
    assert url is not None
    store = TokenStore(url, cfg.storage_options, cfg.store_cache_bytes)
    theirs, ours = store.index.tokenizer, tokenizer_identity(cfg, tokenizer)
    if theirs.get("fingerprint") != ours["fingerprint"]:
        raise DataError(
            f"data.tokenizer: the store {url} was prepared with tokenizer "
            f"{theirs.get('name')!r} (fingerprint {theirs.get('fingerprint')}), this run's is "
            f"{ours['name']!r} (fingerprint {ours['fingerprint']}); prepare the store again "
            "or set data.tokenizer to the store's"
        )
    if store.index.seq_len != cfg.seq_len:
        raise DataError(
            f"data.seq_len: the store {url} holds blocks of {store.index.seq_len} tokens, this "
            f"run's data.seq_len is {cfg.seq_len}"
        )
    return store


def check_store(cfg: DataConfig, store: TokenStore, rank: int, world: int) -> None:
    """Verify this rank's share of the shards (whole content for a local store; sizes and
    chunk lists for an object store, whose chunks are verified as they are read) and of the
    sources (when data.source names them: unchanged since prepare). Raises on every rank when
    any rank found a problem: StoreError (exit 3) or DataError (exit 2)."""
    start = time.perf_counter()
    problem: tuple[str, str] | None = None
    try:
        _check_share(cfg, store, rank, world)
    except (StoreError, DataError) as e:
        problem = (type(e).__name__, str(e))
    problems = [p for p in gather_objects(problem) if p is not None]
    first = broadcast_object(problems[0] if problems else None)
    if first is not None:
        kind, message = first
        raise (StoreError if kind == "StoreError" else DataError)(message)
    if rank == 0:
        logger.info(
            "data: token store %s: %d blocks of %d tokens in %d shard(s), fingerprint %s, "
            "verified in %.2f s",
            store.url,
            len(store),
            store.index.seq_len,
            len(store.index.shards),
            store.fingerprint,
            time.perf_counter() - start,
        )


def _check_share(cfg: DataConfig, store: TokenStore, rank: int, world: int) -> None:
    fs, root = open_fs(store.url, store.storage_options)
    full = isinstance(fs, LocalFileSystem)
    for k in range(rank, len(store.index.shards), world):
        verify_shard(fs, root, store.index, k, store.url, full)
    if cfg.store is None or cfg.source == cfg.store:
        return  # trained from the store alone: no sources to compare
    if cfg.source != "stdlib" and is_store(cfg.source, cfg.storage_options):
        return
    recorded = {s.get("name"): s for s in store.index.sources}
    if cfg.source == "stdlib" and list(recorded) != ["stdlib"]:
        return  # data.source left at its default: the store alone is the data
    opened = open_source(cfg)
    src_fs, sources = resolve_sources(cfg, opened)
    names = [s.name for s in sources]
    if sorted(recorded) != sorted(names):
        raise DataError(
            f"data.source: {cfg.source!r} now holds files {names}, the store {store.url} was "
            f"prepared from {sorted(recorded)}; prepare the store again"
        )
    for i in range(rank, len(sources), world):
        s, r = sources[i], recorded[sources[i].name]
        if s.bytes != r.get("bytes") or hash_source(src_fs, s, cfg) != r.get("hash"):
            raise DataError(
                f"data.source: {s.name} changed since the store {store.url} was prepared from "
                "it; prepare the store again (python -m launcher prepare --config FILE)"
            )


def store_of(dataset: Any) -> TokenStore | None:
    """The token store under `dataset` (itself, or a Subset of it: the eval holdout split)."""
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    return dataset if isinstance(dataset, TokenStore) else None


def store_lengths(dataset: Any) -> UniformLengths:
    store = store_of(dataset)
    assert store is not None
    return UniformLengths(len(dataset), store.index.seq_len)
