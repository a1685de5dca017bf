"""What every benchmark prints: one JSON line per figure, with the same keys everywhere.

A figure line holds `name`, `value`, `unit`, `ratio_to` (what the value is compared with, or
None), `ratio` (value over that, or None) and `config` (what was measured), plus any detail
(every repetition's value). Lines of other shapes (per-run detail) go to stderr, so stdout is
the figures alone. `python -m bench` runs every benchmark and checks each figure line.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

FIGURE_KEYS = ("name", "value", "unit", "ratio_to", "ratio", "config")


def figure(
    name: str,
    value: float,
    unit: str,
    *,
    ratio_to: str | None = None,
    ratio: float | None = None,
    config: dict[str, Any] | None = None,
    **detail: Any,
) -> None:
    """Print one figure line on stdout."""
    line = {
        "name": name,
        "value": value,
        "unit": unit,
        "ratio_to": ratio_to,
        "ratio": ratio,
        "config": config or {},
        **detail,
    }
    print(json.dumps(line), flush=True)


def gloo_worker(measure: Callable[[], None]) -> NoReturn:
    """A torchrun worker's whole life: a gloo group from torchrun's environment, `measure()`
    (which returns holding nothing, so the groups are destroyed at the teardown, not at
    exit), then the launcher's own teardown and exit."""
    import torch.distributed as dist

    from launcher.dist import destroy_distributed, exit_worker

    dist.init_process_group("gloo")
    measure()
    destroy_distributed(clean=True)
    exit_worker(0)


def detail(name: str, **fields: Any) -> None:
    """Print a line of per-run detail on stderr (not a figure)."""
    print(json.dumps({"name": name, **fields}), file=sys.stderr, flush=True)


def is_figure(line: dict[str, Any]) -> bool:
    return all(k in line for k in FIGURE_KEYS) and isinstance(line["config"], dict)


def alternating(rep: int, first: Any, second: Any) -> tuple[Any, Any]:
    """The two sides of a paired measurement, in turn first and second (drift hits both)."""
    return (first, second) if rep % 2 == 0 else (second, first)


@contextmanager
def resume_copy(root: Path, step: int, rep: int) -> Iterator[Path]:
    """A fresh run directory holding only a copy of `root`/long/checkpoint-<step>, for one timed
    resume of it; removed afterwards."""
    run_dir = root / f"resume-{step}-{rep}"
    run_dir.mkdir()
    shutil.copytree(root / "long" / f"checkpoint-{step}", run_dir / f"checkpoint-{step}")
    try:
        yield run_dir
    finally:
        shutil.rmtree(run_dir)
