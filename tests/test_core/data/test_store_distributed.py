"""Training from a token store under torchrun (gloo): random SIGKILLs of a 2-process run with
DataLoader workers and gradient accumulation end bit-identical to the uninterrupted run; 2 -> 1
and 1 -> 2 ranks see every block once with each step's global batch of the uninterrupted run; a
store on an S3-compatible server (moto, loopback) trains the same steps and resumes exactly; a
corrupt store, another tokenizer or a changed source is refused before the first step."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from core.data.permutation import FeistelPermutation
from tests.checkpoints import assert_same_checkpoint, assert_same_losses, seed_resume_dir
from tests.launch import (
    REPO,
    child_env,
    kill_and_finish,
    last_checkpoint,
    launch,
    read_metrics,
    refused_here,
    run_launcher,
)
from tests.test_elastic import assert_close_run, sample_ids

pytestmark = pytest.mark.slow

STEPS, SAVED, SEED = 45, 12, 42
PER_EPOCH = (625 - 33) // 16  # 37 steps: the run crosses into epoch 1
TINY = str(REPO / "configs" / "tiny.yaml")


def store_flags(store: Path) -> tuple[str, ...]:
    """The store and the corpus and block length it is prepared with: prepare and training
    give the same ones."""
    return (
        "--config",
        TINY,
        "--data.store",
        str(store),
        "--data.max_bytes",
        "20000",
        "--data.seq_len",
        "32",
    )


def prepare_cmd(store: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "launcher",
        "prepare",
        *store_flags(store),
        "--data.shard_bytes",
        "4096",  # 64 blocks a shard: ten shards
        *extra,
    ]


def train_args(store: Path, *extra: str) -> tuple[str, ...]:
    """A 2-rank run from the store: 2 DataLoader workers, accumulation 2, global batch 16."""
    return (
        *store_flags(store),
        "--data.num_workers",
        "2",
        "--train.per_device_batch_size",
        "4",
        "--train.gradient_accumulation_steps",
        "2",
        "--train.max_steps",
        str(STEPS),
        "--train.logging_steps",
        "1",
        "--train.progress_bar",
        "never",
        "--checkpoint.save_steps",
        "6",
        "--model.dropout",
        "0.0",  # dropout masks depend on the rank that draws them: elastic runs compare
        "--run.log_level",
        "debug",  # the sample ids of every step
        "--eval.strategy",
        "steps",
        "--eval.steps",
        "15",
        "--eval.holdout_samples",
        "33",  # the store's last 33 blocks
        *extra,
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("store") / "tokens"
    result = subprocess.run(
        prepare_cmd(path), env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(list(path.glob("shard-*.bin"))) == 10
    return path


@pytest.fixture(scope="module")
def ref(store, tmp_path_factory) -> tuple[Path, str]:
    """The uninterrupted 2-rank run, and its log."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    output = launch(run_dir, train_args(store), {})
    assert "token store" in output and "verified" in output
    assert [m["step"] for m in read_metrics(run_dir) if "eval_loss" in m] == [15, 30, 45]
    return run_dir, output


def test_store_run_draws_the_seeded_bijection_and_each_block_once(store, ref):
    ids = sample_ids(ref[1])
    n = json.loads((store / "index.json").read_text())["blocks"] - 33  # 33 held out
    for epoch, steps in ((0, range(1, PER_EPOCH + 1)), (1, range(PER_EPOCH + 1, STEPS + 1))):
        order = FeistelPermutation(n, SEED, epoch)(list(range(len(steps) * 16))).tolist()
        for k, step in enumerate(steps):  # each step: the next 16 of the epoch's order
            assert sorted(ids[step]) == sorted(order[k * 16 : (k + 1) * 16]), step
        drawn = [i for s in steps for i in ids[s]]
        assert len(set(drawn)) == len(drawn)  # each block once in the epoch
        assert max(drawn) < n  # never a held-out block


def test_sigkills_of_a_store_run_end_bit_identical(store, ref, tmp_path):
    run_dir = tmp_path / "run"
    kill_and_finish(run_dir, train_args(store), {}, ["save", "step"], seed=20)
    assert_same_losses(ref[0], run_dir)
    assert_same_checkpoint(last_checkpoint(ref[0]), last_checkpoint(run_dir))


def test_store_resumes_on_one_rank_then_on_two(store, ref, tmp_path):
    ref_dir, ref_out = ref
    ref_ids = sample_ids(ref_out)
    one = tmp_path / "one"
    seed_resume_dir(ref_dir, one, SAVED)
    resumed = run_launcher(
        one, None, *train_args(store, "--data.num_workers", "0")[2:], config=TINY
    )
    assert resumed.returncode == 0, resumed.output
    assert "keeps the global batch at 16" in resumed.output
    after = sample_ids(resumed.output)
    assert sorted(after) == list(range(SAVED + 1, STEPS + 1))
    for step, ids in after.items():
        assert sorted(ids) == sorted(ref_ids[step]), f"step {step} saw another global batch"
    assert_close_run(ref_dir, one, STEPS)
    # Saved by one rank at step 24, resumed on two.
    two = tmp_path / "two"
    seed_resume_dir(one, two, 24)
    again = run_launcher(two, 2, *train_args(store)[2:], config=TINY)
    assert again.returncode == 0, again.output
    later = sample_ids(again.output)
    assert sorted(later) == list(range(25, STEPS + 1))
    for step, ids in later.items():
        assert sorted(ids) == sorted(ref_ids[step]), f"step {step} saw another global batch"


def test_store_on_s3_resumes_exactly(store, ref, tmp_path):
    pytest.importorskip("s3fs")
    from tests.objectstore import S3Server

    server = S3Server()
    try:
        url = server.bucket("distributed-store") + "/tokens"
        server.fs().put(str(store) + "/", url[len("s3://") :], recursive=True)
        args = train_args(store, "--data.store", url, "--data.store_cache_bytes", "20000")
        args += ("--data.num_workers", "0")  # read in the loop (StoreBatches), not by workers
        resumed = tmp_path / "s3resumed"
        seed_resume_dir(ref[0], resumed, SAVED)  # saved by a run from the local store
        output = launch(resumed, args, server.env())
        assert f"token store {url}" in output
        # Steps 13-45 read from S3 by byte ranges: the very blocks and losses of the local run.
        assert_same_losses(ref[0], resumed)
        assert_same_checkpoint(last_checkpoint(ref[0]), last_checkpoint(resumed))
    finally:
        server.stop()


def _refused(run_dir: Path, store: Path, *extra: str) -> str:
    result = refused_here(run_dir, *train_args(store)[2:], *extra, config=TINY)
    assert not (run_dir / "metrics.jsonl").exists()  # before the first step
    return f"{result.returncode}\n{result.output}"


def test_a_corrupt_or_incomplete_store_is_refused_with_exit_3(store, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(store, bad)
    data = bytearray((bad / "shard-00003.bin").read_bytes())
    data[100] ^= 1
    (bad / "shard-00003.bin").write_bytes(bytes(data))
    out = _refused(tmp_path / "r1", bad)
    assert out.startswith("3\n") and "shard-00003.bin differs" in out, out
    (bad / "shard-00007.bin").unlink()
    shutil.copy(store / "shard-00003.bin", bad / "shard-00003.bin")
    out = _refused(tmp_path / "r2", bad)
    assert out.startswith("3\n") and "shard-00007.bin is missing" in out, out


def test_another_tokenizer_or_a_changed_source_is_refused_with_exit_2(store, hf_assets, tmp_path):
    out = _refused(tmp_path / "r1", store, "--data.tokenizer", f"hf:{hf_assets.tokenizer}")
    assert out.startswith("2\n") and "prepared with tokenizer 'bytes'" in out, out
    assert f"hf:{hf_assets.tokenizer}" in out
    # A store prepared from a file, whose file then changed.
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i} of the corpus\n" for i in range(400)))
    from_file = tmp_path / "from_file"
    cmd = prepare_cmd(from_file, "--data.source", str(corpus))
    assert subprocess.run(cmd, env=child_env(), timeout=120).returncode == 0
    with corpus.open("a") as f:
        f.write("one more line\n")
    out = _refused(tmp_path / "r2", from_file, "--data.source", str(corpus))
    assert out.startswith("2\n") and "corpus.txt changed since" in out, out
