"""`python -m checkpointing list DIR | verify PATH | export PATH OUT.safetensors`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from checkpointing.deepspeed_files import deepspeed_weights
from checkpointing.manager import TMP_PREFIX
from checkpointing.manifest import CheckpointError, list_checkpoints, verify
from checkpointing.serialize import load_state, write_safetensors


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def cmd_list(root: Path) -> int:
    rows = []
    for step, path in list_checkpoints(root):
        try:
            manifest = verify(path)
            status, detail = "committed", f"world {manifest.world_size}, {manifest.engine}"
            age = _age(time.time() - manifest.created)
        except CheckpointError as e:
            status = "incomplete" if "no manifest" in str(e) else "corrupt"
            detail, age = str(e), "-"
        rows.append((path.name, status, step, _size(path), age, detail))
    for tmp in sorted(root.glob(f"{TMP_PREFIX}*")):
        rows.append((tmp.name, "incomplete", -1, _size(tmp), "-", "an interrupted save"))
    if not rows:
        print(f"no checkpoints in {root}")
        return 0
    print(f"{'name':<24} {'status':<11} {'step':>8} {'size MB':>9} {'age':>7}  detail")
    for name, status, step, size, age, detail in rows:
        shown = step if step >= 0 else "-"
        print(f"{name:<24} {status:<11} {shown:>8} {size / 1e6:>9.1f} {age:>7}  {detail}")
    return 0


def cmd_verify(path: Path) -> int:
    try:
        manifest = verify(path)
    except CheckpointError as e:
        print(f"FAILED {e}", file=sys.stderr)
        return 1
    print(
        f"OK {path}: step {manifest.step}, {len(manifest.files)} files, "
        f"{manifest.total_bytes / 1e6:.1f} MB, sha256 verified"
    )
    return 0


def cmd_export(path: Path, out: Path) -> int:
    """Model weights only, every parameter and buffer under its own name (tied weights
    written under each name), for inference. A DeepSpeed checkpoint's ZeRO shards are
    consolidated into full fp32 weights first."""
    try:
        manifest = verify(path)
        if manifest.engine == "deepspeed":
            state = deepspeed_weights(path, manifest)
        else:
            state = load_state(path, "model")
    except CheckpointError as e:
        print(f"FAILED {e}", file=sys.stderr)
        return 1
    seen: set[int] = set()
    tensors = {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            continue
        # safetensors cannot alias: a second name of the same storage gets its own copy.
        ptr = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    digest = write_safetensors(out, tensors, {"format": "pt"})
    print(f"exported {len(tensors)} tensors to {out} ({digest.size / 1e6:.1f} MB)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m checkpointing")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("list", help="checkpoints in a run directory and their status")
    p.add_argument("dir", type=Path)
    p = sub.add_parser("verify", help="check every file against the manifest (exit 1 if not)")
    p.add_argument("path", type=Path)
    p = sub.add_parser(
        "export", help="model weights as one safetensors file (ZeRO shards consolidated)"
    )
    p.add_argument("path", type=Path)
    p.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "list":
        return cmd_list(args.dir)
    if args.cmd == "verify":
        return cmd_verify(args.path)
    return cmd_export(args.path, args.out)
