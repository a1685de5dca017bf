"""The manifest: the commit marker of a checkpoint, and the verification of every file in it.

A directory `checkpoint-<step>` counts only if its `manifest.json` parses and every file it names
has the recorded size and sha256. Nothing is read from a checkpoint before this check passes.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_CHUNK = 8 << 20


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
    """Relative path -> {"size": bytes, "sha256": hex digest} of every file but the manifest."""
    entries: dict[str, str]
    """State name -> "global" (written once, by rank 0) or "per_rank"."""
    checks: dict[str, Any] = field(default_factory=dict)
    """Values recomputed after loading (lr, next sample ids, per-rank RNG fingerprints)."""
    created: float = 0.0
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @property
    def total_bytes(self) -> int:
        return sum(f["size"] for f in self.files.values())


def digest_stream(f: BinaryIO) -> tuple[int, str]:
    """(bytes read, hex sha256) of what is left in an open binary file."""
    h = hashlib.sha256()
    size = 0
    while chunk := f.read(_CHUNK):
        h.update(chunk)
        size += len(chunk)
    return size, h.hexdigest()


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return digest_stream(f)[1]


def read_manifest(directory: str | Path) -> Manifest:
    """Parse `directory/manifest.json`; CheckpointCorruptError if absent or malformed."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CheckpointCorruptError(f"{path}: no manifest (an incomplete checkpoint)")
    try:
        raw = json.loads(path.read_text())
        manifest = Manifest(**raw)
    except (ValueError, TypeError) as e:
        raise CheckpointCorruptError(f"{path}: unreadable manifest ({e})") from e
    if manifest.format_version != FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"{path}: format version {manifest.format_version}, this code reads {FORMAT_VERSION}"
        )
    return manifest


def verify(directory: str | Path) -> Manifest:
    """Check the manifest and every file it lists (size, then sha256); return the manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    for rel, meta in manifest.files.items():
        path = directory / rel
        if not path.is_file():
            raise CheckpointCorruptError(f"{path}: missing")
        size = path.stat().st_size
        if size != meta["size"]:
            raise CheckpointCorruptError(f"{path}: {size} bytes, the manifest says {meta['size']}")
        if sha256_file(path) != meta["sha256"]:
            raise CheckpointCorruptError(f"{path}: sha256 differs from the manifest")
    return manifest


def checkpoint_step(path: Path) -> int | None:
    """The step of a `checkpoint-<step>` directory name, else None (temp dirs never match)."""
    m = CHECKPOINT_RE.match(path.name)
    return int(m.group(1)) if m and path.is_dir() else None


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every `checkpoint-<step>` directory under root, newest first,
    committed or not (use `verify` to tell)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if (s := checkpoint_step(p)) is not None]
    return sorted(found, reverse=True)


def list_committed(root: str | Path) -> list[tuple[int, Path]]:
    """The checkpoints under root whose manifest exists (not verified), newest first."""
    return [(s, p) for s, p in list_checkpoints(root) if (p / MANIFEST).is_file()]
