"""`python -m bench --smoke`: every benchmark runs a few steps and prints its figures in the
common shape, so the suite cannot rot between full runs (the figures themselves mean nothing)."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor

from bench.__main__ import BENCHMARKS
from bench.common import FIGURE_KEYS
from tests.launch import REPO, run

# The smoke runs in two halves at once (each benchmark is a few subprocesses mostly importing
# torch, about one core's work; the figures mean nothing here): these, about half the time.
FIRST_HALF = ("peers", "fsdp", "store_resume_jump", "tokenize_throughput", "store_read", "hash")


def test_every_benchmark_prints_its_figures():
    halves = [[n for n in BENCHMARKS if (n in FIRST_HALF) == first] for first in (True, False)]
    cmds = [[sys.executable, "-m", "bench", "--smoke", "--only", ",".join(h)] for h in halves]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda cmd: run(cmd, cwd=REPO, timeout=600), cmds))
    for result in results:
        assert result.returncode == 0, result.output[-15000:]
    figures = {}
    for line in "\n".join(r.output for r in results).splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if all(k in record for k in FIGURE_KEYS):
                figures[record["name"]] = record
    expected = {f for *_, names in BENCHMARKS.values() for f in names}
    assert expected <= set(figures), sorted(expected - set(figures))
    for record in figures.values():
        assert isinstance(record["value"], (int, float)), record
        # A difference (signed: true, e.g. host ms over a raw loop) may be <= 0 in a smoke run.
        assert record["value"] > 0 or record.get("signed") is True, record
        assert isinstance(record["config"], dict), record
        if record["ratio_to"] is not None:
            assert isinstance(record["ratio"], (int, float)) and record["ratio"] > 0, record
    # The raw loops do the launcher's math: the smoke run compares the first losses bit for bit.
    assert figures["loop_overhead"]["same_losses_first_steps"] is True
    assert figures["loop_overhead_ddp"]["same_losses_first_steps"] is True
    assert figures["loop_overhead_null"]["same_losses_first_steps"] is True
