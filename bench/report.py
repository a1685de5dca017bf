"""The newest benchmark results as a markdown table: `python -m bench.report [--write]`.

Reads the newest `bench/results/*.jsonl` (written by `python -m bench --save`: a header line
`{"machine", "cpu", "gpu", "torch", "python", "commit", "dirty", "date", "only", "smoke"}`, then
one figure line per figure as `bench.common.figure` prints it) and prints a table of its figures
(figure, value, target, met?) under a caption naming the file, machine, date and commit.
`--write` puts that table into README.md between the `<!-- bench:begin -->` and
`<!-- bench:end -->` markers, so the README's figures are always those of a results file.

The targets are kept here, one per figure; docs/performance.md says what each figure compares.

    .venv/bin/python -m bench.report [--write] [--file FILE] [--results DIR] [--readme FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import is_figure

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
README = REPO / "README.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
HEADER_KEYS = ("machine", "cpu", "torch", "commit", "date")


class ReportError(Exception):
    """A results file or README this command cannot use; the message names it."""


@dataclass(frozen=True)
class Target:
    """A figure's target: its `ratio` (or its `value`, for a difference) compared with `bound`."""

    op: str  # ">=" or "<="
    bound: float
    on: str = "ratio"  # "ratio" or "value"
    unit: str = ""  # the value's unit as the table shows it (a value target)
    label: str = ""  # shown instead of "op bound unit"
    gpu_only: bool = False  # judged only on a machine with a GPU

    def text(self) -> str:
        if self.label:
            return self.label
        text = f"{self.op} {self.bound:g}"
        text += f" {self.unit}" if self.unit else ""
        return text + (" on a GPU" if self.gpu_only else "")

    def met(self, line: dict[str, Any], gpu: bool) -> str:
        if self.gpu_only and not gpu:
            return "no GPU"
        got = line.get(self.on)
        if not isinstance(got, (int, float)):
            return "?"
        ok = got >= self.bound if self.op == ">=" else got <= self.bound
        return "yes" if ok else "no"


# None: a figure reported without a target.
TARGETS: dict[str, Target | None] = {
    "loop_overhead": Target(">=", 0.99),
    "loop_overhead_ddp": Target(">=", 0.97),
    "loop_overhead_null": Target("<=", 0.1, on="value", unit="ms"),
    "data_path": Target(">=", 0.98),
    "vs_trainer": Target(">=", 1.0),
    "vs_accelerate": Target(">=", 1.0),
    "resume_vs_trainer": None,
    "vs_trainer_hf": Target(">=", 1.0),
    "tokenize_throughput": Target(">=", 0.9),
    "save_throughput": Target(">=", 0.9),
    "save_peak_memory": Target("<=", 1.1),
    "load_throughput": Target(">=", 0.85),
    "async_stall": Target("<=", 0.05, gpu_only=True),
    "async_throughput": Target(">=", 0.95),
    "async_peak_memory": Target("<=", 1.0),
    "s3_upload": Target(">=", 0.8),
    "resume_jump": Target("<=", 1.1),
    "deepspeed_save": Target("<=", 1.1),
    "fsdp_vs_ddp": None,
    "fsdp_save_bytes_per_rank": Target("<=", 1.1),
    "fsdp_save_peak_memory": Target("<=", 1.1),
    "fsdp_save_throughput": Target(">=", 0.9),
    "save_bytes_per_rank": Target("<=", 1.1),
    "ddp_save_peak_memory": Target("<=", 1.1),
    "ddp_save_throughput": Target(">=", 0.9),
    "hash_throughput": None,
    "store_read": Target(">=", 0.95),
    "store_resume_jump": Target("<=", 1.05),
    "prepare_throughput": None,
    "prepare_scaling": None,
    "prepare_peak_rss": Target("<=", 1.1, label="flat (<= 1.1)"),
}


@dataclass
class Results:
    path: Path
    header: dict[str, Any]
    figures: list[dict[str, Any]]


def _number(x: float) -> str:
    """Three significant digits (trailing zeros kept), no exponent for what benchmarks print."""
    if x != x:  # NaN
        return "nan"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 0.1:
        return f"{x:#.3g}".rstrip(".")
    return f"{x:.3g}"


def read_results(path: Path) -> Results:
    """A results file: its header and its figure lines (the last line of a name wins)."""
    lines = [s for s in path.read_text().splitlines() if s.strip()]
    records = []
    for n, text in enumerate(lines, 1):
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise ReportError(f"{path}: line {n} is not JSON: {e}") from e
        if not isinstance(record, dict):
            raise ReportError(f"{path}: line {n} is not a JSON object")
        records.append(record)
    if not records or not _is_header(records[0]):
        raise _not_a_header(path)
    figures: dict[str, dict[str, Any]] = {}
    for n, record in enumerate(records[1:], 2):
        if not is_figure(record):
            raise ReportError(f"{path}: line {n} is not a figure line (bench/common.py)")
        figures[record["name"]] = record
    return Results(path, records[0], list(figures.values()))


def _is_header(record: Any) -> bool:
    return isinstance(record, dict) and all(k in record for k in HEADER_KEYS)


def _not_a_header(path: Path) -> ReportError:
    return ReportError(
        f"{path}: line 1 is not a results header (it needs {', '.join(HEADER_KEYS)}); "
        "results files are written by python -m bench --save"
    )


def newest(directory: Path) -> Path:
    """The results file whose header has the latest date (then the latest name)."""
    dated = []
    for path in sorted(directory.glob("*.jsonl")):
        with path.open() as f:
            first = f.readline()
        try:
            header = json.loads(first)
        except json.JSONDecodeError:
            header = None
        if not _is_header(header):
            raise _not_a_header(path)
        dated.append((str(header["date"]), path.name, path))
    if not dated:
        raise ReportError(f"no results in {directory}: run python -m bench --save")
    return max(dated)[2]


def _value(line: dict[str, Any], target: Target | None) -> str:
    value, unit, ratio = line["value"], line["unit"], line["ratio"]
    if unit == "bytes" and isinstance(value, (int, float)):
        value, unit = value / 1e6, "MB"
    if target is not None and target.on == "value":
        text = f"**{_number(value)} {target.unit or unit}**"
        return text + (f" (ratio {_number(ratio)})" if isinstance(ratio, (int, float)) else "")
    if isinstance(ratio, (int, float)):
        return f"**{_number(ratio)}** ({_number(value)} {unit})"
    return f"**{_number(value)}** {unit}"


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def caption(results: Results) -> str:
    h = results.header
    machine = f"{h['machine']} ({h['cpu']}" + (f", {h['gpu']})" if h.get("gpu") else ", no GPU)")
    commit = str(h["commit"]) + (" with uncommitted changes" if h.get("dirty") else "")
    date = str(h["date"])
    if re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", date):
        date = date[:10] + " " + date[11:16]
    text = (
        f"Figures of `{_shown(results.path)}`: {machine}, torch {h['torch']}, commit {commit}, "
        f"{date} UTC"
    )
    if h.get("only"):
        text += f"; only {', '.join(h['only'])}"
    if h.get("smoke"):
        text += "; a smoke run: these figures mean nothing"
    return text + ". Made by `python -m bench.report --write`."


def table(results: Results) -> str:
    gpu = bool(results.header.get("gpu"))
    rows = [caption(results), "", "| figure | value | target | met? |", "| --- | --- | --- | --- |"]
    for line in results.figures:
        target = TARGETS.get(line["name"])
        verdict = target.met(line, gpu) if target else "-"
        text = target.text() if target else "report" if line["name"] in TARGETS else "-"
        rows.append(f"| `{line['name']}` | {_value(line, target)} | {text} | {verdict} |")
    return "\n".join(rows)


def write_readme(readme: Path, block: str) -> None:
    """Replace what lies between the bench markers of `readme` with `block`."""
    text = readme.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ReportError(f"{readme}: needs one {BEGIN} line followed by one {END} line")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    readme.write_text(f"{head}{BEGIN}\n{block}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.report",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument("--write", action="store_true", help="put the table into the README")
    parser.add_argument("--file", type=Path, help="this results file instead of the newest")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of results files")
    parser.add_argument("--readme", type=Path, default=README, help="the README --write edits")
    args = parser.parse_args(argv)
    try:
        results = read_results(args.file or newest(args.results))
        block = table(results)
        if args.write:
            write_readme(args.readme, block)
    except (ReportError, OSError) as e:
        print(f"bench.report: {e}", file=sys.stderr)
        return 1
    print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
