"""Iterable (streaming) datasets: dealt evenly to ranks, exact resume by replaying the stream."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch.utils.data import IterableDataset

from checkpointing.serialize import load_state
from core.config import ConfigError, DataConfig, load_config
from core.data import build_dataset
from core.data.stream import _Shard
from core.trainer import Trainer
from tests.checkpoints import assert_tensors_equal
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
            load_state(ref / "checkpoint-20", name), load_state(res / "checkpoint-20", name), name
        )


def test_hugging_face_iterable_dataset(tmp_path):
    import datasets

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
