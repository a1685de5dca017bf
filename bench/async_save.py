"""Async checkpoint save: what the training loop pays for a checkpoint, and S3 upload speed.

A TinyGPT of 8 x 768 (56.7M parameters) with AdamW state (683 MB checkpoint), in one process:

- async_stall: the time `save(background=True)` blocks the loop (staging copy) over the time
  of a blocking save of the same checkpoint to the same local directory; interleaved, medians.
- async_throughput: steps/s over a window of training steps with an async save every N steps
  over steps/s of the same window with no save run beside it; the order alternates between
  reps; the median of the reps' ratios.
- async_peak_memory: peak RSS in the window with async saves minus peak RSS in the window
  without, over the bytes of one staged copy (target <= 1: one copy at most).
- s3_upload: our blocking save to a loopback S3 server (moto, its own process) in MB/s over
  a plain s3fs `put_file` of a local file of the same size; interleaved, medians.

    python bench/async_save.py [--reps 3] [--window 40] [--every 20] [--skip-s3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.checkpoint_save import add_model_args, train  # noqa: E402
from bench.common import figure  # noqa: E402
from checkpointing.manager import CheckpointManager, Entry  # noqa: E402
from checkpointing.storage import open_storage  # noqa: E402
from tests.conftest import free_port  # noqa: E402


class PeakRSS:
    """Peak resident memory of this process while the block runs (sampled every 5 ms)."""

    def __enter__(self) -> PeakRSS:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        proc = psutil.Process()
        while not self._stop.is_set():
            self.peak = max(self.peak, proc.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randint(0, 256, (4, 64))
    model(x, labels=x)["loss"].backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def save(manager: CheckpointManager, step_no: int, entries: dict, background: bool) -> float:
    """Seconds the caller is blocked."""
    t0 = time.perf_counter()
    manager.save(step_no, entries, {}, "bench", checks={}, rank_checks={}, background=background)
    return time.perf_counter() - t0


def window(model, opt, manager, entries, steps: int, every: int, first: int) -> float:
    """Steps/s over `steps` training steps, an async save every `every` steps (0: none),
    at steps every/2, 3*every/2, ...: as in a long run, each save overlaps the steps after it
    (a save at the window's last step would be waited for with nothing to overlap)."""
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        step(model, opt)
        if every and i % every == every // 2:
            save(manager, first + i, entries, background=True)
    manager.wait()  # the window ends when its last save has committed
    return steps / (time.perf_counter() - t0)


def s3_figure(manager_size: int, entries: dict, reps: int, tmp: Path) -> None:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        os.environ.update(
            AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
        )
        options = {"endpoint_url": f"http://127.0.0.1:{port}", "skip_instance_cache": True}
        for _ in range(200):
            try:
                storage = open_storage("s3://bench/run", options)
                storage.fs.mkdir("bench")
                break
            except Exception:
                time.sleep(0.05)
        manager = CheckpointManager(storage)
        plain_file = tmp / "plain.bin"
        plain_file.write_bytes(os.urandom(manager_size))
        ours, plain = [], []
        for rep in range(reps):
            ours.append(manager_size / save(manager, rep, entries, background=False) / 1e6)
            storage.remove(f"checkpoint-{rep}")
            t0 = time.perf_counter()
            storage.fs.put_file(str(plain_file), "bench/plain.bin")
            plain.append(manager_size / (time.perf_counter() - t0) / 1e6)
            storage.fs.rm("bench/plain.bin")
        ratio = statistics.median(ours) / statistics.median(plain)
        figure(
            "s3_upload",
            statistics.median(ours),
            "MB/s",
            config={"bytes": manager_size, "reps": reps, "server": "moto (loopback)"},
            ratio_to="s3fs put_file of the same bytes",
            ratio=ratio,
            ours=ours,
            plain=plain,
        )
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--window", type=int, default=40)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--skip-s3", action="store_true")
    add_model_args(parser)
    args = parser.parse_args()
    model, opt = train(3, args.n_layer, args.n_embd)
    entries = {"model": Entry(model), "optimizer": Entry(opt)}
    config = {"params": sum(p.numel() for p in model.parameters()), "reps": args.reps}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp_name:
        tmp = Path(tmp_name)
        manager = CheckpointManager(tmp / "run", save_total_limit=1, async_save=True)
        with PeakRSS() as rss:  # training alone, before any staging buffer exists
            window(model, opt, manager, entries, args.window, 0, 0)
        peak_train = rss.peak
        save(manager, 0, entries, background=True)  # allocates the staging buffers once
        manager.wait()
        size = sum(p.stat().st_size for p in (tmp / "run" / "checkpoint-0").rglob("*"))
        stall, sync = [], []
        for rep in range(1, args.reps + 1):
            stall.append(save(manager, 2 * rep, entries, background=True))
            manager.wait()
            sync.append(save(manager, 2 * rep + 1, entries, background=False))
        figure(
            "async_stall",
            statistics.median(stall),
            "s",
            config={**config, "bytes": size, "storage": "local disk"},
            ratio_to="blocking save of the same checkpoint",
            ratio=statistics.median(stall) / statistics.median(sync),
            stall=stall,
            sync=sync,
        )
        plain, saving, peak_async = [], [], 0
        step_no = 1000
        for rep in range(args.reps):
            for name in ("plain", "async") if rep % 2 == 0 else ("async", "plain"):
                with PeakRSS() as rss:
                    every = args.every if name == "async" else 0
                    speed = window(model, opt, manager, entries, args.window, every, step_no)
                if name == "async":
                    peak_async = max(peak_async, rss.peak)
                (saving if name == "async" else plain).append(speed)
                step_no += args.window
        # Each rep's two windows run back to back, so their ratio shares the machine's state;
        # this machine's speed drifts by a third within minutes (other tenants), which a ratio
        # of medians over windows minutes apart takes for a cost of saving.
        pairs = [a / p for a, p in zip(saving, plain, strict=True)]
        figure(
            "async_throughput",
            statistics.median(saving),
            "steps/s",
            config={**config, "window_steps": args.window, "save_every": args.every},
            ratio_to="the same window without saves, run beside it (median of the reps' ratios)",
            ratio=statistics.median(pairs),
            pair_ratios=pairs,
            ratio_of_medians=statistics.median(saving) / statistics.median(plain),
            with_saves=saving,
            without=plain,
        )
        staged = manager._staging.nbytes
        figure(
            "async_peak_memory",
            (peak_async - peak_train) / 1e6,
            "MB over training peak",
            config={**config, "staged_mb": staged / 1e6},
            ratio_to="one staged copy of the state",
            ratio=(peak_async - peak_train) / staged,
            peak_train_mb=peak_train / 1e6,
            peak_async_mb=peak_async / 1e6,
        )
        if not args.skip_s3:
            shutil.rmtree(tmp / "run")
            s3_figure(size, entries, args.reps, tmp)


if __name__ == "__main__":
    main()
