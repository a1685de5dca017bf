"""Reading a local token store: our loader path against a plain memmap loop over the same ids.

The store is made by `core.data.prepare.prepare` (bytes tokenizer, seq_len `--seq-len` 512,
uint16, shards of `--shard-mb` MiB: 256, the default, so one shard) from `--mb` MB (34) of
the standard library's source (bench/tokenize_throughput.py's corpus): about 68 MB of blocks.

- ours: `core.data.loader.make_dataloader(TokenStore(store), BijectiveSampler(...), collate,
  num_workers=0)` at batch `--batch` (32), iterated over whole epochs (a new loader per epoch,
  as the training loop makes one): the sampler's Feistel order, the store's `__getitems__`
  (one fancy index per shard into its memmap) and `collate` (int64 `input_ids` plus `labels`).
- raw: `numpy.memmap` of the same shard(s), the same ids (the sampler's order, computed before
  the clock) in batches of `--batch`, `torch.from_numpy(mm[ids].astype(np.int64))`.
- raw+labels (detail only): the same plus `labels = input_ids.clone()`, as collate returns.

One process, page cache warm (one untimed epoch of each side first), `--reps` (5) of
`--epochs` (2) epochs each, sides alternating. Figure `store_read`: our samples/s, `ratio` the
median of the paired ours / raw ratios (target >= 0.95). `same_batches`: the first batches of
both sides are equal.

    .venv/bin/python bench/store_read.py [--mb 34] [--reps 5] [--epochs 2] [--batch 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import detail, figure  # noqa: E402
from bench.tokenize_throughput import corpus_lines  # noqa: E402
from core.config import load_config  # noqa: E402
from core.data.collate import collate  # noqa: E402
from core.data.loader import make_dataloader  # noqa: E402
from core.data.prepare import prepare  # noqa: E402
from core.data.sampler import BijectiveSampler  # noqa: E402
from core.data.store_reader import TokenStore  # noqa: E402

SEED = 42


def make_store(tmp: Path, mb: float, seq_len: int, shard_mb: float) -> Path:
    corpus = tmp / "corpus.txt"
    corpus.write_text("\n".join(corpus_lines(mb)) + "\n", encoding="utf-8")
    flags = ["--data.source", str(corpus), "--data.store", str(tmp / "store")]
    flags += ["--data.tokenizer", "bytes", "--data.seq_len", str(seq_len)]
    flags += ["--model.block_size", str(seq_len)]
    flags += ["--data.shard_bytes", str(int(shard_mb * (1 << 20))), "--data.num_proc", "2"]
    prepare(load_config(None, flags).data, progress=False)
    return tmp / "store"


def sampler_for(store: TokenStore, batch: int) -> BijectiveSampler:
    return BijectiveSampler(len(store), 1, 0, batch, SEED)


def ours(store: TokenStore, batch: int, epochs: int) -> tuple[int, float]:
    sampler = sampler_for(store, batch)
    samples, t0 = 0, time.perf_counter()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        loader = make_dataloader(store, sampler, collate, 0, True, SEED, 0)
        for b in loader:
            samples += b["input_ids"].shape[0]
    return samples, time.perf_counter() - t0


class Raw:
    """The plain loop: memmaps of the shards and the epochs' ids, made before the clock."""

    def __init__(self, store: TokenStore, batch: int, epochs: int) -> None:
        ix, root = store.index, Path(store.url)
        self.per = ix.blocks_per_shard
        dtype = np.dtype(ix.dtype).newbyteorder("<")
        self.maps = [
            np.memmap(root / s.name, dtype=dtype, mode="r", shape=(s.blocks, ix.seq_len))
            for s in ix.shards
        ]
        sampler = sampler_for(store, batch)
        self.epochs = []
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            order = np.asarray(sampler.epoch_order()[0 : sampler.total_size])
            self.epochs.append(order.reshape(-1, batch))

    def rows(self, ids: np.ndarray) -> np.ndarray:
        if len(self.maps) == 1:
            return self.maps[0][ids]
        shard = ids // self.per
        out = np.empty((len(ids), self.maps[0].shape[1]), dtype=self.maps[0].dtype)
        for k in np.unique(shard):
            mask = shard == k
            out[mask] = self.maps[k][ids[mask] - k * self.per]
        return out

    def run(self, labels: bool) -> tuple[int, float]:
        samples, t0 = 0, time.perf_counter()
        for batches in self.epochs:
            for ids in batches:
                x = torch.from_numpy(self.rows(ids).astype(np.int64))
                out = {"input_ids": x, "labels": x.clone()} if labels else {"input_ids": x}
                samples += out["input_ids"].shape[0]
        return samples, time.perf_counter() - t0


def same_batches(store: TokenStore, raw: Raw, batch: int, count: int = 3) -> bool:
    """Whether both sides' first `count` batches of epoch 0 are equal."""
    loader = make_dataloader(store, sampler_for(store, batch), collate, 0, True, SEED, 0)
    for ids, b in zip(raw.epochs[0][:count], loader, strict=False):
        if not torch.equal(b["input_ids"], torch.from_numpy(raw.rows(ids).astype(np.int64))):
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mb", type=float, default=34.0, help="MB of text (bytes: 2 B/token stored)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--shard-mb", type=float, default=256.0, help="MiB per store shard")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--epochs", type=int, default=2, help="epochs per rep")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="store_read_") as tmp:
        store = TokenStore(str(make_store(Path(tmp), args.mb, args.seq_len, args.shard_mb)))
        raw = Raw(store, args.batch, args.epochs)
        detail("store_read_setup_s", value=round(time.perf_counter() - start, 2))
        same = same_batches(store, raw, args.batch)
        ours(store, args.batch, 1)  # warm: page cache, memmaps, first-call costs
        raw.run(labels=True)
        rates: dict[str, list[float]] = {"ours": [], "raw": [], "raw+labels": []}
        for rep in range(args.reps):
            names = ["ours", "raw", "raw+labels"]
            for name in names[rep % 3 :] + names[: rep % 3]:
                if name == "ours":
                    n, s = ours(store, args.batch, args.epochs)
                else:
                    n, s = raw.run(labels=name == "raw+labels")
                rates[name].append(n / s)
                detail("store_read_run", side=name, rep=rep, samples=n, seconds=round(s, 4))
        index = store.index
    med = statistics.median
    paired = [o / r for o, r in zip(rates["ours"], rates["raw"], strict=True)]
    paired_labels = [o / r for o, r in zip(rates["ours"], rates["raw+labels"], strict=True)]
    figure(
        "store_read",
        round(med(rates["ours"]), 1),
        "samples/s",
        ratio_to="numpy.memmap of the shard(s), same ids, fancy index + astype(int64) + "
        "torch.from_numpy",
        ratio=round(med(paired), 4),
        config={
            "blocks": index.blocks,
            "store_mb": round(index.blocks * index.block_bytes / 1e6, 1),
            "shards": len(index.shards),
            "seq_len": index.seq_len,
            "dtype": index.dtype,
            "batch": args.batch,
            "num_workers": 0,
            "epochs_per_rep": args.epochs,
            "reps": args.reps,
        },
        raw_samples_per_s=round(med(rates["raw"]), 1),
        raw_labels_samples_per_s=round(med(rates["raw+labels"]), 1),
        ratio_to_raw_with_labels=round(med(paired_labels), 4),
        ratio_of_medians=round(med(rates["ours"]) / med(rates["raw"]), 4),
        ours_us_per_batch=round(1e6 * args.batch / med(rates["ours"]), 1),
        raw_us_per_batch=round(1e6 * args.batch / med(rates["raw"]), 1),
        ours_all=[round(x, 1) for x in rates["ours"]],
        raw_all=[round(x, 1) for x in rates["raw"]],
        same_batches=same,
        wall_s=round(time.perf_counter() - start, 1),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
