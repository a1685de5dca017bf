"""Where text comes from: the Python standard library's own source (`data.source: stdlib`, no
download), or text / json(l) / parquet files read with datasets' builders (cached as Arrow).

Record order depends only on the input (files sorted, then their rows in order), so a sampler
position means the same batch after a restart. A source's BLAKE3 (`hash_source`) is what a token
store records of it, to tell when it changed.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3
import datasets
import pyarrow as pa

from core.config import DataConfig, first_line
from core.data.errors import DataError

if TYPE_CHECKING:
    from core.data.pieces import Source

logger = logging.getLogger(__name__)

FORMAT_BY_SUFFIX = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
}
# Directory names pruned from the stdlib walk: third-party code and test suites (idlelib/idle_test).
_STDLIB_SKIP = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_records(max_bytes: int) -> list[bytes]:
    """The stdlib's *.py files in sorted path order, `max_bytes` bytes in all (0 = all)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP]  # prune whole subtrees
        paths.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    paths.sort(key=lambda p: p.relative_to(root).as_posix())
    records: list[bytes] = []
    total = 0
    for path in paths:
        try:
            data = path.read_bytes()
            data.decode("utf-8")  # the samples are meant to be UTF-8 text
        except (OSError, UnicodeDecodeError) as e:
            logger.debug("stdlib corpus: skipping %s (%s)", path, e.__class__.__name__)
            continue
        if max_bytes:
            data = data[: max_bytes - total]
        records.append(data)
        total += len(data)
        if max_bytes and total >= max_bytes:
            break
    return records


def load_records(cfg: DataConfig) -> tuple[datasets.Dataset, str, str]:
    """(the records of `cfg.source` as datasets' builder reads them, its file format, a
    description for the log). Raises DataError for a source that cannot be read."""
    fmt = resolve_format(cfg)
    files = data_files(cfg.source)
    # datasets keys its cache of the files by path and mtime; the name adds their sizes, so a
    # file replaced under its old mtime (cp -p, tar x) with other content of another size is
    # read again rather than served from the old cache.
    sizes = hashlib.sha256(json.dumps([os.path.getsize(f) for f in files]).encode())
    try:
        raw = datasets.load_dataset(
            fmt, data_files=files, split="train", name=f"sizes-{sizes.hexdigest()[:16]}"
        )
    except (datasets.exceptions.DatasetsError, pa.ArrowException) as e:
        cause = e.__cause__ or e  # DatasetGenerationError wraps the parser's error
        raise DataError(
            f"data.source: cannot read {cfg.source!r} as {fmt} "
            f"({cause.__class__.__name__}: {first_line(cause)})"
        ) from e
    return raw, fmt, f"{len(files)} {fmt} file(s) {cfg.source!r}, {len(raw)} records"


def resolve_format(cfg: DataConfig) -> str:
    """The file format to read: data.format, or the extension's (chat rows: json or parquet)."""
    if cfg.format not in ("auto", "chat"):
        return cfg.format
    suffix = Path(cfg.source).suffix.lower()
    fmt = FORMAT_BY_SUFFIX.get(suffix)
    if cfg.format == "chat" and fmt not in ("json", "parquet"):
        raise DataError(
            f"data.source: chat rows are read from .json, .jsonl or .parquet files, not "
            f"{suffix or '(no extension)'!r} ({cfg.source!r})"
        )
    if fmt is None:
        raise DataError(
            f"data.format: cannot infer the format of data.source {cfg.source!r} from extension "
            f"{suffix or '(none)'!r}; accepted extensions: {', '.join(FORMAT_BY_SUFFIX)}, "
            "or set data.format to text, json or parquet"
        )
    return fmt


def data_files(source: str) -> list[str]:
    """The files `source` names, sorted so that the record order is deterministic."""
    if any(ch in source for ch in "*?["):
        files = sorted(f for f in glob.glob(source, recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"data.source: no files match {source!r}")
        return files
    if not os.path.isfile(source):
        raise DataError(f"data.source: {source!r} is not a file; give a file or a glob (d/*.jsonl)")
    return [source]


def text_column(raw: datasets.Dataset, cfg: DataConfig, fmt: str) -> str:
    """The column holding the text; DataError naming data.text_field when it is not there."""
    field = "text" if fmt == "text" else cfg.text_field
    if field not in raw.column_names:
        raise DataError(
            f"data.text_field: no column {field!r} in {cfg.source!r}; "
            f"columns found: {', '.join(raw.column_names)}"
        )
    if raw.features[field] not in (datasets.Value("string"), datasets.Value("large_string")):
        raise DataError(f"data.text_field: column {field!r} holds {raw.features[field]}, not text")
    return field


def hash_source(fs: Any, source: Source, cfg: DataConfig) -> str:
    """BLAKE3 of a source file's bytes (streamed; stdlib, `fs` None: of its records), as a
    token store records it (core/data/pieces.py lists the sources)."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if fs is None:
        for record in stdlib_records(cfg.max_bytes):
            h.update(record)
        return h.hexdigest()
    with fs.open(source.path, "rb") as f:
        while block := f.read(16 << 20):
            h.update(block)
    return h.hexdigest()
