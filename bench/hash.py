"""The checkpoint hash against sha256: GB/s over the same bytes, fed as a save feeds it.

`hash_throughput`: the hash new manifests record (`checkpointing.digest.hasher()`: BLAKE3,
`max_threads=AUTO`) over --mb MB of random bytes in --chunk-mb updates (a tensor's bytes reach
the hashing thread in such pieces while a file is written), against `hashlib.sha256` over the
same buffers, and BLAKE3 on one thread as a detail; sides alternate, medians of --reps.

    .venv/bin/python bench/hash.py [--mb 512] [--chunk-mb 16] [--reps 5]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import blake3

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import detail, figure  # noqa: E402
from checkpointing.digest import ALGORITHM, hasher  # noqa: E402


def seconds(make: Any, data: memoryview, chunk: int) -> float:
    h = make()
    t0 = time.perf_counter()
    for i in range(0, len(data), chunk):
        h.update(data[i : i + chunk])
    h.hexdigest()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mb", type=float, default=512)
    p.add_argument("--chunk-mb", type=float, default=16)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    data = memoryview(os.urandom(int(args.mb * 1e6)))
    chunk = max(1, int(args.chunk_mb * 1e6))
    sides = {"ours": hasher, "sha256": hashlib.sha256, "blake3_1_thread": blake3.blake3}
    times: dict[str, list[float]] = {k: [] for k in sides}
    for rep in range(args.reps):
        order = list(sides) if rep % 2 == 0 else list(reversed(sides))
        for side in order:
            times[side].append(seconds(sides[side], data, chunk))
            detail("hash_run", side=side, rep=rep, seconds=round(times[side][-1], 4))
    gbps = {k: len(data) / statistics.median(v) / 1e9 for k, v in times.items()}
    figure(
        "hash_throughput",
        round(gbps["ours"], 3),
        "GB/s",
        ratio_to="hashlib.sha256 over the same buffers",
        ratio=round(gbps["ours"] / gbps["sha256"], 3),
        config={
            "algorithm": ALGORITHM,
            "mb": args.mb,
            "chunk_mb": args.chunk_mb,
            "reps": args.reps,
            "cores": os.cpu_count(),
        },
        sha256_gb_per_s=round(gbps["sha256"], 3),
        blake3_one_thread_gb_per_s=round(gbps["blake3_1_thread"], 3),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
