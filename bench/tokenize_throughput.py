"""Tokenisation throughput: our data preparation of a text corpus against a plain batched
Hugging Face tokenizer loop over the same lines, with the same number of processes.

The corpus is the Python standard library's own source (`*.py` under sysconfig's stdlib path,
site-packages left out, files in sorted order, cycled when more is asked for than there is),
one non-blank line per record in a .txt file, `--mb` MB; the tokenizer is a byte-level BPE
trained here with `tokenizers` on the corpus's first `--train-mb` MB (nothing downloads) and
saved with `save_pretrained`.

- ours: `core.data.build_dataset(DataConfig(source=<txt>, tokenizer="hf:<dir>",
  packing=True, num_proc=N))` with datasets' cache in a fresh temp dir (it really tokenises:
  never a cache hit). Timed over the whole call, as a user waits for it: loading the
  tokenizer, reading the file into Arrow, the batched map over N processes (the EOS after
  every line, Arrow writes), packing into seq_len blocks and the content fingerprint.
- theirs: read the file's lines, `AutoTokenizer.from_pretrained` (fast), then
  `tok(texts[i:i + 1000])["input_ids"]` over all lines, spread over a `multiprocessing.Pool`
  of N processes when N > 1. Timed from reading the file to the list of id lists.

Each run is a fresh subprocess (imports outside the timings), alternating ours / theirs
(swapped every rep), `--reps` times. Figure `tokenize_throughput`: our tokens/s (the
tokenizer's output tokens of the corpus over our seconds), `ratio` the median of the paired
ours / theirs ratios (target >= 0.9). `same_tokens` checks that ours packed exactly the
tokens theirs produced plus one EOS per line.

    .venv/bin/python bench/tokenize_throughput.py [--mb 40] [--reps 3] [--num-proc 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import detail, figure  # noqa: E402
from bench.loop_overhead import child_env  # noqa: E402

SPECIALS = ["<s>", "</s>", "<pad>"]
BATCH = 1000


def corpus_lines(mb: float) -> list[str]:
    """Non-blank lines of the stdlib's *.py files (sorted, cycled), about `mb` MB of UTF-8."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        (p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    want, total, lines = int(mb * 1e6), 0, []
    while total < want:
        for path in paths:
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            # splitlines() splits at every line boundary datasets' text reader knows, so each
            # line written below reads back as exactly one record on both sides.
            for line in text.splitlines():
                if line.strip():
                    lines.append(line)
                    total += len(line.encode()) + 1
                    if total >= want:
                        return lines
    return lines


def make_tokenizer(out: Path, lines: list[str], vocab: int = 8000) -> Path:
    """A byte-level BPE trained on `lines`, saved as a transformers fast tokenizer in `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(out)
    return out


def ours(corpus: Path, tokenizer: Path, num_proc: int, seq_len: int) -> dict:
    import datasets

    # Imported before the clock, as theirs does: load_tokenizer's lazy import costs ~1.3 s.
    from transformers import AutoTokenizer  # noqa: F401

    from core.config import DataConfig
    from core.data import build_dataset

    cfg = DataConfig(
        source=str(corpus),
        tokenizer=f"hf:{tokenizer}",
        seq_len=seq_len,
        packing=True,
        num_proc=num_proc,
    )
    with tempfile.TemporaryDirectory(prefix="tokenize_cache_") as cache:
        datasets.config.HF_DATASETS_CACHE = Path(cache)
        t0 = time.perf_counter()
        ds = build_dataset(cfg)
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "samples": len(ds)}


_TOK = None  # theirs: the tokenizer the Pool's forked workers inherit


def _encode(texts: list[str]) -> list[list[int]]:
    return _TOK(texts)["input_ids"]


def theirs(corpus: Path, tokenizer: Path, num_proc: int) -> dict:
    global _TOK
    from multiprocessing import Pool

    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    with open(corpus, encoding="utf-8") as f:
        texts = f.read().splitlines()
    _TOK = AutoTokenizer.from_pretrained(tokenizer)
    batches = [texts[i : i + BATCH] for i in range(0, len(texts), BATCH)]
    if num_proc > 1:
        with Pool(num_proc) as pool:
            parts = pool.map(_encode, batches)
    else:
        parts = [_encode(batch) for batch in batches]
    ids = [row for part in parts for row in part]
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "docs": len(ids), "tokens": sum(map(len, ids))}


def run(side: str, corpus: Path, tokenizer: Path, args: argparse.Namespace) -> dict:
    """One fresh process of `side`: its JSON result."""
    with tempfile.TemporaryDirectory(prefix=f"tokenize_{side}_") as tmp:
        out = Path(tmp, "out.json")
        cmd = [sys.executable, __file__, "--worker", side, "--out", str(out)]
        cmd += ["--corpus", str(corpus), "--tokenizer", str(tokenizer)]
        cmd += ["--num-proc", str(args.num_proc), "--seq-len", str(args.seq_len)]
        env = child_env(args.threads)
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{side} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mb", type=float, default=40.0, help="corpus size, MB of text")
    p.add_argument("--train-mb", type=float, default=5.0, help="MB the BPE is trained on")
    p.add_argument("--vocab", type=int, default=8000, help="BPE vocabulary size")
    p.add_argument("--reps", type=int, default=3, help="runs of each side, alternating")
    p.add_argument("--num-proc", type=int, default=2, help="tokenising processes, both sides")
    p.add_argument("--seq-len", type=int, default=512, help="ours: packed block length")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for both sides")
    p.add_argument("--worker", choices=("ours", "theirs"), help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        if args.worker == "ours":
            result = ours(args.corpus, args.tokenizer, args.num_proc, args.seq_len)
        else:
            result = theirs(args.corpus, args.tokenizer, args.num_proc)
        args.out.write_text(json.dumps(result))
        return 0

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tokenize_bench_") as tmp:
        lines = corpus_lines(args.mb)
        corpus = Path(tmp, "corpus.txt")
        corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
        train = corpus_lines(min(args.train_mb, args.mb))
        tokenizer = make_tokenizer(Path(tmp, "tokenizer"), train, args.vocab)
        seconds: dict[str, list[float]] = {"ours": [], "theirs": []}
        results: dict[str, dict] = {}
        for rep in range(args.reps):
            for side in ("ours", "theirs") if rep % 2 == 0 else ("theirs", "ours"):
                results[side] = run(side, corpus, tokenizer, args)
                seconds[side].append(results[side]["seconds"])
                detail("tokenize_run", side=side, rep=rep, seconds=round(seconds[side][-1], 3))
    docs, tokens = results["theirs"]["docs"], results["theirs"]["tokens"]
    packed = results["ours"]["samples"] * args.seq_len
    # Ours appends one EOS per line (the tokenizer adds none) and drops the last partial block.
    same = docs == len(lines) and packed == (tokens + docs) // args.seq_len * args.seq_len
    ratios = [t / o for o, t in zip(seconds["ours"], seconds["theirs"], strict=True)]
    ours_s, theirs_s = statistics.median(seconds["ours"]), statistics.median(seconds["theirs"])
    figure(
        "tokenize_throughput",
        round(tokens / ours_s, 1),
        "tokens/s",
        ratio_to=f"batched tokenizer(texts) loop, Pool of {args.num_proc}, same lines",
        ratio=round(statistics.median(ratios), 4),
        config={
            "docs": docs,
            "tokens": tokens,
            "mb": round(corpus_bytes(lines) / 1e6, 2),
            "num_proc": args.num_proc,
            "seq_len": args.seq_len,
            "vocab": args.vocab,
            "batch": BATCH,
            "reps": args.reps,
            "threads": args.threads,
        },
        theirs_tokens_per_s=round(tokens / theirs_s, 1),
        ours_docs_per_s=round(docs / ours_s, 1),
        theirs_docs_per_s=round(docs / theirs_s, 1),
        ratio_of_medians=round(theirs_s / ours_s, 4),
        ours_s_all=[round(s, 3) for s in seconds["ours"]],
        theirs_s_all=[round(s, 3) for s in seconds["theirs"]],
        tokens_packed=packed,
        same_tokens=same,
        wall_s=round(time.perf_counter() - start, 1),
    )
    return 0


def corpus_bytes(lines: list[str]) -> int:
    return sum(len(line.encode()) + 1 for line in lines)


if __name__ == "__main__":
    sys.exit(main())
