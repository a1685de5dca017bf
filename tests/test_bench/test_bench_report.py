"""`python -m bench.report`: the newest results file of `python -m bench --save` as the README's
table. Small results files written here; no benchmark runs."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from bench.__main__ import BENCHMARKS, results_header, results_sink
from bench.report import BEGIN, END, HEADER_KEYS, TARGETS, main, read_results


def header(date: str, commit: str, **extra: Any) -> dict[str, Any]:
    return {
        "machine": "box-1",
        "cpu": "Test CPU x 2",
        "gpu": None,
        "torch": "2.13.0",
        "python": "3.11.7",
        "commit": commit,
        "dirty": False,
        "date": date,
        "only": None,
        "smoke": False,
        **extra,
    }


def figure(name: str, value: float, unit: str, ratio: float | None) -> dict[str, Any]:
    return {
        "name": name,
        "value": value,
        "unit": unit,
        "ratio_to": None if ratio is None else "a peer",
        "ratio": ratio,
        "config": {},
    }


FIGURES = [
    figure("save_throughput", 1551.2, "MB/s", 0.9612),
    figure("async_peak_memory", 703.0, "MB over training peak", 1.03),
    figure("loop_overhead_null", 0.087, "ms of host time per step over the raw loop", 1.05),
    figure("async_stall", 0.063, "s", 0.14),
    figure("hash_throughput", 7.5, "GB/s", 4.22),
]


def write_results(path: Path, head: dict[str, Any], figures: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in [head, *figures]))
    return path


def rows(text: str) -> dict[str, list[str]]:
    """The table's rows by figure name: [value, target, met?]."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^\| `([^`]+)` \| (.*) \|$", line)
        if m:
            out[m.group(1)] = [c.strip() for c in m.group(2).split(" | ")]
    return out


@pytest.fixture
def results(tmp_path: Path) -> Path:
    # The newer run sorts first by name: the header's date decides, not the file name.
    d = tmp_path / "results"
    write_results(d / "2026-12-07-bbbbbbb.jsonl", header("2026-12-07T09:00:00Z", "bbbbbbb"), [])
    write_results(
        d / "2026-12-08-aaaaaaa.jsonl", header("2026-12-08T10:30:00Z", "aaaaaaa"), FIGURES
    )
    return d


def test_prints_the_newest_file_as_a_table_with_its_provenance(results, capsys):
    assert main(["--results", str(results)]) == 0
    out = capsys.readouterr().out
    caption = out.splitlines()[0]
    for part in (
        "2026-12-08-aaaaaaa.jsonl",
        "box-1",
        "Test CPU x 2",
        "aaaaaaa",
        "2026-12-08 10:30",
    ):
        assert part in caption, caption
    assert "| figure | value | target | met? |" in out
    table = rows(out)
    assert list(table) == [f["name"] for f in FIGURES]  # the file's order
    assert table["save_throughput"] == ["**0.961** (1551 MB/s)", ">= 0.9", "yes"]
    assert table["async_peak_memory"][1:] == ["<= 1", "no"]
    # A difference is judged on its value, shown in the target's unit.
    assert table["loop_overhead_null"] == ["**0.087 ms** (ratio 1.05)", "<= 0.1 ms", "yes"]
    # A GPU target is not judged on a machine without one.
    assert table["async_stall"][1:] == ["<= 0.05 on a GPU", "no GPU"]
    assert table["hash_throughput"][1:] == ["report", "-"]


def test_gpu_targets_are_judged_on_a_gpu_machine(tmp_path, capsys):
    path = write_results(
        tmp_path / "r.jsonl",
        header("2026-12-08T10:30:00Z", "ccccccc", gpu="NVIDIA H100 x 1"),
        [figure("async_stall", 0.01, "s", 0.02), figure("mystery", 3.0, "s", None)],
    )
    assert main(["--file", str(path)]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H100 x 1" in out.splitlines()[0]
    assert rows(out)["async_stall"][2] == "yes"
    assert rows(out)["mystery"] == ["**3.00** s", "-", "-"]  # a figure without a target entry


def test_write_replaces_only_the_marked_block(results, tmp_path, capsys):
    readme = tmp_path / "README.md"
    before, after = "# Title\n\ntext before\n\n", "\n\n## Next\n\ntext after\n"
    readme.write_text(f"{before}{BEGIN}\nthe old table\n{END}{after}")
    assert main(["--results", str(results), "--readme", str(readme), "--write"]) == 0
    printed = capsys.readouterr().out
    text = readme.read_text()
    assert text.startswith(before + BEGIN + "\n") and text.endswith(END + after)
    assert "the old table" not in text
    assert printed.strip() in text
    assert main(["--results", str(results), "--readme", str(readme), "--write"]) == 0
    assert readme.read_text() == text  # idempotent


def test_a_readme_without_the_markers_is_refused_unchanged(results, tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n{END}\n{BEGIN}\n")
    assert main(["--results", str(results), "--readme", str(readme), "--write"]) == 1
    assert "bench:begin" in capsys.readouterr().err
    assert readme.read_text() == f"# Title\n{END}\n{BEGIN}\n"


def test_no_results_or_a_file_without_a_header_is_one_line(tmp_path, capsys):
    assert main(["--results", str(tmp_path / "none")]) == 1
    assert "python -m bench --save" in capsys.readouterr().err
    bad = write_results(tmp_path / "bad" / "x.jsonl", FIGURES[0], FIGURES[1:])
    assert main(["--results", str(bad.parent)]) == 1
    err = capsys.readouterr().err
    assert "x.jsonl: line 1 is not a results header" in err and len(err.splitlines()) == 1


def test_save_writes_a_header_then_the_figure_lines(tmp_path):
    head = header("2026-12-08T10:30:00Z", "ddddddd")
    sink = results_sink(tmp_path, head)
    for line in FIGURES[:2]:
        sink(json.dumps(line))
    saved = read_results(tmp_path / "2026-12-08-ddddddd.jsonl")
    assert saved.header == head and saved.figures == FIGURES[:2]
    # A second run of the same commit that day gets a file of its own.
    results_sink(tmp_path, head)
    assert (tmp_path / "2026-12-08-ddddddd-2.jsonl").read_text() == json.dumps(head) + "\n"


def test_the_header_says_where_and_what_was_measured():
    head = results_header(["hash"], smoke=True)
    assert all(head[k] for k in HEADER_KEYS), head
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", head["date"])
    assert head["only"] == ["hash"] and head["smoke"] is True
    json.dumps(head)


def test_every_benchmark_figure_has_a_target_entry():
    figures = {f for *_, names in BENCHMARKS.values() for f in names}
    assert figures == set(TARGETS)
