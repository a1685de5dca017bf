"""DeepSpeed checkpoint save inside our commit vs DeepSpeed's own `save_checkpoint` alone.

Two processes (torchrun, gloo, CPU) train a TinyGPT of 8 x 768 (56.7M parameters) a few AdamW
steps under ZeRO-2; then, alternating in the same directory, DeepSpeed's bare
`save_checkpoint(save_latest=False)` (no fsync, no checksums: DeepSpeed's default) and our save
of the same engine (the same DeepSpeed call into a temp directory, then every rank fsyncs and
sha256s its share of the files, rank 0 writes the manifest and renames); a third side is the
bare save made durable (each rank fsyncs its share, no checksums). Medians of the seconds.
The DeepSpeed import and initialisation happen before any timing; the engine skips the JIT build
of DeepSpeed's shared-memory op, so no compile time is in either figure.

    python bench/deepspeed_save.py [--reps 5] [--stage 2] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.checkpoint_save import add_model_args  # noqa: E402
from bench.common import detail, figure, gloo_worker  # noqa: E402


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None)
    add_model_args(parser)
    return parser.parse_args()


def relaunch(args: argparse.Namespace) -> int:
    """Run this file under torchrun with 2 processes; rank 0 prints the JSON lines."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        str(Path(sys.executable).parent / "torchrun"),
        "--standalone",
        "--nproc-per-node=2",
        __file__,
        *sys.argv[1:],
    ]
    return subprocess.call(cmd, env=env)


def measure(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from checkpointing.manager import CheckpointManager, Entry
    from core.config import load_config
    from core.engines.deepspeed import DeepSpeedEngine
    from core.engines.deepspeed_config import resolve_deepspeed_config
    from core.models.tiny_gpt import TinyGPT
    from core.optim import parameter_groups
    from core.schedules import build_schedule

    rank = dist.get_rank()
    ds = f"{{zero_optimization: {{stage: {args.stage}}}}}"
    config = load_config(
        None,
        ["--engine.name", "deepspeed", "--engine.deepspeed_config", ds,
         "--train.per_device_batch_size", "4"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = TinyGPT(n_layer=args.n_layer, n_head=12, n_embd=args.n_embd, block_size=64, dropout=0.0)
    opt = torch.optim.AdamW(parameter_groups(model, 0.01), lr=1e-4)
    engine = DeepSpeedEngine(
        model,
        opt,
        lambda o: build_schedule(o, "cosine", 100),
        torch.device("cpu"),
        resolve_deepspeed_config(config, dist.get_world_size()),
    )
    for _ in range(2):
        x = torch.randint(0, 256, (4, 64))
        with engine.accumulate(sync=True):
            engine.backward(engine.forward({"input_ids": x, "labels": x}), 1)
        engine.optimizer_step(1.0)

    # One directory for both ranks (as a shared filesystem is for a real job): rank 0's.
    chosen = [str(args.dir or tempfile.mkdtemp(prefix="ds-save-")) if rank == 0 else None]
    dist.broadcast_object_list(chosen, src=0)
    root = Path(chosen[0])
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    manager = CheckpointManager(root / "ours", rank, dist.get_world_size(), engine="deepspeed")
    entries = {name: Entry(obj) for name, obj in engine.stateful().items()}
    shards = entries["deepspeed"].obj

    def bare(rep: int) -> Path:
        shards.save_to(root / "bare" / f"r{rep}")  # DeepSpeed's save_checkpoint, nothing else
        dist.barrier()
        return root / "bare"

    def fsynced(rep: int) -> Path:
        # The same, made durable: each rank fsyncs its share of the files (no checksums).
        shards.save_to(root / "synced" / f"r{rep}")
        dist.barrier()
        files = sorted(p for p in (root / "synced").rglob("*") if p.is_file())
        for p in files[rank :: dist.get_world_size()]:
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        dist.barrier()
        return root / "synced"

    def ours(rep: int) -> Path:
        (saved,) = manager.save(rep, entries, {}, "bench", checks={}, rank_checks={})
        return Path(saved.location)

    sides = {"bare": bare, "fsynced": fsynced, "ours": ours}
    times: dict[str, list[float]] = {name: [] for name in sides}
    size = 0
    for rep in range(args.reps):
        order = list(sides)[rep % 3 :] + list(sides)[: rep % 3]  # rotate: no side always last
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            out = sides[name](rep)
            times[name].append(time.perf_counter() - t0)
            if rank == 0:
                if name == "ours":
                    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
                shutil.rmtree(out)
                os.sync()  # no write-back of this side's pages while the next one runs
            dist.barrier()
    bare_s, synced_s, ours_s = times["bare"], times["fsynced"], times["ours"]
    if rank == 0:
        for name, times in (("bare", bare_s), ("fsynced", synced_s), ("ours", ours_s)):
            detail(f"deepspeed_save_{name}", seconds=times)
        ours, bare, synced = (statistics.median(t) for t in (ours_s, bare_s, synced_s))
        figure(
            "deepspeed_save",
            round(ours, 3),
            "s per save",
            ratio_to="DeepSpeed's save_checkpoint made durable (fsync of each rank's files)",
            ratio=round(ours / synced, 3),
            config={
                "zero_stage": args.stage,
                "world_size": dist.get_world_size(),
                "checkpoint_mb": round(size / 1e6, 1),
                "reps": args.reps,
            },
            deepspeed_fsynced_s=round(synced, 3),
            deepspeed_bare_s=round(bare, 3),
            ratio_to_bare=round(ours / bare, 3),
        )
        if args.dir is None:
            shutil.rmtree(root)


if __name__ == "__main__":
    ns = parse()
    if "RANK" not in os.environ:
        sys.exit(relaunch(ns))
    gloo_worker(lambda: measure(ns))
