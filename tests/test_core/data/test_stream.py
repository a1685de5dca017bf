"""Iterable (streaming) datasets: dealt evenly to ranks, exact resume from the dataset's state
where it has one, by replaying the stream otherwise."""

from __future__ import annotations

import gc
import itertools
import json
import logging
import shutil
import threading

import datasets
import pytest
import torch
from torch.utils.data import IterableDataset

from checkpointing.serialize import load_state
from core.config import ConfigError, DataConfig, load_config
from core.data import build_dataset
from core.data.stream import StreamPosition, _Shard
from core.trainer import Trainer
from tests.checkpoints import assert_tensors_equal, load_entry
from tests.launch import SMALL, read_metrics

ROWS = build_dataset(DataConfig(seq_len=32, max_bytes=100 * 32))["input_ids"]


class ByteStream(IterableDataset):
    """100 rows of 32 bytes, read in order: 12 full batches of 8 per pass."""

    def __iter__(self):
        for row in ROWS:
            yield {"input_ids": row}


def test_shard_deals_whole_groups_evenly():
    shards = [list(_Shard(range(11), skip=2, rank=r, world=3)) for r in range(3)]
    assert shards == [[2, 5, 8], [3, 6, 9], [4, 7, 10]]
    shards = [list(_Shard(range(12), skip=2, rank=r, world=3)) for r in range(3)]
    assert shards == [[2, 5, 8], [3, 6, 9], [4, 7, 10]]  # the incomplete last group is dropped


def run(run_dir, dataset, *overrides):
    config = load_config(
        None,
        [
            *SMALL,
            "--run.output_dir",
            str(run_dir),
            "--train.max_steps",
            "20",
            "--checkpoint.save_steps",
            "4",
            *overrides,
        ],
    )
    return Trainer(args=config, train_dataset=dataset).train()


def untimed(run_dir):
    return [(m["step"], m["loss"], m["epoch"]) for m in read_metrics(run_dir)]


@pytest.mark.parametrize("step", [4, 16])  # mid first pass; after the stream restarted
def test_stream_resume_is_exact(tmp_path, step):
    ref, res = tmp_path / "ref", tmp_path / "res"
    result = run(ref, ByteStream())
    assert result.global_step == 20
    assert [e for _, _, e in untimed(ref)][11:13] == [0.0, 1.0]  # 12 steps a pass, then epoch 1
    res.mkdir()
    shutil.copytree(ref / f"checkpoint-{step}", res / f"checkpoint-{step}")
    run(res, ByteStream())
    assert untimed(res)[-(20 - step) :] == untimed(ref)[step:]
    for name in ("model", "optimizer"):
        assert_tensors_equal(
            load_entry(ref / "checkpoint-20", name), load_entry(res / "checkpoint-20", name), name
        )


def test_hugging_face_iterable_dataset(tmp_path):
    stream = datasets.Dataset.from_dict({"input_ids": ROWS}).to_iterable_dataset()
    result = run(tmp_path, stream, "--train.max_steps", "6")
    assert result.global_step == 6


@pytest.mark.parametrize(
    ("override", "key"),
    [
        (("--data.num_workers", "2"), "data.num_workers"),
        (("--train.max_steps", "null", "--train.num_epochs", "1"), "train.max_steps"),
    ],
)
def test_stream_refuses_what_it_cannot_do(tmp_path, override, key):
    with pytest.raises(ConfigError, match=key):
        run(tmp_path, ByteStream(), *override)


def test_torch_stream_tensor_rows(tmp_path):
    class Tensors(IterableDataset):
        def __iter__(self):
            for row in ROWS[:40]:
                yield {"input_ids": torch.tensor(row).tolist()}

    assert run(tmp_path, Tensors(), "--train.max_steps", "3").global_step == 3


# -- resuming from the dataset's own state -------------------------------------------------------
N = 103  # items of `numbers`: not a multiple of any world size or batch below


def numbers(read: list[int] | None = None) -> datasets.IterableDataset:
    """0..N-1 from 4 shards; `read` receives every item the pipeline takes from them."""
    stream = datasets.Dataset.from_dict({"i": list(range(N))}).to_iterable_dataset(num_shards=4)
    if read is None:
        return stream
    return stream.map(lambda row: read.append(row["i"]) or row)


def ids(items):
    return [x["i"] for x in items]


def uninterrupted(dataset, rank, world, epoch):
    """This rank's items of a whole epoch, without any position or state machinery."""
    dataset.set_epoch(epoch)
    return ids(_Shard(dataset, 0, rank, world))


def read_then_save(make, world, batch, steps, epoch=0):
    """Every rank reads `steps` optimizer steps of `batch` items and one batch more (the loop
    reads ahead of the position it consumed); rank 0's sampler state, through JSON."""
    saved = None
    for rank in range(world):
        position = StreamPosition(world, rank, batch, seed=0)
        position.set_epoch(epoch)
        reader = iter(position.shard(make()))
        for _ in range(steps):
            list(itertools.islice(reader, batch))
            position.advance(batch * world)
        list(itertools.islice(reader, batch))
        if rank == 0:
            saved = json.loads(json.dumps(position.state_dict()))
    return saved


def resume(saved, make, world, rank, batch):
    position = StreamPosition(world, rank, batch, seed=0)
    position.load_state_dict(saved)
    return iter(position.shard(make()))


@pytest.mark.parametrize("epoch", [0, 1])
@pytest.mark.parametrize("world", [1, 2])
def test_hf_stream_resumes_from_its_state(world, epoch):
    batch, steps = 4, 6
    saved = read_then_save(lambda: numbers([]), world, batch, steps, epoch)
    at = steps * batch * world
    assert saved["position"] == saved["dataset"]["position"] == at  # not the read-ahead
    assert saved["dataset"]["state"]["epoch"] == epoch
    for rank in range(world):
        read: list[int] = []
        reader = resume(saved, lambda read=read: numbers(read), world, rank, batch)
        first = ids(itertools.islice(reader, batch))
        # Read from the saved shard and example: one step's items, not the `at` before them.
        assert read == list(range(at, at + batch * world))
        assert first + ids(reader) == uninterrupted(numbers(), rank, world, epoch)[at // world :]


def test_hf_stream_state_names_its_shard():
    saved = read_then_save(numbers, world=1, batch=10, steps=6)  # 60 items: shard 2 of 4
    inner = saved["dataset"]["state"]["examples_iterable"]
    assert (inner["examples_iterable"]["shard_idx"], inner["batch_idx"]) == (2, 60)


@pytest.fixture
def hf_prefetch_threads():
    """Waits for the threads HF's multi-shard readers prefetch with: a reader left unfinished
    keeps its pool until it is collected."""
    before = set(threading.enumerate())
    yield
    gc.collect()
    for thread in set(threading.enumerate()) - before:
        if thread.name.startswith("ThreadPoolExecutor"):
            thread.join(timeout=10)


@pytest.mark.usefixtures("hf_prefetch_threads")
def test_hf_shuffle_buffer_resumes_by_rereading(caplog):
    def shuffled(read=None):
        return numbers(read).shuffle(seed=3, buffer_size=16)

    with caplog.at_level(logging.WARNING, logger="core.data.stream"):
        saved = read_then_save(shuffled, world=1, batch=4, steps=5)
    assert saved["dataset"] is None
    assert [r.getMessage().count("shuffle buffer") for r in caplog.records] == [1]
    read: list[int] = []
    resumed = ids(resume(saved, lambda: shuffled(read), 1, 0, 4))
    assert resumed == uninterrupted(shuffled(), 0, 1, 0)[20:]
    assert len(read) == N  # every item again, the 20 before the position included


def test_checkpoint_without_dataset_state_still_loads():
    old = {"kind": "stream", "epoch": 0, "position": 40, "seed": 0}  # before states were kept
    for rank in range(2):
        read: list[int] = []
        resumed = ids(resume(old, lambda read=read: numbers(read), 2, rank, 4))
        assert resumed == uninterrupted(numbers(), rank, 2, 0)[20:]
        assert read[:40] == list(range(40))  # re-read and discarded


class Countdown(IterableDataset):
    """A torch stream with a state of its own: `state_dict` gives `as_state(next item)`."""

    def __init__(self, as_state=lambda n: {"next": n}) -> None:
        self.next, self.start, self.as_state, self.read = 0, 0, as_state, 0

    def __iter__(self):
        for n in range(self.start, 50):
            self.next, self.read = n, self.read + 1
            yield {"i": n}
        self.next = 50

    def state_dict(self):
        return self.as_state(self.next + 1)

    def load_state_dict(self, state):
        self.start = state["next"]


def test_torch_stream_with_a_state():
    saved = read_then_save(Countdown, world=1, batch=5, steps=3)
    assert saved["dataset"] == {"position": 15, "state": {"next": 15}}
    dataset = Countdown()
    position = StreamPosition(1, 0, 5, seed=0)
    position.load_state_dict(saved)
    assert ids(position.shard(dataset)) == list(range(15, 50))
    assert dataset.read == 35


def test_state_that_is_not_json_falls_back_to_rereading(caplog):
    def tupled():
        return Countdown(lambda n: {"next": n, "at": (n,)})

    with caplog.at_level(logging.WARNING, logger="core.data.stream"):
        saved = read_then_save(tupled, world=1, batch=5, steps=3)
    assert saved["dataset"] is None
    assert "not plain JSON" in caplog.text
    dataset = tupled()
    position = StreamPosition(1, 0, 5, seed=0)
    position.load_state_dict(saved)
    assert ids(position.shard(dataset)) == list(range(15, 50))
    assert dataset.read == 50


@pytest.mark.parametrize("step", [4, 16])
def test_trainer_resumes_hf_stream_from_its_state(tmp_path, step):
    def stream(read):
        rows = datasets.Dataset.from_dict({"input_ids": ROWS}).to_iterable_dataset(num_shards=4)
        return rows.map(lambda row: read.append(1) or row)

    ref, res = tmp_path / "ref", tmp_path / "res"
    ref_read, res_read = [], []
    run(ref, stream(ref_read))
    sampler = load_state(ref / f"checkpoint-{step}", "sampler")
    assert sampler["dataset"]["position"] == sampler["position"] > 0
    res.mkdir()
    shutil.copytree(ref / f"checkpoint-{step}", res / f"checkpoint-{step}")
    run(res, stream(res_read))
    # Nothing before the saved position is read again: not even the epoch's earlier items.
    assert len(res_read) == len(ref_read) - sampler["epoch"] * len(ROWS) - sampler["position"]
    assert untimed(res)[-(20 - step) :] == untimed(ref)[step:]
    for name in ("model", "optimizer"):
        assert_tensors_equal(
            load_entry(ref / "checkpoint-20", name), load_entry(res / "checkpoint-20", name), name
        )
