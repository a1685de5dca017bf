"""The manifest: the commit marker of a checkpoint, and the verification of every file in it.

A directory `checkpoint-<step>` counts only if its `manifest.json` parses and every file it names
has the recorded size and hash (BLAKE3; sha256 in format 1 manifests, which still verify, see
`checkpointing.digest`). Nothing is read from a checkpoint before this check passes.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from checkpointing.digest import DigestRecordError, digest_file, digest_stream, recorded
from checkpointing.retry import retrying
from checkpointing.storage import Storage, as_storage

# 3: lease_epoch recorded; 2: files recorded as {"size", "hash": {"algorithm", "digest"}}
# (BLAKE3); 1: {"size", "sha256"}.
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
MANIFEST = "manifest.json"
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(Exception):
    """A checkpoint cannot be used as asked; the message is one line naming the cause."""


class CheckpointCorruptError(CheckpointError):
    """A file of a checkpoint is missing, truncated, altered or unreadable."""


@dataclass
class Manifest:
    step: int
    world_size: int
    engine: str
    config_fingerprint: str
    trajectory: dict[str, Any]
    """The config fields that decide the trajectory, as saved (compared on resume)."""
    files: dict[str, dict[str, Any]]
    """Relative path -> {"size": bytes, "hash": {"algorithm": "blake3", "digest": hex}} of every
    file but the manifest (format 1: {"size", "sha256"})."""
    entries: dict[str, str]
    """State name -> "global" (written once, by rank 0), "per_rank", "sharded" (each rank's
    pieces of distributed tensors) or "directory" (an engine's own files)."""
    checks: dict[str, Any] = field(default_factory=dict)
    """Values recomputed after loading (lr, next sample ids, per-rank RNG fingerprints)."""
    created: float = 0.0
    format_version: int = FORMAT_VERSION
    lease_epoch: int | None = None
    """The epoch of the run's lease the committing job held (checkpointing/lease.py); None
    when saved without a lease (the Python API's CheckpointManager alone, older versions)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @property
    def total_bytes(self) -> int:
        return sum(f["size"] for f in self.files.values())


def read_manifest(where: str | os.PathLike | Storage) -> Manifest:
    """Parse `manifest.json` of a checkpoint; CheckpointCorruptError if absent or malformed."""
    storage = as_storage(where)
    where_text = storage.display(MANIFEST)
    try:
        data = retrying(
            f"reading {where_text}", lambda: storage.read_bytes(MANIFEST), storage.retries
        )
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
        raise CheckpointCorruptError(f"{where_text}: no manifest (an incomplete checkpoint)") from e
    try:
        manifest = Manifest(**json.loads(data))
    except (ValueError, TypeError) as e:
        raise CheckpointCorruptError(f"{where_text}: unreadable manifest ({e})") from e
    if manifest.format_version not in READABLE_VERSIONS:
        raise CheckpointCorruptError(
            f"{where_text}: format version {manifest.format_version}, "
            f"this code reads {', '.join(map(str, READABLE_VERSIONS))}"
        )
    if not isinstance(manifest.files, dict):
        raise CheckpointCorruptError(f"{where_text}: unreadable manifest (files is not a mapping)")
    for rel, meta in manifest.files.items():
        try:
            recorded(meta)
        except DigestRecordError as e:
            raise CheckpointCorruptError(f"{where_text}: unreadable manifest ({rel}: {e})") from e
    return manifest


def verify_file(storage: Storage, rel: str, meta: dict[str, Any]) -> None:
    """Check one file of a checkpoint against its manifest entry (size, then hash)."""
    where = storage.display(rel)
    size_recorded, algorithm, digest = recorded(meta)

    def check() -> None:
        try:
            size = storage.size(rel)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
            raise CheckpointCorruptError(f"{where}: missing") from e
        if size != size_recorded:
            raise CheckpointCorruptError(
                f"{where}: {size} bytes, the manifest says {size_recorded}"
            )
        local = storage.local_path(rel)
        if local is not None:
            found = digest_file(local, algorithm)
        else:
            with storage.open_read(rel) as f:
                found = digest_stream(f, algorithm)
        if found != (size_recorded, digest):
            raise CheckpointCorruptError(f"{where}: {algorithm} differs from the manifest")

    retrying(f"verifying {where}", check, storage.retries)


def verify(where: str | os.PathLike | Storage, only: list[str] | None = None) -> Manifest:
    """Check the manifest and every file it lists (or the listed subset `only`); return it."""
    storage = as_storage(where)
    manifest = read_manifest(storage)
    for rel, meta in manifest.files.items():
        if only is None or rel in only:
            verify_file(storage, rel, meta)
    return manifest


def checkpoint_step(name: str) -> int | None:
    """The step of a `checkpoint-<step>` name, else None (temp dirs never match)."""
    m = CHECKPOINT_RE.match(name)
    return int(m.group(1)) if m else None


def list_checkpoints(root: str | os.PathLike | Storage) -> list[tuple[int, str]]:
    """(step, name) of every `checkpoint-<step>` directory under root, newest first,
    committed or not (use `verify` to tell)."""
    storage = as_storage(root)
    found = [(s, n) for n in storage.listdir() if (s := checkpoint_step(n)) is not None]
    return sorted(found, reverse=True)


def list_committed(root: str | os.PathLike | Storage) -> list[tuple[int, str]]:
    """The checkpoints under root whose manifest exists (not verified), newest first."""
    storage = as_storage(root)
    return [(s, n) for s, n in list_checkpoints(storage) if storage.exists(f"{n}/{MANIFEST}")]
