"""Reading a token store in training: `TokenStore`, the map-style dataset over its blocks (a
local store memory-mapped, an object store by verified byte ranges), and the per-sample lengths
a store implies. The format, its index and its verification are core/data/store.py."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np
from fsspec.implementations.local import LocalFileSystem
from torch.utils.data import Dataset

from core.data.store import StoreIndex, check_chunk, open_fs, read_index, read_sums


class UniformLengths:
    """Per-sample token counts of a store: all seq_len, without an array of N entries."""

    def __init__(self, n: int, seq_len: int) -> None:
        self.n, self.seq_len = n, seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, ids: Any) -> np.ndarray:
        return np.full(np.shape(ids), self.seq_len, dtype=np.int64)


def uniform_length(lengths: np.ndarray | UniformLengths | None) -> int | None:
    """The one token count all samples share, if they share one (None without lengths)."""
    if lengths is None:
        return None
    if isinstance(lengths, UniformLengths):
        return lengths.seq_len
    if len(lengths) and lengths.min() == lengths.max():
        return int(lengths[0])
    return None


class TokenStore(Dataset):
    """A map-style dataset over a token store: item i is {"input_ids": block i} (an ndarray of
    seq_len ids in the store's dtype). Local stores are memory-mapped; others are read in
    chunk_bytes byte ranges, each verified against its digest, kept in an LRU cache of
    `cache_bytes` per process. Picklable (DataLoader workers reopen it in their process)."""

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        cache_bytes: int = 256 << 20,
        index: StoreIndex | None = None,
    ) -> None:
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.cache_bytes = cache_bytes
        self.index = index or read_index(url, storage_options)
        self.fingerprint = self.index.fingerprint
        self._pid: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")} | {"_pid": None}

    def _open(self) -> None:
        """Per process: the filesystem, memory maps, chunk cache (never shared across fork)."""
        if self._pid == os.getpid():
            return
        fs, root = open_fs(self.url, self.storage_options | {"skip_instance_cache": True})
        self._fs, self._root = fs, root
        self._local = isinstance(fs, LocalFileSystem)
        self._maps: dict[int, np.ndarray] = {}
        self._sums: dict[int, bytes] = {}
        self._cache: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        self._cached = 0
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self.index.blocks

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"input_ids": self.read([i])[0]}

    def __getitems__(self, ids: list[int]) -> list[dict[str, np.ndarray]]:
        return [{"input_ids": row} for row in self.read(ids)]

    def read(self, ids: Iterable[int]) -> np.ndarray:
        """Blocks `ids` as an array of shape (len(ids), seq_len)."""
        self._open()
        ids = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64)
        n = self.index.blocks
        low, high = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
        if low < 0 or high >= n:
            raise IndexError(f"block {high if high >= n else low} out of range for {n} blocks")
        per = self.index.blocks_per_shard
        if self._local and low // per == high // per:  # one shard: one fancy index
            k = low // per
            return self._map(k)[ids - k * per] if k else self._map(0)[ids]
        out = np.empty((len(ids), self.index.seq_len), dtype=self.index.dtype)
        shard_of = ids // per
        for k in np.unique(shard_of).tolist():
            rows = np.flatnonzero(shard_of == k)
            local = ids[rows] - k * per
            if self._local:
                out[rows] = self._map(k)[local]
            else:
                out[rows] = self._ranged(k, local)
        return out

    def read_sampled(self, ids: np.ndarray) -> np.ndarray:
        """`read` for int64 ids a sampler drew (in range by construction): a local one-shard
        store skips the checks and the shard grouping, the per-batch cost of a training loop."""
        self._open()
        if self._local and len(self.index.shards) == 1:
            return self._map(0)[ids]
        return self.read(ids)

    def _map(self, k: int) -> np.ndarray:
        m = self._maps.get(k)
        if m is None:
            shard = self.index.shards[k]
            m = np.memmap(
                f"{self._root}/{shard.name}",
                dtype=np.dtype(self.index.dtype).newbyteorder("<"),
                mode="r",
                shape=(shard.blocks, self.index.seq_len),
            )
            self._maps[k] = m
        return m

    def _ranged(self, k: int, local: np.ndarray) -> np.ndarray:
        """Blocks of shard k from verified chunks (fetched concurrently where missing)."""
        ix, c, bb = self.index, self.index.chunk_bytes, self.index.block_bytes
        if k not in self._sums:
            self._sums[k] = read_sums(self._fs, self._root, ix, k, self.url)
        starts = local * bb
        first, last = starts // c, (starts + bb - 1) // c
        needed = sorted({(k, j) for a, b in zip(first, last, strict=True) for j in range(a, b + 1)})
        have = {key: self._cache[key] for key in needed if key in self._cache}
        missing = [key for key in needed if key not in have]
        if missing:
            size = ix.shards[k].bytes
            path = f"{self._root}/{ix.shards[k].name}"
            blobs = self._fs.cat_ranges(
                [path] * len(missing),
                [j * c for _, j in missing],
                [min((j + 1) * c, size) for _, j in missing],
            )
            for (_, j), blob in zip(missing, blobs, strict=True):
                if isinstance(blob, Exception):
                    raise blob
                check_chunk(self._sums[k], j, blob, ix, k, self.url)
                have[(k, j)] = blob
                self._remember((k, j), blob)
        for key in needed:
            if key in self._cache:
                self._cache.move_to_end(key)
        rows = np.empty((len(local), ix.seq_len), dtype=ix.dtype)
        dtype = np.dtype(ix.dtype).newbyteorder("<")
        for r, (s, a, b) in enumerate(zip(starts, first, last, strict=True)):
            raw = b"".join(have[(k, j)] for j in range(a, b + 1))
            offset = s - a * c
            rows[r] = np.frombuffer(raw, dtype=dtype, count=ix.seq_len, offset=offset)
        return rows

    def _remember(self, key: tuple[int, int], blob: bytes) -> None:
        self._cache[key] = blob
        self._cached += len(blob)
        while self._cached > self.cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached -= len(old)
