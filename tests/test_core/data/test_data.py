"""core.data: sources, packing, the input_ids column, errors, collate, lengths, fingerprints."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from core.config import DataConfig
from core.data import (
    DataError,
    build_dataset,
    collate,
    dataset_fingerprint,
    sample_lengths,
    sources,
)
from tests.launch import REPO

ROOT = REPO


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """Keep datasets' Arrow cache inside the test's temp dir, never in ~/.cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def rows(ds: datasets.Dataset) -> list[bytes]:
    return [bytes(ids) for ids in ds["input_ids"]]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


# --- stdlib corpus ---------------------------------------------------------------------------


def test_stdlib_is_deterministic_and_respects_max_bytes_and_seq_len():
    cfg = DataConfig(source="stdlib", max_bytes=10_000, seq_len=32)
    first, second = build_dataset(cfg), build_dataset(cfg)
    assert rows(first) == rows(second)
    assert dataset_fingerprint(first) == dataset_fingerprint(second)
    assert len(first) == 10_000 // 32
    assert set(sample_lengths(first)) == {32}
    assert all(0 <= t <= 255 for ids in first["input_ids"] for t in ids)
    # Blocks are consecutive slices of one text: joined, they are the corpus prefix.
    b"".join(rows(first)).decode("utf-8", errors="strict")


def test_stdlib_walk_is_sorted_and_skips_tests_site_packages_and_unreadable(tmp_path, monkeypatch):
    root = tmp_path / "lib"
    files = {
        "b.py": "# b module\n",
        "a.py": "# a module\n",
        "pkg/c.py": "# c module\n",
        "test/t.py": "# skip\n",
        "pkg/tests/t.py": "# skip\n",
        "site-packages/s.py": "# skip\n",
        "idlelib/idle_test/i.py": "# skip\n",
        "notes.txt": "not python\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "latin1.py").write_bytes(b"# caf\xe9\n")  # not UTF-8: skipped
    monkeypatch.setattr(sources.sysconfig, "get_paths", lambda: {"stdlib": str(root)})
    ds = build_dataset(DataConfig(source="stdlib", max_bytes=0, packing=False, seq_len=64))
    assert rows(ds) == [b"# a module\n", b"# b module\n", b"# c module\n"]


# --- files -----------------------------------------------------------------------------------


def test_text_packing_cuts_blocks_across_records_and_map_batches(tmp_path):
    lines = [f"line {i} " + "x" * (i % 7) if i % 5 else "" for i in range(2500)]  # blank lines too
    path = write_lines(tmp_path / "corpus.txt", lines)
    raw = path.read_bytes()
    ds = build_dataset(DataConfig(source=str(path), seq_len=16))
    assert len(ds) == len(raw) // 16  # one global remainder, not one per map batch
    assert rows(ds)[0] == raw[:16]
    assert b"".join(rows(ds)) == raw[: len(ds) * 16]


def test_text_without_packing_keeps_one_truncated_sample_per_line(tmp_path):
    path = write_lines(tmp_path / "corpus.md", ["hello world", "x", "", "ab", "0123456789abc"])
    ds = build_dataset(DataConfig(source=str(path), seq_len=8, packing=False))
    assert rows(ds) == [b"hello wo", b"ab", b"01234567"]
    assert sample_lengths(ds) == [8, 2, 8]


def test_jsonl_uses_text_field_with_and_without_packing(tmp_path):
    records = [{"content": f"record number {i}", "id": i} for i in range(10)]
    path = write_jsonl(tmp_path / "data.jsonl", records)
    joined = "".join(r["content"] + "\n" for r in records).encode()
    packed = build_dataset(DataConfig(source=str(path), text_field="content", seq_len=10))
    assert len(packed) == len(joined) // 10
    assert rows(packed)[:2] == [joined[:10], joined[10:20]]
    single = build_dataset(
        DataConfig(source=str(path), text_field="content", seq_len=64, packing=False)
    )
    assert rows(single) == [r["content"].encode() for r in records]


def test_parquet_loads(tmp_path):
    texts = ["première ligne", "second line", "z"]  # non-ASCII: ids are the UTF-8 bytes
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"text": texts}), path)
    ds = build_dataset(DataConfig(source=str(path), seq_len=32, packing=False))
    assert rows(ds) == [texts[0].encode(), texts[1].encode()]


def test_glob_reads_files_in_sorted_order(tmp_path):
    write_lines(tmp_path / "b.txt", ["bbbb"])
    write_lines(tmp_path / "a.txt", ["aaaa"])
    ds = build_dataset(DataConfig(source=str(tmp_path / "*.txt"), seq_len=5))
    assert rows(ds) == [b"aaaa\n", b"bbbb\n"]


def test_input_ids_column_is_used_as_is(tmp_path):
    records = [
        {"input_ids": [300, 1, 2, 3, 4, 5], "text": "ignored"},
        {"input_ids": [7]},
        {"input_ids": [9, 8, 7]},
    ]
    path = write_jsonl(tmp_path / "tokens.jsonl", records)
    ds = build_dataset(DataConfig(source=str(path), seq_len=4))  # packing is on by default
    assert ds["input_ids"] == [[300, 1, 2, 3], [9, 8, 7]]
    assert sample_lengths(ds) == [4, 3]


def test_explicit_format_overrides_the_extension(tmp_path):
    path = write_lines(tmp_path / "train.log", ["some log text"])
    ds = build_dataset(DataConfig(source=str(path), format="text", seq_len=4))
    assert rows(ds) == [b"some", b" log", b" tex"]


# --- errors ----------------------------------------------------------------------------------


def test_unknown_extension_names_data_format(tmp_path):
    path = write_lines(tmp_path / "data.csv", ["a,b"])
    with pytest.raises(DataError, match=r"data\.format.*accepted extensions: \.txt") as err:
        build_dataset(DataConfig(source=str(path)))
    assert "\n" not in str(err.value)
    assert isinstance(err.value, ValueError)


def test_missing_text_field_names_the_key_and_columns_found(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [{"body": "text", "id": 1}])
    with pytest.raises(DataError, match=r"data\.text_field.*'text'.*columns found: body, id"):
        build_dataset(DataConfig(source=str(path)))


def test_glob_without_matches_and_empty_result_are_data_errors(tmp_path):
    with pytest.raises(DataError, match=r"data\.source: no files match"):
        build_dataset(DataConfig(source=str(tmp_path / "*.jsonl")))
    path = write_lines(tmp_path / "tiny.txt", ["short"])
    with pytest.raises(DataError, match=r"data\.source: .* yields no sample"):
        build_dataset(DataConfig(source=str(path), seq_len=64))


def test_malformed_file_is_a_one_line_data_error(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(DataError, match=r"data\.source: cannot read") as err:
        build_dataset(DataConfig(source=str(path)))
    assert "\n" not in str(err.value)


# --- collate and lengths ---------------------------------------------------------------------


def test_collate_pads_with_zero_and_masks_labels():
    out = collate([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    assert out["input_ids"].dtype == torch.long and out["labels"].dtype == torch.long
    assert out["input_ids"].tolist() == [[1, 2, 3], [4, 5, 0]]
    assert out["labels"].tolist() == [[1, 2, 3], [4, 5, -100]]


def test_collate_equal_lengths_are_unpadded():
    out = collate([{"input_ids": [1, 2]}, {"input_ids": [3, 4]}])
    assert out["input_ids"].shape == (2, 2)
    assert torch.equal(out["labels"], out["input_ids"])
    assert pickle.loads(pickle.dumps(collate)) is collate  # DataLoader workers need this


def test_dataloader_batches_a_packed_dataset():
    ds = build_dataset(DataConfig(source="stdlib", max_bytes=4096, seq_len=16))
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=4, collate_fn=collate)))
    assert batch["input_ids"].shape == (4, 16)
    assert bytes(batch["input_ids"][0].tolist()) == bytes(ds[0]["input_ids"])


def test_sample_lengths_match_rows_and_follow_select(tmp_path):
    path = write_lines(tmp_path / "corpus.txt", ["aa", "bbbbbb", "ccc", "dddddddddddd"])
    ds = build_dataset(DataConfig(source=str(path), seq_len=8, packing=False))
    assert sample_lengths(ds) == [len(ids) for ids in ds["input_ids"]] == [2, 6, 3, 8]
    assert sample_lengths(ds.select([3, 0])) == [8, 2]


# --- fingerprints ----------------------------------------------------------------------------


def test_file_fingerprint_is_stable_and_changes_with_content(tmp_path):
    path = write_lines(tmp_path / "corpus.txt", ["the same text", "twice"])
    cfg = DataConfig(source=str(path), seq_len=4)
    before = dataset_fingerprint(build_dataset(cfg))
    assert dataset_fingerprint(build_dataset(cfg)) == before
    write_lines(path, ["other text here", "now"])
    assert dataset_fingerprint(build_dataset(cfg)) != before
    assert dataset_fingerprint(build_dataset(DataConfig(source=str(path), seq_len=5))) != before


def test_stdlib_fingerprint_tracks_content_and_is_stable_across_processes():
    cfg = DataConfig(source="stdlib", max_bytes=5000, seq_len=16)
    here = dataset_fingerprint(build_dataset(cfg))
    assert dataset_fingerprint(build_dataset(DataConfig(max_bytes=5001, seq_len=16))) == here
    assert dataset_fingerprint(build_dataset(DataConfig(max_bytes=6000, seq_len=16))) != here
    code = (
        "from core.config import DataConfig; from core.data import *; "
        "print(dataset_fingerprint(build_dataset(DataConfig(max_bytes=5000, seq_len=16))))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == here
