"""`python -m launcher prepare` throughput and memory: our token-store preparation of a JSON-lines
corpus against a plain batched Hugging Face tokenizer loop over the same documents.

The corpus is the standard library's source (bench/tokenize_throughput.py's `corpus_lines`),
`--doc-lines` (40) consecutive lines per document, one {"text": ...} per line of a .jsonl of
`--mb` MB (16); the tokenizer is that file's byte-level BPE (8000 tokens) trained on the first
`--train-mb` MB. Every run is a fresh subprocess, imports outside the timings, sides rotated
every rep, `--reps` (3):

- ours N: `core.data.prepare.prepare(DataConfig(source=<jsonl>, store=<fresh dir>,
  tokenizer="hf:<dir>", seq_len=512, num_proc=N))`, timed over the call (tokenizer load, the
  sources' BLAKE3, spawned workers tokenising 8 MB pieces, blocks written, fsynced, index).
  N = `--num-proc` (2) and N = 1.
- plain: read the jsonl, `json.loads` every line, `AutoTokenizer.from_pretrained`, then
  `tok(texts[i:i + 1000])["input_ids"]` over all documents in one process (the fast tokenizer
  spreads a batch over its own threads), timed from opening the file to the list of id lists.

Figures (tokens: the tokenizer's tokens of the corpus; `same_tokens` checks that ours stored
exactly those plus one EOS per document, cut into whole blocks):
- `prepare_throughput`: ours with N workers, tokens/s; `ratio` the median of the paired
  ours N / plain ratios; the 1-worker figure and its ratio to plain in the detail.
- `prepare_scaling`: ours with N workers, tokens/s; `ratio` the median of the paired
  t(1 worker) / t(N workers).
- `prepare_peak_rss`: peak RSS of ours N (the prepare process plus its workers, summed, sampled
  every 10 ms with psutil) on a corpus `--rss-scale` (4) times larger, `--rss-reps` (1) run,
  over the same on the 1x corpus (the `prepare_throughput` runs): target flat (~1.0). The
  processes' own peaks (getrusage, exact) are in the detail.

    .venv/bin/python bench/store_prepare.py [--mb 16] [--reps 3] [--num-proc 2] [--rss-scale 4]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import detail, figure  # noqa: E402
from bench.loop_overhead import child_env  # noqa: E402
from bench.tokenize_throughput import corpus_lines, make_tokenizer  # noqa: E402
from core.data.prepare import MAX_PIECE_BYTES  # noqa: E402

BATCH = 1000
MB = 1 << 20


def write_corpus(path: Path, mb: float, doc_lines: int) -> int:
    """A .jsonl of documents of `doc_lines` stdlib lines, about `mb` MB of text: documents."""
    lines = corpus_lines(mb)
    docs = ["\n".join(lines[i : i + doc_lines]) for i in range(0, len(lines), doc_lines)]
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    return len(docs)


# -- the two sides, each in a fresh process ---------------------------------------------------
def ours(corpus: Path, tokenizer: Path, num_proc: int, seq_len: int) -> dict:
    # Imported before the clock, as the plain side does.
    from transformers import AutoTokenizer  # noqa: F401

    from core.config import load_config
    from core.data.prepare import prepare
    from launcher.prepare import share_cores

    with tempfile.TemporaryDirectory(prefix="prepare_store_") as store:
        flags = ["--data.source", str(corpus), "--data.store", store]
        flags += ["--data.tokenizer", f"hf:{tokenizer}", "--data.num_proc", str(num_proc)]
        flags += ["--data.seq_len", str(seq_len), "--model.block_size", str(seq_len)]
        cfg = load_config(None, flags).data
        share_cores(cfg.num_proc)  # as `python -m launcher prepare` does
        t0 = time.perf_counter()
        index = prepare(cfg, progress=False)
        seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "blocks": index.blocks,
        "documents": index.raw["documents"],
        "shards": len(index.shards),
        **_own_peaks(),
    }


def plain(corpus: Path, tokenizer: Path) -> dict:
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    tok = AutoTokenizer.from_pretrained(tokenizer)
    ids: list[list[int]] = []
    for i in range(0, len(texts), BATCH):
        ids.extend(tok(texts[i : i + BATCH])["input_ids"])
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "docs": len(ids), "tokens": sum(map(len, ids)), **_own_peaks()}


def _own_peaks() -> dict:
    """Exact peak RSS (MiB) of this process and of its largest waited-for child."""
    self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"main_peak_mib": self_kb / 1024, "worker_peak_mib": children_kb / 1024}


# -- the driver -------------------------------------------------------------------------------
def run(side: str, num_proc: int, corpus: Path, tokenizer: Path, args: argparse.Namespace) -> dict:
    """One fresh process of `side`: its result, with the peak RSS of its process tree."""
    with tempfile.TemporaryDirectory(prefix=f"prepare_{side}_") as tmp:
        out = Path(tmp, "out.json")
        cmd = [sys.executable, __file__, "--worker", side, "--out", str(out)]
        cmd += ["--corpus", str(corpus), "--tokenizer", str(tokenizer)]
        cmd += ["--num-proc", str(num_proc), "--seq-len", str(args.seq_len)]
        log = Path(tmp, "stderr.log")
        with open(log, "wb") as err:
            proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(args.threads), stderr=err)
        tree_peak = _watch_rss(proc)
        if proc.wait() != 0:
            raise RuntimeError(f"{side} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        return {**json.loads(out.read_text()), "tree_peak_mib": tree_peak / MB}


def _watch_rss(proc: subprocess.Popen) -> int:
    """Peak of the summed RSS of `proc` and its descendants, sampled every 10 ms, until it
    exits."""
    peak, root = 0, psutil.Process(proc.pid)
    while proc.poll() is None:
        total = 0
        try:
            for p in [root, *root.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
        except psutil.NoSuchProcess:
            break
        peak = max(peak, total)
        time.sleep(0.01)
    return peak


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mb", type=float, default=16.0, help="corpus size (1x), MB of text")
    p.add_argument("--doc-lines", type=int, default=40, help="stdlib lines per document")
    p.add_argument("--train-mb", type=float, default=2.0, help="MB the BPE is trained on")
    p.add_argument("--vocab", type=int, default=8000, help="BPE vocabulary size")
    p.add_argument("--reps", type=int, default=3, help="runs of each side, rotated")
    p.add_argument("--num-proc", type=int, default=2, help="ours: data.num_proc")
    p.add_argument("--seq-len", type=int, default=512, help="ours: block length")
    p.add_argument("--rss-scale", type=float, default=4.0, help="the larger corpus, x --mb")
    p.add_argument("--rss-reps", type=int, default=1, help="runs of ours on the larger corpus")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every run")
    p.add_argument("--worker", choices=("ours", "plain"), help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        if args.worker == "ours":
            result = ours(args.corpus, args.tokenizer, args.num_proc, args.seq_len)
        else:
            result = plain(args.corpus, args.tokenizer)
        args.out.write_text(json.dumps(result))
        return 0

    start = time.perf_counter()
    n = args.num_proc
    sides = [("ours", n), ("ours", 1), ("plain", 1)]
    with tempfile.TemporaryDirectory(prefix="store_prepare_") as tmp:
        corpus, big = Path(tmp, "corpus.jsonl"), Path(tmp, "corpus-big.jsonl")
        docs = write_corpus(corpus, args.mb, args.doc_lines)
        write_corpus(big, args.mb * args.rss_scale, args.doc_lines)
        tokenizer = make_tokenizer(Path(tmp, "tok"), corpus_lines(args.train_mb), args.vocab)
        results: dict[tuple[str, int], list[dict]] = {side: [] for side in sides}
        for rep in range(args.reps):
            for side in sides[rep % 3 :] + sides[: rep % 3]:
                results[side].append(run(*side, corpus, tokenizer, args))
                detail("prepare_run", side=side[0], num_proc=side[1], rep=rep, **results[side][-1])
        large = []
        for rep in range(args.rss_reps):
            large.append(run("ours", n, big, tokenizer, args))
            detail(
                "prepare_run", side="ours", num_proc=n, rep=rep, scale=args.rss_scale, **large[-1]
            )
        corpus_mb, big_mb = corpus.stat().st_size / 1e6, big.stat().st_size / 1e6
    report(args, results, large, docs, corpus_mb, big_mb, time.perf_counter() - start)
    return 0


def report(args, results, large, docs, corpus_mb, big_mb, wall) -> None:
    n, seq = args.num_proc, args.seq_len
    secs = {side: [r["seconds"] for r in rs] for side, rs in results.items()}
    ours_n, ours_1, base = secs[("ours", n)], secs[("ours", 1)], secs[("plain", 1)]
    tokens = results[("plain", 1)][0]["tokens"]
    last = results[("ours", n)][-1]
    same = (
        last["documents"] == docs == results[("plain", 1)][0]["docs"]
        and last["blocks"] * seq == (tokens + docs) // seq * seq
    )
    med = statistics.median
    # prepare cuts a source into pieces of at most 8 MB (shard_bytes permitting), one worker's
    # unit of work: a corpus of fewer pieces than num_proc runs that many workers (1: in process).
    pieces = -(-int(corpus_mb * 1e6) // MAX_PIECE_BYTES)
    config = {
        "docs": docs,
        "tokens": tokens,
        "mb": round(corpus_mb, 2),
        "doc_lines": args.doc_lines,
        "vocab": args.vocab,
        "seq_len": seq,
        "num_proc": n,
        "pieces": pieces,
        "workers": min(n, pieces) if min(n, pieces) > 1 else 0,
        "plain": f"one process, tok(texts[i:i+{BATCH}]) (the tokenizer's own threads)",
        "reps": args.reps,
        "cores": psutil.cpu_count(),
    }
    figure(
        "prepare_throughput",
        round(tokens / med(ours_n), 1),
        "tokens/s",
        ratio_to=f"plain batched tokenizer(texts) loop, {BATCH} per batch, same jsonl",
        ratio=round(med(b / o for o, b in zip(ours_n, base, strict=True)), 4),
        config=config,
        plain_tokens_per_s=round(tokens / med(base), 1),
        num_proc_1_tokens_per_s=round(tokens / med(ours_1), 1),
        num_proc_1_ratio=round(med(b / o for o, b in zip(ours_1, base, strict=True)), 4),
        ours_s_all=[round(s, 3) for s in ours_n],
        num_proc_1_s_all=[round(s, 3) for s in ours_1],
        plain_s_all=[round(s, 3) for s in base],
        same_tokens=same,
        wall_s=round(wall, 1),
    )
    figure(
        "prepare_scaling",
        round(tokens / med(ours_n), 1),
        "tokens/s",
        ratio_to="the same prepare with data.num_proc 1",
        ratio=round(med(a / b for a, b in zip(ours_1, ours_n, strict=True)), 4),
        config=config,
        num_proc_1_tokens_per_s=round(tokens / med(ours_1), 1),
    )
    small = [r["tree_peak_mib"] for r in results[("ours", n)]]
    big = [r["tree_peak_mib"] for r in large]
    figure(
        "prepare_peak_rss",
        round(med(big), 1),
        "MiB peak RSS, prepare process + workers",
        ratio_to=f"the same on the 1x corpus ({corpus_mb:.1f} MB)",
        ratio=round(med(big) / med(small), 4),
        config={
            **{k: config[k] for k in ("doc_lines", "vocab", "seq_len", "num_proc")},
            "mb": round(corpus_mb, 2),
            "mb_large": round(big_mb, 2),
            "shard_bytes": 256 * MB,
            "sampled_every_s": 0.01,
            "reps_large": args.rss_reps,
        },
        small_mib_all=[round(x, 1) for x in small],
        large_mib_all=[round(x, 1) for x in big],
        main_peak_mib={"1x": _peaks(results[("ours", n)], "main"), "large": _peaks(large, "main")},
        worker_peak_mib={
            "1x": _peaks(results[("ours", n)], "worker"),
            "large": _peaks(large, "worker"),
        },
        num_proc_1_tree_mib=round(med(r["tree_peak_mib"] for r in results[("ours", 1)]), 1),
        plain_tree_mib=round(med(r["tree_peak_mib"] for r in results[("plain", 1)]), 1),
    )


def _peaks(runs: list[dict], who: str) -> float:
    return round(statistics.median(r[f"{who}_peak_mib"] for r in runs), 1)


if __name__ == "__main__":
    sys.exit(main())
