"""Token stores: prepare (the same blocks as the in-memory pipeline, byte-identical for any
num_proc, resumable after a kill, a clean stop on a full disk, a no-op when done); verify and
hostile indexes; a store on S3 (moto on loopback)."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import core.data.prepare as prepare_mod
import core.data.store as store_mod
import core.data.writer as writer_mod
from core.config import DataConfig
from core.data import DataError, build_dataset
from core.data.prepare import prepare
from core.data.store import INDEX, StoreError, StoreIndex, verify_store
from core.data.store_reader import TokenStore
from core.data.writer import JOURNAL, StoreWriteError, _Out
from launcher import exit_codes
from launcher import prepare as prepare_cli
from tests.launch import child_env, kill_tree, launcher_cmd, run

SEQ = 16
SHARD = 512  # 16 blocks of 16 uint16 tokens
PIECE = 4096  # prepare's smallest piece: sources here span several
WORDS = "the store keeps ünïcödé 日本語 🎉 tokens in\tblocks of sixteen so that resume is O(1)"


# -- corpus -----------------------------------------------------------------------------------
def doc(rng: random.Random) -> str:
    words = WORDS.split(" ")
    return " ".join(rng.choice(words) for _ in range(rng.randint(1, 24)))


def jsonl(rng: random.Random, rows: int, newline: str = "\n", last_newline: bool = True) -> bytes:
    """Rows with text, empty text, null text, no text key, blank lines, ASCII and raw UTF-8."""
    lines = []
    for i in range(rows):
        r = rng.random()
        if r < 0.05:
            row: dict = {"text": None, "id": i}
        elif r < 0.1:
            row = {"text": "", "id": i}
        elif r < 0.13:
            row = {"id": i}
        else:
            row = {"text": doc(rng), "id": i}
        lines.append(json.dumps(row, ensure_ascii=rng.random() < 0.5))
        if r > 0.97:
            lines.append("  ")
    text = newline.join(lines) + (newline if last_newline else "")
    return text.encode()


def boundary_text() -> bytes:
    """A text file whose line ends fall on prepare's piece boundaries in every awkward way: a CRLF
    split across one, a 3-byte character across the next, a lone CR at the last byte of a piece,
    a LF there; lines end in LF, CRLF and CR."""
    rng = random.Random(3)
    out = bytearray()

    def lines(count: int, end: str) -> None:
        for _ in range(count):
            out.extend((doc(rng) + end).encode())

    def pad(to: int) -> None:
        assert len(out) < to
        out.extend(b"y" * (to - len(out)))

    lines(30, "\n")
    pad(PIECE - 1)
    out.extend(b"\r\n")  # CR is the last byte of piece 0, LF the first of piece 1
    lines(30, "\r\n")
    pad(2 * PIECE - 1)
    out.extend("日 wide\n".encode())  # bytes 8191..8193: across the boundary
    lines(30, "\r")
    pad(3 * PIECE - 1)
    out.extend(b"\rz\n")  # a lone CR ends piece 2
    lines(30, "\n")
    pad(4 * PIECE - 1)
    out.extend(b"\n")  # a LF ends piece 3
    lines(20, "\r\n")
    out.extend(b"last line, no newline")
    return bytes(out)


def make_corpus(root: Path) -> SimpleNamespace:
    rng = random.Random(0)
    (root / "jsonl").mkdir()
    (root / "jsonl" / "0.jsonl").write_bytes(jsonl(rng, 160))
    (root / "jsonl" / "1.jsonl").write_bytes(jsonl(rng, 160, newline="\r\n"))
    (root / "jsonl" / "2.jsonl").write_bytes(jsonl(rng, 110, last_newline=False))
    (root / "jsonl" / "3.jsonl").write_bytes(b"")
    (root / "text").mkdir()
    (root / "text" / "a.txt").write_bytes(boundary_text())
    odd = "\ufefffirst\rsecond\r\nthird\n\n\nform\x0cfeed nel\x85 ls\u2028 ps\u2029 end"
    (root / "text" / "b.txt").write_bytes(odd.encode())
    (root / "parquet").mkdir()
    for k in range(2):
        texts = [None if i % 17 == 0 else "" if i % 23 == 0 else doc(rng) for i in range(150)]
        table = pa.table({"id": list(range(150)), "text": texts})
        pq.write_table(table, root / "parquet" / f"{k}.parquet", row_group_size=40)
    jsonl_bytes = sum(p.stat().st_size for p in (root / "jsonl").iterdir())
    assert jsonl_bytes > 5 * PIECE  # several pieces, and so several workers' worth
    return SimpleNamespace(
        root=root,
        jsonl=root / "jsonl" / "*.jsonl",
        text=root / "text" / "*.txt",
        parquet=root / "parquet" / "*.parquet",
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> SimpleNamespace:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory) -> str:
    """data.tokenizer for a tiny byte-level BPE trained here (tests/hf_assets.py)."""
    pytest.importorskip("transformers")
    from tests.hf_assets import corpus_lines, make_tokenizer

    path = make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer", corpus_lines(200))
    return f"hf:{path}"


def data_cfg(source: object, store: object, **kw: object) -> DataConfig:
    values: dict = {"seq_len": SEQ, "shard_bytes": SHARD, **kw}
    return DataConfig(source=str(source), store=str(store), **values)


def cli_args(source: object, store: object, *extra: str) -> list[str]:
    return [
        *("--data.source", str(source), "--data.store", str(store)),
        *("--data.seq_len", str(SEQ), "--data.shard_bytes", str(SHARD), *extra),
    ]


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root (hidden ones too) by relative path."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> SimpleNamespace:
    """The jsonl corpus prepared once, uninterrupted, with byte tokens."""
    path = tmp_path_factory.mktemp("reference") / "store"
    index = prepare(data_cfg(corpus.jsonl, path), progress=False)
    assert len(index.shards) >= 5
    return SimpleNamespace(path=path, files=snapshot(path), index=index)


@pytest.fixture
def cli(monkeypatch, caplog):
    """`python -m launcher prepare ARGS` in this process (its log kept in caplog)."""
    monkeypatch.setattr(prepare_cli, "setup_logging", lambda *a, **k: None)
    caplog.set_level(logging.INFO)
    return lambda *args: prepare_cli.main(["--no-progress", *args])


class Killed(BaseException):
    """Stands for SIGKILL: nothing in prepare may catch it."""


def crash_at(monkeypatch, fault: str) -> None:
    """Kill prepare as it starts writing store file `fault` ("journal N": the Nth journal
    write), leaving half a file under the temporary name, as a kill mid-write does."""
    write, journals = _Out.write, []

    def crashing(self, name, parts):
        if name == JOURNAL:
            journals.append(name)
        if name == fault or (name == JOURNAL and fault == f"journal {len(journals)}"):
            Path(self.path(f".{name}.tmp")).write_bytes(b"\xff" * 7)
            raise Killed
        write(self, name, parts)

    def crashing_stream(self, name):
        if name == fault:
            Path(self.path(f".{name}.tmp")).write_bytes(b"\xff" * 7)
            raise Killed
        return stream(self, name)

    stream = _Out.stream
    monkeypatch.setattr(_Out, "write", crashing)
    monkeypatch.setattr(_Out, "stream", crashing_stream)


# -- prepare: the same blocks as the in-memory pipeline ---------------------------------------
def in_memory_blocks(cfg: DataConfig) -> np.ndarray:
    ds = build_dataset(cfg)
    flat = ds.data.column("input_ids").combine_chunks().flatten()
    return flat.to_numpy(zero_copy_only=False).reshape(len(ds), cfg.seq_len)


@pytest.mark.parametrize("tokenizer", ["bytes", "hf"])
@pytest.mark.parametrize("kind", ["jsonl", "text", "parquet", "stdlib"])
def test_prepare_packs_like_the_in_memory_pipeline(kind, tokenizer, corpus, tmp_path, request):
    spec = "bytes" if tokenizer == "bytes" else request.getfixturevalue("hf_tokenizer")
    source = "stdlib" if kind == "stdlib" else getattr(corpus, kind)
    cfg = data_cfg(source, tmp_path / "store", tokenizer=spec, max_bytes=30_000)
    index = prepare(cfg, progress=False)
    expected = in_memory_blocks(cfg)
    blocks = TokenStore(cfg.store).read(range(len(expected)))
    assert index.blocks == len(expected) and len(index.shards) >= 3
    assert blocks.dtype == np.dtype(index.dtype)
    assert np.array_equal(blocks, expected)
    verify_store(cfg.store)


def test_prepare_is_byte_identical_for_any_num_proc(corpus, tmp_path, hf_tokenizer):
    stores = {}
    for procs in (1, 2):
        cfg = data_cfg(
            corpus.jsonl, tmp_path / f"np{procs}", tokenizer=hf_tokenizer, num_proc=procs
        )
        index = prepare(cfg, progress=False)
        stores[procs] = snapshot(Path(cfg.store))
    assert len(index.shards) >= 3
    assert list(stores[2]) == list(stores[1]) and stores[2] == stores[1]


# -- prepare: resumable -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fault", "committed"),
    [("shard-00003.bin", 3), ("shard-00003.sum", 3), ("journal 4", 3), ("shard-00020.bin", 20)],
)
def test_prepare_resumes_after_a_crash(
    fault, committed, corpus, reference, tmp_path, monkeypatch, caplog
):
    cfg = data_cfg(corpus.jsonl, tmp_path / "store")
    store = Path(cfg.store)
    with monkeypatch.context() as m:
        crash_at(m, fault)
        with pytest.raises(Killed):
            prepare(cfg, progress=False)
    assert not (store / INDEX).exists()
    journal = json.loads((store / JOURNAL).read_text())
    assert len(journal["shards"]) == committed
    written: list[str] = []

    def recording(self, name):
        written.append(name)
        return stream(self, name)

    stream = _Out.stream
    caplog.set_level(logging.INFO)
    with monkeypatch.context() as m:
        m.setattr(_Out, "stream", recording)
        prepare(cfg, progress=False)
    assert f"continuing after {committed} committed shard(s)" in caplog.text
    shards = [n for n in written if n.endswith(".bin")]
    assert shards[0] == f"shard-{committed:05d}.bin"  # the committed ones are kept, not redone
    assert snapshot(store) == reference.files


def test_cli_prepare_killed_and_relaunched(corpus, tmp_path):
    store = tmp_path / "store"
    args = ["prepare", "--no-progress", *cli_args(corpus.jsonl, store)]
    args[args.index("--data.shard_bytes") + 1] = "96"  # 3 blocks: hundreds of shards
    expected = tmp_path / "expected"
    prepare(data_cfg(corpus.jsonl, expected, shard_bytes=96), progress=False)
    proc = subprocess.Popen(
        launcher_cmd(None, args),
        cwd=tmp_path,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if json.loads((store / JOURNAL).read_bytes())["shards"]:
                    break
            except FileNotFoundError:
                pass
            time.sleep(0.002)
    finally:
        kill_tree(proc)
    assert proc.returncode == -signal.SIGKILL
    assert not (store / INDEX).exists(), "the kill came after prepare finished: nothing tested"
    result = run(launcher_cmd(None, args), cwd=tmp_path)
    assert result.returncode == 0, result.output
    assert "continuing after" in result.output
    assert snapshot(store) == snapshot(expected)


# -- prepare: full disk, unwritable store -----------------------------------------------------
class FullDisk(io.FileIO):
    """A file on a disk that fills up halfway through the first write."""

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        super().write(view[: len(view) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def fill_disk_at(monkeypatch, name: str) -> None:
    """Writing store file `name` (under its temporary name) runs out of space."""

    def fake_open(path, mode="r", *args, **kwargs):
        if os.path.basename(path) == f".{name}.tmp":
            return FullDisk(path, "wb")
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(writer_mod, "open", fake_open, raising=False)


@pytest.mark.parametrize(
    ("name", "kept"), [("shard-00002.bin", 2), ("shard-00002.sum", 2), (INDEX, None)]
)
def test_full_disk_stops_cleanly_and_a_rerun_completes(
    name, kept, corpus, reference, tmp_path, monkeypatch
):
    cfg = data_cfg(corpus.jsonl, tmp_path / "store")
    store = Path(cfg.store)
    with monkeypatch.context() as m:
        fill_disk_at(m, name)
        with pytest.raises(StoreWriteError, match="No space left.*relaunch"):
            prepare(cfg, progress=False)
    assert not (store / INDEX).exists()
    assert not list(store.glob(".*.tmp")), "a half-written file was left behind"
    journal = json.loads((store / JOURNAL).read_text())
    kept = len(reference.index.shards) if kept is None else kept
    assert [s["name"] for s in journal["shards"]] == [f"shard-{k:05d}.bin" for k in range(kept)]
    for k in range(kept):  # the committed shards are whole
        assert (store / f"shard-{k:05d}.bin").read_bytes() == reference.files[f"shard-{k:05d}.bin"]
    prepare(cfg, progress=False)
    assert snapshot(store) == reference.files


def test_cli_store_write_failures_exit_4(corpus, tmp_path, cli, monkeypatch, caplog):
    with monkeypatch.context() as m:
        fill_disk_at(m, "shard-00002.bin")
        assert cli(*cli_args(corpus.jsonl, tmp_path / "store")) == exit_codes.STORAGE
    assert "No space left" in caplog.text and not (tmp_path / "store" / INDEX).exists()
    (tmp_path / "a-file").write_text("not a directory")
    assert cli(*cli_args(corpus.jsonl, tmp_path / "a-file" / "store")) == exit_codes.STORAGE
    assert cli(*cli_args(corpus.jsonl, tmp_path / "store")) == exit_codes.OK


def test_cli_unreachable_store_exits_4(corpus, tmp_path, cli, monkeypatch, caplog):
    pytest.importorskip("s3fs")
    from tests.conftest import free_port

    for k, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x"}.items():
        monkeypatch.setenv(k, v)
    options = (
        f"{{endpoint_url: 'http://127.0.0.1:{free_port()}', skip_instance_cache: true, "
        "config_kwargs: {retries: {max_attempts: 1}, connect_timeout: 1}}"
    )
    args = cli_args(corpus.jsonl, "s3://nowhere/store", "--data.storage_options", options)
    assert cli(*args) == exit_codes.STORAGE
    assert "Could not connect" in caplog.text and "s3://nowhere/store" in caplog.text


# -- prepare: again, or over another store ----------------------------------------------------
def test_prepare_again_on_a_finished_store_is_a_no_op(
    corpus, reference, tmp_path, cli, monkeypatch
):
    store = Path(shutil.copytree(reference.path, tmp_path / "store"))
    stamps = {p: p.stat().st_mtime_ns for p in store.iterdir()}

    def no_write(self, name, parts):
        raise AssertionError(f"prepare wrote {name} into a finished store")

    monkeypatch.setattr(_Out, "write", no_write)
    assert cli(*cli_args(corpus.jsonl, store)) == exit_codes.OK
    assert snapshot(store) == reference.files
    assert {p: p.stat().st_mtime_ns for p in store.iterdir()} == stamps


def test_prepare_over_a_store_of_other_inputs_exits_2(corpus, reference, tmp_path, cli, caplog):
    store = Path(shutil.copytree(reference.path, tmp_path / "store"))
    source = Path(shutil.copytree(corpus.jsonl.parent, tmp_path / "jsonl"))
    with open(source / "1.jsonl", "a") as f:
        f.write('{"text": "one more row"}\n')
    assert cli(*cli_args(source / "*.jsonl", store)) == exit_codes.USAGE
    assert "already holds a store" in caplog.text
    assert cli(*cli_args(corpus.jsonl, store), "--data.seq_len", "32") == exit_codes.USAGE
    assert cli(*cli_args(corpus.text, store)) == exit_codes.USAGE
    assert snapshot(store) == reference.files


def test_resuming_with_changed_sources_is_refused(corpus, tmp_path, monkeypatch, cli, caplog):
    source = Path(shutil.copytree(corpus.jsonl.parent, tmp_path / "jsonl"))
    cfg = data_cfg(source / "*.jsonl", tmp_path / "store")
    with monkeypatch.context() as m:
        crash_at(m, "shard-00003.bin")
        with pytest.raises(Killed):
            prepare(cfg, progress=False)
    assert json.loads((Path(cfg.store) / JOURNAL).read_text())["shards"]
    data = (source / "0.jsonl").read_bytes()
    changed = data.replace(b"store", b"stork", 1)  # the same size: only its hash differs
    assert changed != data and len(changed) == len(data)
    (source / "0.jsonl").write_bytes(changed)
    with pytest.raises(DataError, match="unfinished prepare"):
        prepare(cfg, progress=False)
    assert cli(*cli_args(source / "*.jsonl", cfg.store)) == exit_codes.USAGE


# -- verify -----------------------------------------------------------------------------------
def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (lambda s: flip(s / "shard-00001.bin", 300), "shard-00001.bin"),
        (lambda s: (s / "shard-00002.bin").unlink(), "shard-00002.bin"),
        (lambda s: flip(s / "shard-00003.sum", 5), "shard-00003.sum"),
        (lambda s: (s / "shard-00004.sum").unlink(), "shard-00004.sum"),
        (lambda s: os.truncate(s / "shard-00000.bin", 100), "shard-00000.bin"),
    ],
    ids=["flipped", "deleted", "flipped-sum", "deleted-sum", "truncated"],
)
def test_verify_names_the_damaged_shard(damage, named, reference, tmp_path, cli, caplog, capsys):
    store = Path(shutil.copytree(reference.path, tmp_path / "store"))
    assert cli("--verify", str(store)) == exit_codes.OK
    assert f"OK, {len(reference.index.shards)} shard(s)" in capsys.readouterr().out
    damage(store)
    assert cli("--verify", str(store)) == exit_codes.CHECKPOINT
    assert named in caplog.text
    with pytest.raises(StoreError, match=named):
        verify_store(str(store))


def hostile(index: dict, outside: Path) -> dict[str, object]:
    """index.json variants a store must refuse (each a whole file's content)."""
    last = dict(index["shards"][-1])
    cases: dict[str, object] = {}

    def case(name: str, change) -> None:
        ix = json.loads(json.dumps(index))
        cases[name] = change(ix) or ix

    case("parent path", lambda ix: ix["shards"][0].update(name="../x.bin"))
    case("absolute path", lambda ix: ix["shards"][0].update(name=str(outside)))
    case("swapped names", lambda ix: ix["shards"][0].update(name=ix["shards"][1]["name"]))
    case("negative blocks", lambda ix: ix["shards"][-1].update(blocks=-1))
    case("blocks as text", lambda ix: ix["shards"][-1].update(blocks=str(last["blocks"])))

    def bool_blocks(ix: dict) -> None:  # True == 1: only the type is wrong
        ix["shards"][-1].update(blocks=True, bytes=2 * SEQ)
        ix["blocks"] += 1 - last["blocks"]

    case("blocks as bool", bool_blocks)
    case("bytes as float", lambda ix: ix["shards"][-1].update(bytes=float(last["bytes"])))
    case("bytes too big", lambda ix: ix["shards"][-1].update(bytes=last["bytes"] + 2))
    case("short shard", lambda ix: ix["shards"][0].update(blocks=1, bytes=2 * SEQ))
    case("bad hash", lambda ix: ix["shards"][0].update(hash="../" + "0" * 61))
    case("shard not object", lambda ix: ix["shards"].__setitem__(0, "shard-00000.bin"))
    case("no shards", lambda ix: ix.update(shards=[]))
    case("seq_len as text", lambda ix: ix.update(seq_len="16"))
    case("seq_len as bool", lambda ix: ix.update(seq_len=True))
    case("zero chunk", lambda ix: ix.update(chunk_bytes=0))
    case("dtype", lambda ix: ix.update(dtype="object"))
    case("totals", lambda ix: ix.update(blocks=ix["blocks"] + 1))
    case("version", lambda ix: ix.update(version=2))
    case("hash name", lambda ix: ix.update(hash="md5"))
    case("tokenizer", lambda ix: ix.update(tokenizer="bytes"))
    case("top-level list", lambda ix: [ix])
    cases["not json"] = b'{"format": "token-store",'
    cases["not utf-8"] = b"\xff\xfe{}"
    return cases


_OPENED: list[str] | None = None
_AUDITING = False


def _audit(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.path.abspath(os.fsdecode(args[0])))


@pytest.fixture
def opened():
    """The paths this process opens during the test (a Python audit hook)."""
    global _OPENED, _AUDITING
    if not _AUDITING:
        sys.addaudithook(_audit)  # a hook cannot be removed: it records only while active
        _AUDITING = True
    _OPENED = []
    yield _OPENED
    _OPENED = None


def test_hostile_index_is_refused_and_nothing_outside_is_read(reference, tmp_path, opened):
    outside = tmp_path / "x.bin"
    outside.write_bytes(reference.files["shard-00000.bin"])
    index = json.loads(reference.files[INDEX])
    StoreIndex.parse(json.dumps(index).encode(), "ok")  # the unaltered index parses
    for name, content in hostile(index, outside).items():
        store = tmp_path / name.replace(" ", "-") / "store"
        store.mkdir(parents=True)
        for f in ("shard-00000.bin", "shard-00000.sum"):
            (store / f).write_bytes(reference.files[f])
        text = content if isinstance(content, bytes) else json.dumps(content).encode()
        (store / INDEX).write_bytes(text)
        with pytest.raises(StoreError):
            StoreIndex.parse(text, name)
        opened.clear()
        with pytest.raises(StoreError):
            verify_store(str(store))
        with pytest.raises(StoreError):
            TokenStore(str(store)).read([0])
        mine = [p for p in opened if p.startswith(str(tmp_path)) and Path(p).name != INDEX]
        assert mine == [], name  # index.json alone: no shard, nothing outside the store


def test_oversized_index_is_refused_before_it_is_read(reference, tmp_path, monkeypatch):
    store = Path(shutil.copytree(reference.path, tmp_path / "store"))
    monkeypatch.setattr(store_mod, "MAX_INDEX_BYTES", 100)
    with pytest.raises(StoreError, match="more than any index"):
        TokenStore(str(store))


# -- S3 ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("moto")
    from tests.objectstore import S3Server

    server = S3Server()
    yield server
    server.stop()


def s3_options(s3) -> dict[str, str]:
    return {"key": "testing", "secret": "testing", "endpoint_url": s3.endpoint}


S3_SHARD, S3_CHUNK = 2048, 400  # 64 blocks a shard, in 6 chunks: blocks run across chunks


@pytest.fixture(scope="module")
def s3_store(s3, corpus, tmp_path_factory) -> SimpleNamespace:
    """The jsonl corpus uploaded to S3 and prepared into an S3 store, and the same prepared
    locally, with chunks of 400 bytes (12.5 blocks)."""
    fs, opts = s3.fs(), s3_options(s3)
    s3.bucket("corpus")
    for p in sorted(corpus.jsonl.parent.iterdir()):
        fs.pipe_file(f"corpus/data/{p.name}", p.read_bytes())
    url = s3.bucket("stores") + "/store"
    local = tmp_path_factory.mktemp("s3-local") / "store"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(prepare_mod, "CHUNK_BYTES", S3_CHUNK)
        cfg = data_cfg("s3://corpus/data/*.jsonl", url, storage_options=opts, shard_bytes=S3_SHARD)
        index = prepare(cfg, progress=False)
        prepare(data_cfg(corpus.jsonl, local, shard_bytes=S3_SHARD), progress=False)
    blocks = TokenStore(str(local)).read(range(index.blocks))
    return SimpleNamespace(url=url, opts=opts, fs=fs, index=index, local=local, blocks=blocks)


def test_s3_store_equals_a_local_store(s3_store):
    fs, url = s3_store.fs, s3_store.url
    objects = {p.rsplit("/", 1)[-1]: fs.cat_file(p) for p in fs.find(url[len("s3://") :])}
    assert objects == snapshot(s3_store.local)  # byte for byte, no journal, no temporary
    assert s3_store.index.chunk_bytes == S3_CHUNK and s3_store.index.blocks_per_shard == 64
    assert len(s3_store.index.shards) >= 3
    verify_store(url, s3_store.opts)


def test_s3_store_reads_verified_chunks_through_a_bounded_cache(s3_store, monkeypatch):
    ix, cache = s3_store.index, 3 * S3_CHUNK
    fetched: list[int] = []

    def counted(store: TokenStore) -> TokenStore:
        store._open()
        cat_ranges = store._fs.cat_ranges

        def counting(paths, starts, ends, **kw):
            fetched.extend(starts)
            return cat_ranges(paths, starts, ends, **kw)

        monkeypatch.setattr(store._fs, "cat_ranges", counting)
        return store

    store = counted(TokenStore(s3_store.url, s3_store.opts, cache_bytes=cache))
    store.read([0])
    fetched.clear()
    store.read([0, 1])
    assert fetched == []  # from the cache
    order = np.random.default_rng(0).permutation(ix.blocks)[:240]
    for batch in np.array_split(order, 12):
        assert np.array_equal(store.read(batch), s3_store.blocks[batch])
        assert sum(map(len, store._cache.values())) == store._cached <= cache
    fresh = counted(TokenStore(s3_store.url, s3_store.opts, cache_bytes=cache))
    fetched.clear()
    for i in range(64, 192):  # shards 1 and 2 block by block: each chunk fetched once
        assert np.array_equal(fresh.read([i]), s3_store.blocks[[i]])
    assert sorted(fetched) == sorted(2 * list(range(0, S3_SHARD, S3_CHUNK)))
    copy = pickle.loads(pickle.dumps(store))  # as a DataLoader worker gets it
    assert np.array_equal(copy.read(range(ix.blocks)), s3_store.blocks)


def test_s3_flipped_byte_is_caught_when_its_chunk_is_read(s3_store, cli, caplog):
    path = f"{s3_store.url[len('s3://') :]}/shard-00002.bin"
    good = s3_store.fs.cat_file(path)
    bad = bytearray(good)
    bad[450] ^= 0x10  # in chunk 1 (bytes 400..799) of shard 2: block 14 of the shard
    s3_store.fs.pipe_file(path, bytes(bad))
    try:
        store = TokenStore(s3_store.url, s3_store.opts, cache_bytes=0)
        assert np.array_equal(store.read([128, 129]), s3_store.blocks[[128, 129]])  # chunk 0
        with pytest.raises(StoreError, match=r"shard-00002\.bin .* bytes 400\.\.800"):
            store.read([128 + 14])
        with pytest.raises(StoreError, match=r"shard-00002\.bin"):
            verify_store(s3_store.url, s3_store.opts)
        options = json.dumps(s3_store.opts)
        args = ("--verify", s3_store.url, "--data.storage_options", options)
        assert cli(*args) == exit_codes.CHECKPOINT
        assert "shard-00002.bin" in caplog.text
    finally:
        s3_store.fs.pipe_file(path, good)
