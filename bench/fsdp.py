"""Sharded saves on 2 processes (FSDP's shards, DDP's shares), and FSDP's speed against DDP.

`fsdp_vs_ddp`: steps/s of the launcher (`torchrun --nproc-per-node 2 -m launcher`, a TinyGPT
of --n-layer x --n-embd) with engine.name fsdp against ddp, alternating fresh runs, steady-state
steps/s from metrics.jsonl (the first 10% left out); report only: on CPU with gloo FSDP pays
an all-gather per block in forward and backward that DDP does not.

The save figures come from one torchrun of 2 workers per engine (this script with --worker): a
TinyGPT trains 3 AdamW steps under the FSDP engine (then the DDP engine), then saves through
the CheckpointManager, as the launcher does:
- `fsdp_save_bytes_per_rank` / `save_bytes_per_rank` (DDP): the bytes the busiest rank wrote
  over total / world size (target <= 1.1; FSDP: each rank writes its own shards; DDP: each
  rank writes its share of the replicated model and optimizer, checkpointing.balanced);
- `fsdp_save_peak_memory` / `ddp_save_peak_memory`: the largest rank's peak RSS during the
  saves over its peak during training (target <= 1.1; no rank gathers or copies the state);
- `fsdp_save_throughput` / `ddp_save_throughput`: the ranks' bytes over the wall time of a save
  (barrier to barrier) against a plain write + fsync of the same bytes per rank, every rank
  writing at once, alternating, medians (target >= 0.9).

    python bench/fsdp.py [--reps 3] [--steps 200] [--n-layer 4] [--n-embd 256]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import alternating, detail, figure, gloo_worker  # noqa: E402
from bench.loop_overhead import child_env, run_side, steady_rates  # noqa: E402

NPROC = 2


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from checkpointing.comm import control_group
    from checkpointing.manager import CheckpointManager, Entry
    from core.config import OptimConfig
    from core.engines.ddp import DDPEngine
    from core.engines.fsdp import FSDPEngine
    from core.models.tiny_gpt import TinyGPT
    from core.optim import build_optimizer
    from core.schedules import build_schedule

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT(n_layer=args.n_layer, n_head=8, n_embd=args.n_embd, block_size=64, dropout=0)
    optim = OptimConfig(name="adamw_torch", lr=1e-4)
    cpu = torch.device("cpu")
    if args.engine == "fsdp":
        engine = FSDPEngine(
            model,
            lambda m: build_optimizer(m, optim, cpu),
            lambda o: build_schedule(o, "constant", 10, 0, 0.0, {}),
            cpu,
        )
    else:
        optimizer = build_optimizer(model, optim, cpu)
        schedule = build_schedule(optimizer, "constant", 10, 0, 0.0, {})
        engine = DDPEngine(model, optimizer, schedule, cpu)
    for _ in range(3):
        x = torch.randint(0, 256, (4, 64))
        engine.backward(engine.forward({"input_ids": x, "labels": x}), 1)
        engine.optimizer_step(1.0)
    peak_train = peak_rss_mb()
    entries = {name: Entry(obj) for name, obj in engine.stateful().items()}
    group = control_group()
    # The parent's temporary directory: the same for every rank.
    root = Path(args.dir)
    manager = CheckpointManager(root / "run", rank, world, engine=args.engine, group=group)

    def ours(step: int) -> float:
        dist.barrier(group)
        t0 = time.perf_counter()
        manager.save(step, entries, {}, "bench", checks={}, rank_checks={})
        return time.perf_counter() - t0  # a save returns once committed, on every rank

    ours(0)
    peak_save = peak_rss_mb()

    def written_by_me(p: Path) -> bool:  # rank 0 also writes the global files
        return f"rank-{rank:05d}" in p.name or (rank == 0 and "rank-" not in p.name)

    files = (root / "run" / "checkpoint-0").rglob("*")
    mine = sum(p.stat().st_size for p in files if p.is_file() and written_by_me(p))
    payload = os.urandom(mine)

    def plain(_: int) -> float:
        dist.barrier(group)
        t0 = time.perf_counter()
        with open(root / f"plain-{rank}.bin", "wb", buffering=0) as f:
            f.write(payload)
            os.fsync(f.fileno())
        dist.barrier(group)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"ours": [], "plain": []}
    for rep in range(1, args.reps + 1):
        for side in alternating(rep, "ours", "plain"):
            if rank == 0:
                os.sync()  # no side pays for the write-back the other left
            dist.barrier(group)
            times[side].append((ours if side == "ours" else plain)(rep))
        if rank == 0:
            shutil.rmtree(root / "run" / f"checkpoint-{rep}")
    per_rank = [None] * world
    dist.all_gather_object(per_rank, (mine, peak_train, peak_save, times), group=group)
    if rank == 0:
        # FSDP: fsdp_save_*; DDP: save_bytes_per_rank, ddp_save_* (its replicated state in shares).
        names = {
            k: f"{args.engine}_save_{k}" for k in ("bytes_per_rank", "peak_memory", "throughput")
        }
        if args.engine == "ddp":
            names["bytes_per_rank"] = "save_bytes_per_rank"
        sizes = [m for m, _, _, _ in per_rank]
        total = sum(sizes)
        config = {
            "params": sum(p.numel() for p in model.parameters()),
            "world_size": world,
            "bytes": total,
            "storage": "local disk",
            "engine": args.engine,
            "reps": args.reps,
        }
        figure(
            names["bytes_per_rank"],
            max(sizes),
            "bytes",
            ratio_to="total bytes / world size",
            ratio=max(sizes) / (total / world),
            config=config,
            bytes_per_rank=sizes,
        )
        ratios = [s / t for _, t, s, _ in per_rank]
        figure(
            names["peak_memory"],
            max(s for _, _, s, _ in per_rank),
            "MB peak RSS",
            ratio_to="peak RSS during training (same rank)",
            ratio=max(ratios),
            config=config,
            peak_train_mb=[t for _, t, _, _ in per_rank],
            peak_save_mb=[s for _, _, s, _ in per_rank],
        )
        # Every rank timed the same barrier-to-commit interval: the slowest rank's time counts.
        slowest = {
            k: [max(ts[k][i] for *_, ts in per_rank) for i in range(args.reps)] for k in times
        }
        ours_mb = statistics.median(total / t / 1e6 for t in slowest["ours"])
        plain_mb = statistics.median(total / t / 1e6 for t in slowest["plain"])
        detail(f"{args.engine}_save_seconds", **slowest)
        figure(
            names["throughput"],
            ours_mb,
            "MB/s",
            ratio_to="plain write + fsync of the same bytes per rank, all ranks at once",
            ratio=ours_mb / plain_mb,
            config=config,
            plain_mb_per_s=plain_mb,
        )


def vs_ddp(args: argparse.Namespace) -> None:
    model = ["--model.n_layer", str(args.n_layer), "--model.n_embd", str(args.n_embd)]
    rates: dict[str, list[float]] = {"fsdp": [], "ddp": []}
    for rep in range(args.reps):
        for engine in alternating(rep, "fsdp", "ddp"):
            _, times = run_side("ours", args.steps, 1, NPROC, [*model, "--engine.name", engine])
            rates[engine].append(steady_rates(times, 0.1)[0])
    detail("fsdp_vs_ddp_steps_per_s", **rates)
    fsdp, ddp = statistics.median(rates["fsdp"]), statistics.median(rates["ddp"])
    figure(
        "fsdp_vs_ddp",
        fsdp,
        "steps/s",
        ratio_to="ddp steps/s, same model and batches, 2 processes",
        ratio=fsdp / ddp,
        config={"n_layer": args.n_layer, "n_embd": args.n_embd, "steps": args.steps},
        ddp_steps_per_s=ddp,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--save-layers", type=int, default=8, help="the save figures' model depth")
    p.add_argument("--save-embd", type=int, default=768, help="the save figures' model width")
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", default="fsdp", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        gloo_worker(lambda: measure(args))
    vs_ddp(args)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, "--standalone", f"--nproc-per-node={NPROC}", __file__, "--worker"]
    cmd += ["--reps", str(args.reps)]
    cmd += ["--n-layer", str(args.save_layers), "--n-embd", str(args.save_embd)]
    for engine in ("fsdp", "ddp"):
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench_fsdp_") as shared:
            run = [*cmd, "--dir", shared, "--engine", engine]
            subprocess.run(run, cwd=REPO, env=child_env(1), check=True)


if __name__ == "__main__":
    main()
