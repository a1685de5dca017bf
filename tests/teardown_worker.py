"""A process that ends the way tests/test_launcher/test_teardown.py asks, to show what `exit_worker`
keeps.

    [torchrun ...] tests/teardown_worker.py OUT MODE CODE

Under torchrun (2 ranks) a collective is still in flight as the process ends, as one may be
when a worker returns: rank 1 joins it a second after rank 0 and goes straight to its exit.
Ended by the interpreter's teardown, rank 1 then aborts more often than not ("terminate
called without an active exception"; 12 of 16 runs here). On one process (a gloo group of 1)
it checks what the exit still does. MODE is `exit_worker` or `sys_exit`. Writes into
OUT/rank<N>: `atexit` (from an atexit handler), `unclosed` (a file written and never closed),
`thread` (a non-daemon thread that finishes after main): those three on one process only; and
`finalised` if the interpreter's teardown ran.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from launcher.dist import exit_worker

OUT, MODE, CODE = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])


class MarksFinalisation:
    """Writes `finalised` when the interpreter's teardown clears this module; under torchrun
    it then keeps the teardown open for 2 s (it aborts more often so)."""

    def __init__(self, path: Path) -> None:
        # What __del__ needs, held here: the module's globals may be gone when it runs.
        self.path, self.open, self.sleep = str(path), open, time.sleep
        self.pause = 2 if dist.get_world_size() > 1 else 0

    def __del__(self) -> None:
        with self.open(self.path, "w") as f:
            f.write("yes")
        self.sleep(self.pause)


def late_thread() -> None:
    time.sleep(0.5)
    (OUT / "thread").write_text("joined")


if "WORLD_SIZE" not in os.environ:
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[4])
dist.init_process_group("gloo")
rank = dist.get_rank()
OUT = OUT / f"rank{rank}"
OUT.mkdir(parents=True, exist_ok=True)
if rank == 1:
    time.sleep(1)  # rank 0 waits in the collective; rank 1 starts it, then ends at once
work = dist.all_reduce(torch.ones(1 << 20), async_op=True)
del work
if dist.get_world_size() == 1:  # under torchrun nothing may delay the teardown
    atexit.register(lambda: (OUT / "atexit").write_text("ran"))
    unclosed = open(OUT / "unclosed", "w")  # never closed, on purpose
    unclosed.write("flushed")
    threading.Thread(target=late_thread).start()
marker = MarksFinalisation(OUT / "finalised")
if MODE == "exit_worker":
    exit_worker(CODE)
sys.exit(CODE)
