"""Helpers to compare checkpoints and runs bit for bit."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import uuid
from pathlib import Path
from typing import Any

import blake3
import torch
from safetensors.torch import load_file

from checkpointing.manifest import read_manifest
from checkpointing.serialize import load_state
from checkpointing.sharded import read_entry
from checkpointing.storage import LocalStorage, Storage, as_storage
from tests.launch import read_metrics

# Entries whose files must be byte-identical between an interrupted run and an uninterrupted
# one. (train_state holds wall-clock step times, so it is compared field by field instead.)
EXACT_ENTRIES = ("model", "optimizer", "scheduler", "sampler")


def load_entry(checkpoint: Path | Storage, name: str) -> Any:
    """Entry `name` of a checkpoint read whole, in any layout (one file, or every rank's
    share or shards), without a process group."""
    storage = as_storage(checkpoint)
    return read_entry(storage, read_manifest(storage), name)


def entry_files(checkpoint: Path, names: tuple[str, ...]) -> list[str]:
    """The manifest's files of entries `names` (`model.json`, `model/rank-00000.json`, ...)."""
    files = read_manifest(LocalStorage(checkpoint)).files
    return sorted(rel for rel in files if rel.split("/")[0].split(".")[0] in names)


def assert_tensors_equal(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), f"tensors differ at {where}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_tensors_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_tensors_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_checkpoint(a: Path, b: Path) -> None:
    """Model and optimizer equal with torch.equal; every other state identical."""
    for name in ("model", "optimizer"):
        assert_tensors_equal(load_entry(a, name), load_entry(b, name), name)
    files = entry_files(a, EXACT_ENTRIES)
    assert files == entry_files(b, EXACT_ENTRIES)
    for rel in files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    for rng in sorted((a / "rng").iterdir()):
        assert rng.read_bytes() == (b / "rng" / rng.name).read_bytes(), rng.name
    sa, sb = load_state(a, "train_state"), load_state(b, "train_state")
    for key in ("global_step", "epoch", "samples_seen", "tokens_seen"):
        assert sa[key] == sb[key], key
    assert [h.get("loss") for h in sa["log_history"]] == [h.get("loss") for h in sb["log_history"]]


def assert_same_losses(a: Path, b: Path) -> None:
    ma, mb = read_metrics(a), read_metrics(b)

    def key(m: dict) -> tuple:  # a training step's record, or an evaluation's
        return (m["step"], m.get("loss"), m.get("lr"), m.get("eval_loss"))

    assert [key(m) for m in ma] == [key(m) for m in mb]


def flip_byte(p: Path) -> None:
    """Flip one bit in the middle of a file (its size stays the same)."""
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def seed_resume_dir(src: Path, dst: Path, step: int) -> None:
    """A run dir holding only `checkpoint-<step>` of src, and src's whole metrics.jsonl (so the
    resumed run must truncate it)."""
    dst.mkdir(parents=True)
    shutil.copytree(src / f"checkpoint-{step}", dst / f"checkpoint-{step}")
    shutil.copy(src / "metrics.jsonl", dst / "metrics.jsonl")


class RunsCommand:
    """Unpickling this runs `touch MARKER`, as a hostile checkpoint file would run anything."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def file_record(data: bytes, algorithm: str = "blake3") -> dict:
    """A manifest's record of a file holding `data` (format 2; hashed here, not by our code)."""
    h = blake3.blake3(data) if algorithm == "blake3" else hashlib.new(algorithm, data)
    return {"size": len(data), "hash": {"algorithm": algorithm, "digest": h.hexdigest()}}


def rewrite_manifest_entry(checkpoint: Path, path: Path) -> None:
    """Make the manifest's size and hash of `path` match its (tampered) content."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    rel = path.relative_to(checkpoint).as_posix()
    manifest["files"][rel] = file_record(path.read_bytes())
    (checkpoint / "manifest.json").write_text(json.dumps(manifest, indent=1))


class Weights:
    """A Stateful holding one tensor, as a model would."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def state_dict(self) -> dict:
        return {"w": self.t}

    def load_state_dict(self, state: dict) -> None:
        self.t = state["w"]


def memory_url() -> str:
    """A fresh place in fsspec's memory:// store (object-store semantics, one process)."""
    return f"memory://test-{uuid.uuid4().hex[:8]}/run"


_EXPORTS: dict[tuple[str, bytes], dict[str, torch.Tensor]] = {}


def exported(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The weights `python -m checkpointing export CHECKPOINT OUT` writes, run in this process:
    a subprocess per export cost 5-10 s of imports (the CLI as a process is tested in
    test_checkpoint_cli and in each engine's refusal of a corrupt file). A checkpoint exported
    before, with the same manifest, is not exported again (the references of a module)."""
    from checkpointing.cli import main

    key = (str(checkpoint.resolve()), (checkpoint / "manifest.json").read_bytes())
    if key not in _EXPORTS:
        out = checkpoint.parent / f"{checkpoint.name}-{uuid.uuid4().hex[:8]}.safetensors"
        code = main(["export", str(checkpoint), str(out)])
        assert code == 0, f"export of {checkpoint} exited {code}"
        _EXPORTS[key] = load_file(out)
    return _EXPORTS[key]
