"""Every benchmark in one run: `python -m bench` prints one JSON line per figure on stdout.

Each benchmark runs as a subprocess of its own (a fresh interpreter: no benchmark sees another's
heap or threads), in this order; its figure lines are checked (`bench.common.FIGURE_KEYS`) and
passed on, anything else it prints goes to stderr (and, for one that failed, its last lines
again at the end). `--smoke` runs each one a few steps on a small model, to check that the
suite works (the figures then mean nothing; a benchmark that fails is run once more, and both
attempts' last lines are shown); the test suite runs it. The exit status is 1 when a benchmark
failed or printed no figure. `--save` also writes the figure lines to
`bench/results/<UTC date>-<short commit>.jsonl`, after a header line saying where and what was
measured; `python -m bench.report` makes the README's table from the newest such file.

    .venv/bin/python -m bench [--smoke] [--only NAME[,NAME...]] [--list] [--save]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import is_figure  # noqa: E402

RESULTS = REPO / "bench" / "results"
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


def _git(*args: str) -> subprocess.CompletedProcess[str] | None:
    # GIT_OPTIONAL_LOCKS=0: reading the state never rewrites the index under another git.
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    try:
        return subprocess.run(
            ["git", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None


def _cpu() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} x {os.cpu_count()}"


def _gpu() -> str | None:
    """NVIDIA GPUs as nvidia-smi names them (without importing torch here), or None."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = [n.strip() for n in out.splitlines() if n.strip()]
    return f"{names[0]} x {len(names)}" if names else None


def results_header(only: list[str] | None, smoke: bool) -> dict[str, Any]:
    """The first line of a results file: the machine, the software and the code measured."""
    head = _git("rev-parse", "--short", "HEAD")
    commit = head.stdout.strip() if head is not None and head.returncode == 0 else "unknown"
    diff = _git("diff", "--quiet", "HEAD", "--") if commit != "unknown" else None
    try:
        torch_version: str | None = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    return {
        "machine": platform.node(),
        "cpu": _cpu(),
        "gpu": _gpu(),
        "torch": torch_version,
        "python": platform.python_version(),
        "commit": commit,
        "dirty": diff is not None and diff.returncode == 1,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "only": only,
        "smoke": smoke,
    }


def results_sink(directory: Path, header: dict[str, Any]) -> Callable[[str], None]:
    """Create `<date>-<commit>.jsonl` (`-2`, `-3`... when taken) in `directory`, holding
    `header`; return what appends a figure line to it (flushed at once: a run killed halfway
    keeps the figures it measured)."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{header['date'][:10]}-{header['commit']}"
    path, n = directory / f"{stem}.jsonl", 1
    while True:
        try:
            with path.open("x") as f:
                f.write(json.dumps(header) + "\n")
            break
        except FileExistsError:
            n += 1
            path = directory / f"{stem}-{n}.jsonl"
    print(f"bench: saving the figures to {path}", file=sys.stderr, flush=True)

    def append(line: str) -> None:
        with path.open("a") as f:
            f.write(line + "\n")

    return append


def run(
    name: str, smoke: bool, sink: Callable[[str], None] | None = None
) -> tuple[list[str], list[str]]:
    """Run one benchmark, pass its figure lines on (and to `sink`): (the names of the figures
    missing, the last lines it wrote besides its figures, to repeat at the end when something
    is missing)."""
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
            if sink is not None:
                sink(json.dumps(line))
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
    parser.add_argument(
        "--save", action="store_true", help="also write the figures to bench/results/"
    )
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
    sink = None
    if args.save:
        sink = results_sink(
            RESULTS, results_header(None if args.only is None else names, args.smoke)
        )
    for name in names:
        lost, tail = run(name, args.smoke, sink)
        if lost and args.smoke:
            # gloo on a loaded 2-core machine was seen to abort a worker at random (SIGABRT in
            # its TCP transport, a different benchmark each time): a smoke run, which checks
            # that the suite works, tries a failed benchmark once more and says so.
            failures.append((f"{name} (failed once, retried)", tail))
            print(f"bench: {name} failed; retrying it once (smoke run)", file=sys.stderr)
            lost, tail = run(name, args.smoke, sink)
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
