"""`python -m checkpointing list DIR | verify PATH | export PATH OUT.safetensors | export PATH
OUT_DIR --hf [--max-shard-size 5GB]`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import yaml

from checkpointing.deepspeed_files import deepspeed_weights
from checkpointing.digest import recorded
from checkpointing.encoding import StateFormatError
from checkpointing.hf_export import DEFAULT_MAX_SHARD_SIZE, HF_ENTRY, HFFiles, write_hf_model
from checkpointing.manifest import CheckpointError, list_checkpoints, verify
from checkpointing.retention import TMP_PREFIX
from checkpointing.serialize import load_state, write_safetensors
from checkpointing.sharded import read_entry
from checkpointing.storage import Storage, open_storage


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _size(storage: Storage) -> int:
    return sum(storage.size(rel) for rel in storage.files())


def cmd_list(root: Storage) -> int:
    rows = []
    for step, name in list_checkpoints(root):
        where = root.child(name)
        try:
            manifest = verify(where)
            status, detail = "committed", f"world {manifest.world_size}, {manifest.engine}"
            age = _age(time.time() - manifest.created)
        except CheckpointError as e:
            status = "incomplete" if "no manifest" in str(e) else "corrupt"
            detail, age = str(e), "-"
        rows.append((name, status, step, _size(where), age, detail))
    for name in root.listdir():
        if name.startswith(TMP_PREFIX):
            size = _size(root.child(name))
            rows.append((name, "incomplete", -1, size, "-", "an interrupted save"))
    if not rows:
        print(f"no checkpoints in {root.display()}")
        return 0
    print(f"{'name':<24} {'status':<11} {'step':>8} {'size MB':>9} {'age':>7}  detail")
    for name, status, step, size, age, detail in rows:
        shown = step if step >= 0 else "-"
        print(f"{name:<24} {status:<11} {shown:>8} {size / 1e6:>9.1f} {age:>7}  {detail}")
    return 0


def cmd_verify(where: Storage) -> int:
    try:
        manifest = verify(where)
    except CheckpointError as e:
        print(f"FAILED {e}", file=sys.stderr)
        return 1
    algorithms = ", ".join(sorted({recorded(m)[1] for m in manifest.files.values()}) or ["none"])
    print(
        f"OK {where.display()}: step {manifest.step}, {len(manifest.files)} files, "
        f"{manifest.total_bytes / 1e6:.1f} MB, {algorithms} verified"
    )
    return 0


def cmd_export(
    where: Storage, out: Path, hf: bool = False, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE
) -> int:
    """Model weights only, every parameter and buffer under its own name (tied weights
    written under each name), for inference. A DeepSpeed checkpoint's ZeRO shards are
    consolidated into full fp32 weights first. With `hf`, a Hugging Face model directory
    (config, sharded safetensors, tokenizer) that transformers loads."""
    try:
        manifest = verify(where)
        if hf and HF_ENTRY not in manifest.entries:
            raise CheckpointError(
                f"{where.display()}: holds no Hugging Face model files (the run's model.name "
                "was not hf:); export without --hf for a safetensors file of the weights"
            )
        if manifest.engine == "deepspeed":
            local = where.local_path()
            if local is None:
                raise CheckpointError(
                    f"{where.display()}: export a DeepSpeed checkpoint from a local copy"
                )
            state = deepspeed_weights(local, manifest)
        else:
            state = read_entry(where, manifest, "model")  # FSDP's pieces assembled
        if hf:
            files = HFFiles({})
            files.load_state_dict(load_state(where, HF_ENTRY, manifest.files))
            tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
            write_hf_model(out, tensors, files.files, max_shard_size)
            size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
            print(f"exported a Hugging Face model directory to {out} ({size / 1e6:.1f} MB)")
            return 0
    except (CheckpointError, StateFormatError) as e:  # a file that verifies but does not decode
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


def _shard_size(value: str) -> str | int:
    """--max-shard-size as transformers reads it (5GB, 500MB, or a number of bytes)."""
    from transformers.utils.hub import convert_file_size_to_int

    size: str | int = int(value) if value.isdigit() else value
    try:
        if convert_file_size_to_int(size) <= 0:
            raise ValueError("not positive")
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"{value!r}: a size such as 5GB or 500MB ({e})") from e
    return size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m checkpointing")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("list", help="checkpoints in a run directory and their status")
    p.add_argument("dir", help="a directory or URL (s3://bucket/run)")
    p = sub.add_parser("verify", help="check every file against the manifest (exit 1 if not)")
    p.add_argument("path", help="a checkpoint directory or URL")
    p = sub.add_parser(
        "export",
        help="model weights as one safetensors file (ZeRO shards consolidated), or with --hf "
        "a directory transformers loads",
    )
    p.add_argument("path", help="a checkpoint directory or URL")
    p.add_argument("out", type=Path, help="a .safetensors file, or with --hf a directory")
    p.add_argument(
        "--hf",
        action="store_true",
        help="write a Hugging Face model directory: config.json, model.safetensors (sharded "
        "above --max-shard-size, with its index), generation_config.json, tokenizer files",
    )
    p.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        type=_shard_size,
        help=f"with --hf: the largest weights file (default {DEFAULT_MAX_SHARD_SIZE})",
    )
    for p in sub.choices.values():
        p.add_argument(
            "--storage-options",
            default="{}",
            help="fsspec options as YAML, e.g. '{endpoint_url: http://127.0.0.1:9000}' "
            "(credentials: prefer the environment)",
        )
    args = parser.parse_args(argv)
    try:
        options = yaml.safe_load(args.storage_options) or {}
        if not isinstance(options, dict):
            raise ValueError("expected a mapping")
        where = open_storage(args.dir if args.cmd == "list" else args.path, options)
    except (yaml.YAMLError, ValueError, ImportError) as e:
        parser.error(f"--storage-options / location: {e}")
    try:
        if args.cmd == "list":
            return cmd_list(where)
        if args.cmd == "verify":
            return cmd_verify(where)
        return cmd_export(where, args.out, args.hf, args.max_shard_size)
    except OSError as e:
        print(f"FAILED {e}", file=sys.stderr)
        return 1
