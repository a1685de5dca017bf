"""Resume jump on a token store: launch to first resumed step at block 10^8 against block 10.

The store is synthetic: `--blocks` blocks (100,663,296: more than 10^8) of `--seq-len` (8)
uint16 tokens of value 0, in 256 MB shards made sparse with `truncate` (1.6 GB that take no
disk), each with its .sum (every 1 MB chunk of zeros has the same BLAKE3 digest) and an
index.json as `python -m launcher prepare` writes it (bytes tokenizer). A very small model
trains on it in process with batch 1, so position = step: a callback saves at step 10, then
after step 11 moves the sampler to position `--far` (and the step counter with it), saves
checkpoint-<far> and stops. Each checkpoint is copied into a run dir of its own and
`python -m launcher --data.source STORE` resumes from it, timed from launch until it logs its
first resumed step (then killed). Both launches verify the whole store first (BLAKE3 of 1.6 GB,
its cost is in both sides: `verify_s` reports it). Repetitions interleave; medians. Figure
`store_resume_jump`: far / near (target <= 1.05).

    .venv/bin/python bench/store_resume.py [--reps 3] [--far 100000000]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import alternating, detail, figure, resume_copy  # noqa: E402
from bench.loop_overhead import child_env  # noqa: E402
from core.callbacks import TrainerCallback  # noqa: E402
from core.config import load_config  # noqa: E402
from core.data.pieces import tokenizer_identity  # noqa: E402
from core.data.prepare import CHUNK_BYTES  # noqa: E402
from core.data.store import (  # noqa: E402
    FORMAT,
    HASH,
    INDEX,
    VERSION,
    digest,
    shard_name,
    sums_name,
)
from core.loop import DistInfo  # noqa: E402
from core.run import build_trainer  # noqa: E402

NEAR = 10
FAR = 100_000_000
BLOCKS = 6 << 24  # 100,663,296 blocks: six shards of 2^24 blocks of 8 uint16 (256 MB each)
SHARD_BYTES = 256 << 20


def write_zero_store(root: Path, blocks: int, seq_len: int, shard_bytes: int) -> dict:
    """A committed token store of `blocks` zero blocks, shards sparse: its index."""
    root.mkdir(parents=True)
    block_bytes = seq_len * 2
    per = max(1, shard_bytes // block_bytes)
    chunk = min(CHUNK_BYTES, per * block_bytes)
    shards = []
    for k, first in enumerate(range(0, blocks, per)):
        n = min(per, blocks - first)
        size = n * block_bytes
        with open(root / shard_name(k), "wb") as f:
            f.truncate(size)  # a hole: reads back as zeros
        full, rest = divmod(size, chunk)
        sums = digest(bytes(chunk)) * full + (digest(bytes(rest)) if rest else b"")
        (root / sums_name(shard_name(k))).write_bytes(sums)
        shards.append(
            {"name": shard_name(k), "blocks": n, "bytes": size, "hash": digest(sums).hex()}
        )
    cfg = load_config(None, ["--data.seq_len", str(seq_len)]).data
    index = {
        "format": FORMAT,
        "version": VERSION,
        "hash": HASH,
        "seq_len": seq_len,
        "dtype": "uint16",
        "blocks_per_shard": per,
        "chunk_bytes": chunk,
        "tokenizer": tokenizer_identity(cfg, None),
        "text_field": "text",
        "blocks": blocks,
        "tokens": blocks * seq_len,
        "documents": 1,
        "shards": shards,
        "sources": [],
    }
    (root / INDEX).write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    return index


def overrides(store: Path, seq_len: int, far: int) -> list[str]:
    """The launcher flags of the checkpointing run and of every resume (same trajectory)."""
    return [
        *("--data.source", str(store), "--data.seq_len", str(seq_len)),
        *("--model.n_layer", "1", "--model.n_embd", "16", "--model.n_head", "1"),
        *("--model.block_size", str(seq_len), "--train.per_device_batch_size", "1"),
        *("--train.max_steps", str(far + 1000), "--train.logging_steps", "1000"),
        *("--train.progress_bar", "never", "--checkpoint.save_steps", "0"),
    ]


class SaveAndJump(TrainerCallback):
    """Save after step NEAR; after step NEAR + 1 move to position `far` (batch 1: step `far`),
    save and stop."""

    def __init__(self, far: int) -> None:
        self.far = far
        self.loop = None  # set once the loop exists

    def on_step_end(self, config, state, control) -> None:
        if state.global_step == NEAR:
            control.should_save = True
        elif state.global_step == NEAR + 1:
            sampler = self.loop.sampler
            sampler.advance(self.far - sampler.position)
            state.samples_seen = self.far
            state.tokens_seen = self.far * config.data.seq_len
            state.global_step = self.far
            control.should_save = True
            control.should_training_stop = True


def make_checkpoints(root: Path, store: Path, seq_len: int, far: int) -> None:
    flags = [*overrides(store, seq_len, far), "--run.output_dir", str(root / "long")]
    callback = SaveAndJump(far)
    trainer = build_trainer(
        load_config(None, flags), DistInfo(), torch.device("cpu"), callbacks=[callback]
    )
    callback.loop = trainer
    trainer.train()
    assert trainer.sampler.position == far and trainer.state.epoch == 0


def time_to_first_step(run_dir: Path, step: int, flags: list[str], env: dict) -> dict:
    """Seconds from launch to the first resumed step's metrics line; the verify time logged."""
    metrics = run_dir / "metrics.jsonl"
    cmd = [sys.executable, "-m", "launcher", *flags, "--run.output_dir", str(run_dir)]
    cmd += ["--train.logging_steps", "1"]
    log = run_dir / "stderr.log"
    t0 = time.perf_counter()
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        while True:
            if metrics.exists() and f'"step": {step + 1},' in metrics.read_text():
                seconds = time.perf_counter() - t0
                break
            if proc.poll() is not None:
                raise RuntimeError(log.read_text()[-3000:])
            time.sleep(0.002)
    finally:
        proc.kill()
        proc.wait()
    text = log.read_text()
    if f"at step {step} " not in text:
        raise RuntimeError(f"the launch did not resume at step {step}:\n{text[-3000:]}")
    verified = re.search(r"verified in ([0-9.]+) s", text)
    return {"seconds": seconds, "verify_s": float(verified.group(1)) if verified else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reps", type=int, default=3, help="launches of each side, alternating")
    p.add_argument("--far", type=int, default=FAR, help="the far position (blocks)")
    p.add_argument("--blocks", type=int, default=BLOCKS, help="blocks in the store (> far)")
    p.add_argument("--seq-len", type=int, default=8, help="tokens per block")
    p.add_argument("--shard-mb", type=float, default=SHARD_BYTES / (1 << 20), help="MiB/shard")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the launches")
    args = p.parse_args(argv)
    if args.blocks <= args.far + 1000 or args.far <= NEAR + 1:
        p.error(f"--far must exceed {NEAR + 1} and --blocks must exceed --far by over 1000")
    start = time.perf_counter()
    env = child_env(args.threads)
    with tempfile.TemporaryDirectory(prefix="store_resume_") as tmp:
        root = Path(tmp)
        store = root / "store"
        index = write_zero_store(store, args.blocks, args.seq_len, int(args.shard_mb * (1 << 20)))
        make_checkpoints(root, store, args.seq_len, args.far)
        detail("store_resume_setup_s", value=round(time.perf_counter() - start, 2))
        flags = overrides(store, args.seq_len, args.far)
        runs: dict[int, list[dict]] = {NEAR: [], args.far: []}
        for rep in range(args.reps):
            for step in alternating(rep, NEAR, args.far):
                with resume_copy(root, step, rep) as run_dir:
                    runs[step].append(time_to_first_step(run_dir, step, flags, env))
                detail("store_resume_run", step=step, rep=rep, **runs[step][-1])
    near = statistics.median(r["seconds"] for r in runs[NEAR])
    far = statistics.median(r["seconds"] for r in runs[args.far])
    verify = [r["verify_s"] for rs in runs.values() for r in rs if r["verify_s"] is not None]
    figure(
        "store_resume_jump",
        round(far, 3),
        "s launch to first resumed step",
        ratio_to=f"the same at position {NEAR}",
        ratio=round(far / near, 4),
        config={
            "measured": "python -m launcher --data.source STORE resuming a checkpoint, launch "
            "to its first resumed step's metrics line (whole store verified in both)",
            "near_position": NEAR,
            "far_position": args.far,
            "store_blocks": index["blocks"],
            "store_gb": round(index["tokens"] * 2 / 1e9, 2),
            "shards": len(index["shards"]),
            "seq_len": args.seq_len,
            "batch": 1,
            "reps": args.reps,
            "checkpoint": "saved in process; the far one after moving the sampler (and step) "
            f"from {NEAR + 1} to the far position",
        },
        near_s=round(near, 3),
        far_all=[round(r["seconds"], 3) for r in runs[args.far]],
        near_all=[round(r["seconds"], 3) for r in runs[NEAR]],
        verify_s_median=round(statistics.median(verify), 3) if verify else None,
        wall_s=round(time.perf_counter() - start, 1),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
