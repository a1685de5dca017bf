"""A DirectoryState entry (how DeepSpeed's shards enter our checkpoints): whatever files it writes
are fsynced, hashed into the manifest and verified before it is asked to load them."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpointing.manager import CheckpointManager, Entry
from checkpointing.manifest import CheckpointCorruptError, verify
from checkpointing.stateful import DirectoryState
from tests.checkpoints import flip_byte


class Blobs:
    """Writes two files in nested folders, like an engine's own save; records what it loads."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.loaded: bytes | None = None

    def save_to(self, directory: Path) -> None:
        (directory / "tag").mkdir(parents=True)
        (directory / "tag" / "shard-0.pt").write_bytes(self.payload)
        (directory / "script.py").write_text("print('recovery')\n")

    def load_from(self, directory: Path) -> None:
        self.loaded = (directory / "tag" / "shard-0.pt").read_bytes()


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def save(root: Path, blobs: Blobs, step: int = 1) -> Path:
    manager = CheckpointManager(root, engine="deepspeed")
    counter = Counter()
    counter.n = step
    entries = {"engine": Entry(blobs), "counter": Entry(counter)}
    (saved,) = manager.save(step, entries, {}, "fp", checks={}, rank_checks={})
    return Path(saved.location)


def test_directory_files_are_in_the_manifest(tmp_path):
    blobs = Blobs(b"\x00shard bytes" * 100)
    assert isinstance(blobs, DirectoryState) and Entry(blobs).kind == "directory"
    path = save(tmp_path, blobs)
    manifest = verify(path)
    assert manifest.entries == {"engine": "directory", "counter": "global"}
    assert {"engine/tag/shard-0.pt", "engine/script.py"} <= set(manifest.files)
    assert manifest.files["engine/tag/shard-0.pt"]["size"] == 1200


def test_a_flipped_bit_in_a_directory_file_fails_verification(tmp_path):
    path = save(tmp_path, Blobs(b"abc" * 1000))
    flip_byte(path / "engine" / "tag" / "shard-0.pt")
    with pytest.raises(CheckpointCorruptError, match="shard-0.pt: blake3 differs"):
        verify(path)


def test_latest_skips_the_corrupt_one_and_loads_the_directory(tmp_path):
    save(tmp_path, Blobs(b"first"), step=1)
    second = save(tmp_path, Blobs(b"second"), step=2)
    (second / "engine" / "tag" / "shard-0.pt").write_bytes(b"SECOND")  # same size, altered
    manager = CheckpointManager(tmp_path, engine="deepspeed")
    path, manifest = manager.resolve("latest")
    assert path.local_path() == tmp_path / "checkpoint-1"
    blobs, counter = Blobs(b""), Counter()
    manager.load(path, manifest, {"engine": Entry(blobs), "counter": Entry(counter)})
    assert blobs.loaded == b"first" and counter.n == 1
