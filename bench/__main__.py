"""Every benchmark in one run: `python -m bench` prints one JSON line per figure on stdout.

Each benchmark runs as a subprocess of its own (a fresh interpreter: no benchmark sees another's
heap or threads), in this order; its figure lines are checked (`bench.common.FIGURE_KEYS`) and
passed on, anything else it prints goes to stderr (and, for one that failed, its last lines
again at the end). `--smoke` runs each one a few steps on a small model, to check that the
suite works (the figures then mean nothing; a benchmark that fails is run once more, and both
attempts' last lines are shown); the test suite runs it. The exit status is 1 when a benchmark
failed or printed no figure.

    .venv/bin/python -m bench [--smoke] [--only NAME[,NAME...]] [--list]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import is_figure  # noqa: E402

# Lines of a failed benchmark repeated at the end (a traceback; pytest shows only the tail).
TAIL_LINES = 80
SMALL_MODEL = ["--n-layer", "1", "--n-embd", "96"]
# name: (script, full-run arguments, smoke arguments, figures it prints)
BENCHMARKS: dict[str, tuple[str, list[str], list[str], list[str]]] = {
    "loop_overhead": (
        "loop_overhead.py",
        ["--reps", "5", "--steps", "400"],
        ["--reps", "1", "--steps", "12", "--check", "5"],
        ["loop_overhead"],
    ),
    "loop_overhead_ddp": (
        "loop_overhead.py",
        ["--nproc", "2", "--reps", "3", "--steps", "300"],
        ["--nproc", "2", "--reps", "1", "--steps", "12", "--check", "5"],
        ["loop_overhead_ddp"],
    ),
    "loop_overhead_null": (
        "loop_overhead.py",
        ["--null", "--reps", "5", "--steps", "600"],
        ["--null", "--reps", "1", "--steps", "12", "--check", "5"],
        ["loop_overhead_null"],
    ),
    "data_path": (
        "data_path.py",
        [],
        ["--reps", "1", "--epochs", "1", "--max-bytes", "20000"],
        ["data_path"],
    ),
    "peers": (
        "peers.py",
        [],
        ["--steps", "12", "--reps", "1", "--resume-at", "5"],
        ["vs_trainer", "vs_accelerate", "resume_vs_trainer"],
    ),
    "vs_trainer_hf": (
        "peers_hf.py",
        [],
        ["--steps", "12", "--reps", "1", "--train-mb", "1", "--max-bytes", "200000"],
        ["vs_trainer_hf"],
    ),
    "tokenize_throughput": (
        "tokenize_throughput.py",
        [],
        ["--mb", "1", "--train-mb", "1", "--reps", "1"],
        ["tokenize_throughput"],
    ),
    "checkpoint_save": (
        "checkpoint_save.py",
        [],
        ["--reps", "1", *SMALL_MODEL],
        ["save_throughput", "save_peak_memory", "load_throughput"],
    ),
    "async_save": (
        "async_save.py",
        [],
        ["--reps", "1", "--window", "4", "--every", "2", *SMALL_MODEL],
        ["async_stall", "async_throughput", "async_peak_memory", "s3_upload"],
    ),
    "resume_jump": (
        "resume_jump.py",
        ["--reps", "3"],
        ["--reps", "1", "--far", "20"],
        ["resume_jump"],
    ),
    "deepspeed_save": (
        "deepspeed_save.py",
        [],
        ["--reps", "1", *SMALL_MODEL],
        ["deepspeed_save"],
    ),
    "fsdp": (
        "fsdp.py",
        [],
        [
            *("--reps", "1", "--steps", "12", "--n-layer", "1", "--n-embd", "64"),
            *("--save-layers", "1", "--save-embd", "96"),
        ],
        [
            *("fsdp_vs_ddp", "fsdp_save_bytes_per_rank"),
            *("fsdp_save_peak_memory", "fsdp_save_throughput"),
            *("save_bytes_per_rank", "ddp_save_peak_memory", "ddp_save_throughput"),
        ],
    ),
    "hash": (
        "hash.py",
        [],
        ["--mb", "32", "--reps", "1"],
        ["hash_throughput"],
    ),
    "store_read": (
        "store_read.py",
        [],
        ["--mb", "1", "--reps", "1", "--epochs", "1"],
        ["store_read"],
    ),
    "store_resume_jump": (
        "store_resume.py",
        [],
        ["--reps", "1", "--far", "20", "--blocks", "4096"],
        ["store_resume_jump"],
    ),
    "store_prepare": (
        "store_prepare.py",
        [],
        ["--mb", "0.5", "--train-mb", "0.5", "--vocab", "1000", "--reps", "1", "--rss-scale", "2"],
        ["prepare_throughput", "prepare_scaling", "prepare_peak_rss"],
    ),
}


def run(name: str, smoke: bool) -> tuple[list[str], list[str]]:
    """Run one benchmark, pass its figure lines on: (the names of the figures missing, the last
    lines it wrote besides its figures, to repeat at the end when something is missing)."""
    script, full, quick, expected = BENCHMARKS[name]
    cmd = [sys.executable, str(REPO / "bench" / script), *(quick if smoke else full)]
    t0 = time.perf_counter()
    # stderr joins stdout so that a failure's traceback can be repeated after every other output.
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen = []
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    for raw in proc.stdout:
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            line = None
        if isinstance(line, dict) and is_figure(line):
            seen.append(line["name"])
            print(json.dumps(line), flush=True)
        else:
            sys.stderr.write(raw)
            tail.append(raw.rstrip("\n"))
    code = proc.wait()
    seconds = time.perf_counter() - t0
    print(f"bench: {name} exited {code} after {seconds:.0f} s", file=sys.stderr, flush=True)
    missing = [f for f in expected if f not in seen]
    if code != 0:
        missing = [f"{f} (exit {code})" for f in missing] or [f"{name} (exit {code})"]
    return missing, list(tail) if missing else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="a few steps each, small model")
    parser.add_argument("--only", default=None, help="comma-separated benchmark names")
    parser.add_argument("--list", action="store_true", help="print the benchmark names")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(BENCHMARKS))
        return 0
    names = list(BENCHMARKS) if args.only is None else args.only.split(",")
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)}; one of {', '.join(BENCHMARKS)}")
    missing: list[str] = []
    failures: list[tuple[str, list[str]]] = []
    for name in names:
        lost, tail = run(name, args.smoke)
        if lost and args.smoke:
            # gloo on a loaded 2-core machine was seen to abort a worker at random (SIGABRT in
            # its TCP transport, a different benchmark each time): a smoke run, which checks
            # that the suite works, tries a failed benchmark once more and says so.
            failures.append((f"{name} (failed once, retried)", tail))
            print(f"bench: {name} failed; retrying it once (smoke run)", file=sys.stderr)
            lost, tail = run(name, args.smoke)
        missing += lost
        if lost:
            failures.append((name, tail))
    for name, tail in failures:
        print(f"bench: last lines of {name}:", *tail, sep="\n  ", file=sys.stderr)
    if missing:
        print(f"bench: no figure from {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
