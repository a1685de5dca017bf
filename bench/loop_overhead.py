"""Loop overhead: steps/s of `python -m launcher` against a hand-written PyTorch loop.

Both sides train the same config (same samples in the same batches, the same TinyGPT init after
the same seeding, AdamW over the same parameter groups, the same cosine LambdaLR, clipping) in a
fresh subprocess of their own, with a loss sync every step (the launcher logs every step). A
step's time is the wall time between consecutive syncs, summed over the steps after warm-up.
Runs alternate ours, raw, ours, raw, ...; the figures are medians. One JSON line per figure.

With `--nproc 2` both sides run under `torchrun --standalone`: the launcher against a raw DDP
loop (gloo, each rank its interleaved share of the same permutation, the logged loss averaged
over ranks with one all-reduce, as the launcher logs it).

With `--null` both sides train a TinyGPT of 1 layer x 8 on sequences of 8, batch 1, a step that
costs almost nothing: `loop_overhead_null` is the launcher's median step time minus the raw
loop's (alternating fresh runs, the difference per pair of runs, median), the host work per step
that a GPU would sit idle through.

    .venv/bin/python bench/loop_overhead.py [--steps N] [--reps R] [--threads T] [--nproc P]
    .venv/bin/python bench/loop_overhead.py --null [--steps N] [--reps R]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import detail, figure  # noqa: E402

CONFIG = "configs/tiny.yaml"


def raw_loop(config_path: str, steps: int, out: Path) -> None:
    """The loop as one writes it by hand; writes {"losses", "step_time_s"} to `out` as JSON."""
    sys.path.insert(0, str(ROOT))
    import random

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    from core.config import load_config
    from core.data import build_dataset, collate
    from core.models.tiny_gpt import TinyGPT

    cfg = load_config(config_path)
    what = (
        cfg.optim.name,
        cfg.scheduler.name,
        cfg.model.name,
        cfg.train.gradient_accumulation_steps,
    )
    if what != ("adamw_torch", "cosine", "tiny-gpt", 1) or cfg.train.bf16:
        raise SystemExit(
            f"the raw loop implements adamw_torch, cosine, tiny-gpt, fp32 only: {what}"
        )
    seed, bs, m = cfg.run.seed, cfg.train.per_device_batch_size, cfg.model
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    dataset = build_dataset(cfg.data)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    order = order[: len(order) // (bs * world) * (bs * world)][rank::world]  # this rank's share
    # A generator of its own, so iter(loader) does not draw from the global RNG (dropout's).
    loader = DataLoader(
        dataset,
        batch_size=bs,
        sampler=order,
        collate_fn=collate,
        drop_last=True,
        generator=torch.Generator(),
    )
    # The device the launcher picks (engine.device auto): a CUDA GPU when there is one.
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    model = TinyGPT(m.n_layer, m.n_head, m.n_embd, m.block_size, m.dropout, m.bias).to(device)
    params = list(model.parameters())
    ids = [device.index] if device.type == "cuda" else None
    net = DistributedDataParallel(model, device_ids=ids) if world > 1 else model
    o = cfg.optim
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
    )
    sc = cfg.scheduler
    warmup, cycles = sc.warmup_steps or math.ceil(steps * sc.warmup_ratio), 0.5

    def lr_lambda(step: int) -> float:
        if step < warmup:
            return float(step) / float(max(1, warmup))
        progress = float(step - warmup) / float(max(1, steps - warmup))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(cycles) * 2.0 * progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    model.train()
    losses, times = [], []
    last = time.perf_counter()
    for step, batch in enumerate(loader, start=1):
        loss = net(**{k: v.to(device, non_blocking=True) for k, v in batch.items()})["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if world > 1:
            total = loss.detach().to(torch.float64).reshape(1)
            dist.all_reduce(total)
            losses.append(total.item() / world)
        else:
            losses.append(loss.item())
        now = time.perf_counter()
        times.append(now - last)
        last = now
        if step == steps:
            break
    if rank == 0:
        out.write_text(json.dumps({"losses": losses, "step_time_s": times}))
    if world > 1:
        from launcher.dist import destroy_distributed

        del net, loss  # the DDP wrapper holds the group
        destroy_distributed(clean=True)


def child_env(threads: int) -> dict[str, str]:
    """This environment for a benchmark subprocess: no torchrun variables, `threads` OpenMP
    threads."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_side(
    side: str,
    steps: int,
    threads: int,
    nproc: int = 1,
    extra: Sequence[str] = (),
    config: str = CONFIG,
) -> tuple[list[float], list[float]]:
    """One fresh process (group) of `side` ("ours" or "raw"): (loss per step, seconds per step).

    `extra`: more launcher flags for ours (`--section.key value`, after the config's)."""
    python = [sys.executable]
    if nproc > 1:
        torchrun = str(Path(sys.executable).parent / "torchrun")
        python = [torchrun, "--standalone", f"--nproc-per-node={nproc}"]
    with tempfile.TemporaryDirectory(prefix=f"loop_overhead_{side}_") as tmp:
        if side == "ours":
            cmd = [*python, "-m", "launcher", "--config", config]
            cmd += ["--train.max_steps", str(steps), "--train.logging_steps", "1"]
            cmd += ["--train.progress_bar", "never"]
            cmd += ["--run.output_dir", str(Path(tmp, "run")), *extra]
            out = Path(tmp, "run", "metrics.jsonl")
        else:
            out = Path(tmp, "raw.json")
            cmd = [*python, __file__, "--raw", "--steps", str(steps), "--out", str(out)]
            cmd += ["--config", config]
        proc = subprocess.run(cmd, cwd=ROOT, env=child_env(threads), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{side} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        if side == "raw":
            data = json.loads(out.read_text())
            return data["losses"], data["step_time_s"]
        records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        records = [r for r in records if "loss" in r]  # not the closing summary line
        if [r["step"] for r in records] != list(range(1, steps + 1)):
            raise RuntimeError("ours: metrics.jsonl does not hold one record per step")
        return [r["loss"] for r in records], [r["step_time_s"] for r in records]


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def steady_rates(step_times: list[float], warmup_frac: float) -> tuple[float, float]:
    """(steps/s, 1 / median step time) over the steps after the first `warmup_frac` of them.

    The first is the figure; the second ignores bursts of host noise within a run."""
    kept = step_times[math.ceil(len(step_times) * warmup_frac) :]
    return len(kept) / sum(kept), 1.0 / statistics.median(kept)


# A step that costs almost nothing on any device: what is left is host work per step.
NULL_MODEL = [
    *("--model.n_layer", "1", "--model.n_head", "1", "--model.n_embd", "8"),
    *("--model.block_size", "8", "--data.seq_len", "8", "--train.per_device_batch_size", "1"),
]


def null_overhead(args: argparse.Namespace) -> int:
    """`loop_overhead_null`: median step time of the launcher minus the raw loop's, in ms, on
    NULL_MODEL (both sides read the same derived config file)."""
    import yaml

    sys.path.insert(0, str(ROOT))
    from core.config import load_config

    cfg = load_config(str(ROOT / CONFIG), NULL_MODEL).to_dict()
    step_ms: dict[str, list[float]] = {"ours": [], "raw": []}
    first: dict[str, list[float]] = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="loop_overhead_null_") as tmp:
        config = str(Path(tmp, "null.yaml"))
        Path(config).write_text(yaml.safe_dump(cfg, sort_keys=False))
        for rep in range(args.reps):
            for side in ("ours", "raw") if rep % 2 == 0 else ("raw", "ours"):
                losses, times = run_side(side, args.steps, args.threads, 1, config=config)
                first.setdefault(side, losses)
                kept = times[math.ceil(len(times) * args.warmup) :]
                step_ms[side].append(statistics.median(kept) * 1e3)
                detail("loop_overhead_null_run", side=side, rep=rep, step_ms=step_ms[side][-1])
    diffs = [a - b for a, b in zip(step_ms["ours"], step_ms["raw"], strict=True)]
    k = min(args.check, args.steps)
    same = first["ours"][:k] == first["raw"][:k]
    figure(
        "loop_overhead_null",
        round(statistics.median(diffs), 4),
        "ms of host time per step over the raw loop",
        ratio_to="the raw loop's median step time",
        ratio=round(statistics.median(step_ms["ours"]) / statistics.median(step_ms["raw"]), 4),
        config={
            "model": "tiny-gpt 1 x 8, seq_len 8, batch 1 (configs/tiny.yaml otherwise)",
            "reps": args.reps,
            "steps": args.steps,
            "threads": args.threads,
        },
        ours_step_ms=round(statistics.median(step_ms["ours"]), 4),
        raw_step_ms=round(statistics.median(step_ms["raw"]), 4),
        per_rep_ms=[round(d, 4) for d in diffs],
        signed=True,  # a difference: below zero when the launcher is the faster
        same_losses_first_steps=same,
        wall_s=round(time.perf_counter() - start, 1),
    )
    return 0 if same or torch_cuda() else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=600, help="optimizer steps per run")
    p.add_argument("--reps", type=int, default=5, help="runs of each side, interleaved")
    p.add_argument("--warmup", type=float, default=0.1, help="fraction of steps left out")
    p.add_argument("--check", type=int, default=10, help="leading losses compared bit for bit")
    # One thread by default: on a shared 2-vCPU VM, two OpenMP threads were seen to make a whole
    # run ~70x slower at random (a descheduled vCPU stalls every barrier); --threads 2 to compare.
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for both sides")
    p.add_argument("--nproc", type=int, default=1, help="processes per side (torchrun if > 1)")
    p.add_argument(
        "--null",
        action="store_true",
        help="a model whose step is almost free (figure loop_overhead_null: host ms per step)",
    )
    p.add_argument("--config", default=CONFIG, help=argparse.SUPPRESS)
    p.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.raw:
        from launcher.dist import exit_worker  # before the loop creates its group (see there)

        raw_loop(args.config, args.steps, args.out)
        exit_worker(0)
    if args.null:
        return null_overhead(args)

    rates: dict[str, list[float]] = {"ours": [], "raw": []}
    typical: dict[str, list[float]] = {"ours": [], "raw": []}
    first: dict[str, list[float]] = {}
    start = time.perf_counter()
    for rep in range(args.reps):
        for side in ("ours", "raw"):
            losses, step_times = run_side(
                side, args.steps, args.threads, args.nproc, config=args.config
            )
            first.setdefault(side, losses)
            rate, median_rate = steady_rates(step_times, args.warmup)
            rates[side].append(rate)
            typical[side].append(median_rate)
            detail(
                "loop_overhead_run",
                nproc=args.nproc,
                side=side,
                rep=rep,
                steps_per_s=round(rate, 3),
                median_step_steps_per_s=round(median_rate, 3),
            )
    k = min(args.check, args.steps)
    same = first["ours"][:k] == first["raw"][:k]

    def paired(by_side: dict[str, list[float]]) -> float:
        ratios = [a / b for a, b in zip(by_side["ours"], by_side["raw"], strict=True)]
        return round(statistics.median(ratios), 4)

    ours, raw = statistics.median(rates["ours"]), statistics.median(rates["raw"])
    ddp = args.nproc > 1
    figure(
        "loop_overhead_ddp" if ddp else "loop_overhead",
        round(ours, 3),
        "steps/s",
        ratio_to=f"raw {'DDP ' if ddp else ''}PyTorch loop, same math",
        ratio=paired(rates),
        config={
            "nproc": args.nproc,
            "model": "tiny-gpt (configs/tiny.yaml)",
            "reps": args.reps,
            "steps": args.steps,
            "threads": args.threads,
        },
        raw_steps_per_s=round(raw, 3),
        ratio_of_medians=round(ours / raw, 4),
        ratio_median_step=paired(typical),
        same_losses_first_steps=same,
        compared_steps=k,
        all_steps_equal=first["ours"] == first["raw"],
        wall_s=round(time.perf_counter() - start, 1),
    )
    # Bit-equal losses are expected on CPU; CUDA kernels may reduce in another order.
    return 0 if same or torch_cuda() else 1


if __name__ == "__main__":
    sys.exit(main())
