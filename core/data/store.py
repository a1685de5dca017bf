"""Token stores: a corpus tokenised once (`python -m launcher prepare`) into fixed blocks that
training reads by block number, from a local disk or an object store.

On disk (a directory, or a prefix of an fsspec URL such as s3://bucket/store):

    index.json          written last, the commit marker: format version, tokenizer identity,
                        seq_len, dtype, blocks per shard, totals, every shard's size and hash,
                        the source files with their sizes and hashes
    shard-00000.bin     raw little-endian uint16 (uint32 when the vocabulary needs it) token ids,
                        blocks_per_shard blocks of seq_len tokens (the last shard fewer); a
                        numpy.memmap of shape (blocks, seq_len) opens it as it is
    shard-00000.sum     the BLAKE3 digest (32 bytes) of every chunk_bytes chunk of the .bin

Sample i is block i, whatever the shard size: the sampler's (seed, epoch, position) is the whole
data state. A shard's hash in the index is the BLAKE3 of its .sum file, so one chunk can be
checked on its own: a local store is verified whole before training starts (each rank a share of
the shards), an object store chunk by chunk as byte ranges arrive, before any byte is decoded.
Why not datasets' Arrow cache or Megatron's .bin/.idx: neither is verified before it is read,
and neither can be read by byte ranges from an object store with a bounded local cache.
Training reads a store through `TokenStore` (core/data/store_reader.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import blake3
import fsspec
import numpy as np

from checkpointing.manifest import CheckpointError
from core.config import DataConfig
from core.data.errors import DataError

FORMAT = "token-store"
VERSION = 1
INDEX = "index.json"
HASH = "blake3"
DIGEST_BYTES = 32
DTYPES = ("uint16", "uint32")
MAX_INDEX_BYTES = 1 << 30
_SHARD_NAME = re.compile(r"shard-\d{5,9}\.bin")


class StoreError(CheckpointError):
    """A token store failed verification (a missing or altered shard): exit 3, like a corrupt
    checkpoint."""


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.bin"


def sums_name(shard: str) -> str:
    return shard[: -len(".bin")] + ".sum"


def digest(data: bytes | memoryview) -> bytes:
    return blake3.blake3(data).digest()


@dataclass(frozen=True)
class Shard:
    name: str
    blocks: int
    bytes: int
    hash: str
    """BLAKE3 of the shard's .sum file (hex)."""


@dataclass(frozen=True)
class StoreIndex:
    """index.json, checked field by field (a hostile file is refused, never trusted)."""

    raw: dict[str, Any]
    seq_len: int
    dtype: str
    blocks_per_shard: int
    chunk_bytes: int
    blocks: int
    shards: tuple[Shard, ...]
    tokenizer: dict[str, Any]
    sources: tuple[dict[str, Any], ...]

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def block_bytes(self) -> int:
        return self.seq_len * self.itemsize

    @property
    def fingerprint(self) -> str:
        """Changes when any block's content could: tokenizer, seq_len, dtype, shard hashes."""
        blob = json.dumps(
            [self.tokenizer.get("fingerprint"), self.seq_len, self.dtype, self.blocks]
            + [[s.blocks, s.hash] for s in self.shards]
        )
        return "store:" + hashlib.sha256(blob.encode()).hexdigest()[:16]

    @classmethod
    def parse(cls, text: bytes, where: str) -> StoreIndex:
        try:
            raw = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StoreError(f"token store {where}: index.json is not JSON ({e})") from e

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise StoreError(f"token store {where}: index.json {what}")

        def count(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)  # JSON true is no count

        need(isinstance(raw, dict), "is not an object")
        need(raw.get("format") == FORMAT, f"is not a {FORMAT} index")
        need(raw.get("version") == VERSION, f"has version {raw.get('version')!r}, not {VERSION}")
        need(raw.get("hash") == HASH, f"names hash {raw.get('hash')!r}, not {HASH}")
        ints = ("seq_len", "blocks_per_shard", "chunk_bytes", "blocks")
        for key in ints:
            value = raw.get(key)
            need(count(value) and value > 0, f"{key}")
        need(raw.get("dtype") in DTYPES, f"dtype {raw.get('dtype')!r} is not one of {DTYPES}")
        need(isinstance(raw.get("tokenizer"), dict), "has no tokenizer")
        need(isinstance(raw.get("sources"), list), "has no sources list")
        shards_raw = raw.get("shards")
        need(isinstance(shards_raw, list) and len(shards_raw) > 0, "has no shards")
        block_bytes = raw["seq_len"] * np.dtype(raw["dtype"]).itemsize
        shards = []
        for k, s in enumerate(shards_raw):
            need(isinstance(s, dict), f"shard {k} is not an object")
            last = k == len(shards_raw) - 1
            blocks = s.get("blocks")
            need(
                count(blocks)
                and 0 < blocks <= raw["blocks_per_shard"]
                and (last or blocks == raw["blocks_per_shard"]),
                f"shard {k} has a bad block count {blocks!r}",
            )
            need(s.get("name") == shard_name(k), f"shard {k} is not named {shard_name(k)}")
            need(
                count(s.get("bytes")) and s["bytes"] == blocks * block_bytes,
                f"shard {k} has a bad size",
            )
            need(
                isinstance(s.get("hash"), str) and re.fullmatch(r"[0-9a-f]{64}", s["hash"]),
                f"shard {k} has a bad hash",
            )
            shards.append(Shard(s["name"], blocks, s["bytes"], s["hash"]))
        need(sum(s.blocks for s in shards) == raw["blocks"], "blocks do not add up")
        return cls(
            raw,
            raw["seq_len"],
            raw["dtype"],
            raw["blocks_per_shard"],
            raw["chunk_bytes"],
            raw["blocks"],
            tuple(shards),
            raw["tokenizer"],
            tuple(raw["sources"]),
        )


def open_fs(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """(fsspec filesystem, root path in it) of a store URL or local path."""
    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError, TypeError) as e:
        raise DataError(f"data.store: cannot open {url!r}: {e}") from e
    return fs, root.rstrip("/")


def open_source(cfg: DataConfig) -> tuple[Any, str] | None:
    """data.source opened as `open_fs` opens a store; None for the built-in stdlib corpus."""
    if cfg.source == "stdlib":
        return None
    return open_fs(cfg.source, cfg.storage_options)


def is_store(url: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether `url` holds a committed token store (an index.json)."""
    fs, root = open_fs(url, storage_options)
    return bool(fs.isfile(f"{root}/{INDEX}"))


def read_index(url: str, storage_options: dict[str, Any] | None = None) -> StoreIndex:
    fs, root = open_fs(url, storage_options)
    path = f"{root}/{INDEX}"
    try:
        size = fs.size(path)
    except FileNotFoundError:
        raise DataError(
            f"data.store: {url!r} holds no {INDEX} (not a token store, or its prepare did not "
            "finish: run python -m launcher prepare --config FILE)"
        ) from None
    if size > MAX_INDEX_BYTES:
        raise StoreError(f"token store {url}: {INDEX} is {size} bytes, more than any index")
    return StoreIndex.parse(fs.cat_file(path), url)


def read_sums(fs: Any, root: str, index: StoreIndex, k: int, where: str) -> bytes:
    shard = index.shards[k]
    expected = -(-shard.bytes // index.chunk_bytes) * DIGEST_BYTES
    path = f"{root}/{sums_name(shard.name)}"
    try:
        sums = fs.cat_file(path)
    except FileNotFoundError:
        raise StoreError(f"token store {where}: {sums_name(shard.name)} is missing") from None
    if len(sums) != expected or digest(sums).hex() != shard.hash:
        raise StoreError(
            f"token store {where}: {sums_name(shard.name)} does not match index.json "
            "(altered or truncated)"
        )
    return sums


def check_chunk(sums: bytes, j: int, chunk: bytes, index: StoreIndex, k: int, where: str) -> None:
    """Raise StoreError unless chunk j of shard k has the digest its .sum lists."""
    if digest(chunk) != sums[j * DIGEST_BYTES : (j + 1) * DIGEST_BYTES]:
        c = index.chunk_bytes
        raise StoreError(
            f"token store {where}: {index.shards[k].name} differs from index.json at bytes "
            f"{j * c}..{j * c + len(chunk)} (altered)"
        )


def verify_shard(fs: Any, root: str, index: StoreIndex, k: int, where: str, full: bool) -> None:
    """Raise StoreError unless shard k is as the index says: size and chunk list always, every
    chunk's digest with `full`."""
    shard = index.shards[k]
    path = f"{root}/{shard.name}"
    try:
        size = fs.size(path)
    except FileNotFoundError:
        raise StoreError(f"token store {where}: {shard.name} is missing") from None
    if size != shard.bytes:
        raise StoreError(
            f"token store {where}: {shard.name} has {size} bytes, index.json says {shard.bytes}"
        )
    sums = read_sums(fs, root, index, k, where)
    if not full:
        return
    with fs.open(path, "rb") as f:
        for j in range(len(sums) // DIGEST_BYTES):
            check_chunk(sums, j, f.read(index.chunk_bytes), index, k, where)


def verify_store(
    url: str,
    storage_options: dict[str, Any] | None = None,
    shards: Iterable[int] | None = None,
    full: bool = True,
    threads: int = 4,
) -> StoreIndex:
    """Check `shards` (default: all) of the store against its index; StoreError names the first
    bad shard. Shards are checked on `threads` threads (BLAKE3 releases the GIL)."""
    index = read_index(url, storage_options)
    fs, root = open_fs(url, storage_options)
    todo = list(range(len(index.shards)) if shards is None else shards)
    with ThreadPoolExecutor(max(1, min(threads, len(todo) or 1))) as pool:
        list(pool.map(lambda k: verify_shard(fs, root, index, k, url, full), todo))
    return index
