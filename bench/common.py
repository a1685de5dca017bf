"""What every benchmark prints: one JSON line per figure, with the same keys everywhere.

A figure line holds `name`, `value`, `unit`, `ratio_to` (what the value is compared with, or
None), `ratio` (value over that, or None) and `config` (what was measured), plus any detail
(every repetition's value). Lines of other shapes (per-run detail) go to stderr, so stdout is
the figures alone. `python -m bench` runs every benchmark and checks each figure line.
"""

from __future__ import annotations

import json
import sys
from typing import Any

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


def detail(name: str, **fields: Any) -> None:
    """Print a line of per-run detail on stderr (not a figure)."""
    print(json.dumps({"name": name, **fields}), file=sys.stderr, flush=True)


def is_figure(line: dict[str, Any]) -> bool:
    return all(k in line for k in FIGURE_KEYS) and isinstance(line["config"], dict)
