"""Checkpoints on a real S3-compatible server (moto on 127.0.0.1) through s3fs, 2 processes:
exact resume, async save under SIGKILL, the store going away mid-run, retention, credentials."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest

from checkpointing.cli import main as checkpoint_cli
from checkpointing.manifest import list_committed
from tests.checkpoints import assert_same_losses, assert_tensors_equal, load_entry
from tests.launch import (
    Output,
    kill_tree,
    logged_steps,
    run_launcher,
    start,
    wait_for,
)
from tests.objectstore import FAST_FAIL, S3Server, assert_committed_are_whole, checkpoints_in

pytestmark = pytest.mark.slow

STEPS = 24
ARGS = ("--train.max_steps", str(STEPS), "--train.logging_steps", "1")
# A model whose checkpoint (about 40 MB with AdamW) takes long enough to upload that a kill or
# an outage can land while a background write is in flight.
BIG = ("--model.n_layer", "4", "--model.n_embd", "256", "--model.n_head", "4")


@pytest.fixture(scope="module")
def s3() -> S3Server:
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run, checkpoints on the local disk."""
    ref = tmp_path_factory.mktemp("ref") / "run"
    result = run_launcher(ref, 2, *ARGS, *BIG, "--checkpoint.save_steps", "8")
    assert result.returncode == 0, result.output
    return ref


def in_flight(out: Output) -> bool:
    """A background write is under way: rank 0 logged its staging and not yet its commit."""
    return out.count("writing in the background") > out.count("saved checkpoint-")


def assert_same_final_weights(reference: Path, storage) -> None:
    """Model and optimizer of the final checkpoint in the store equal the reference's."""
    final = storage.child(f"checkpoint-{STEPS}")
    for name in ("model", "optimizer"):
        ours = load_entry(final, name)  # read through the store, each file hashed as read
        assert_tensors_equal(load_entry(reference / f"checkpoint-{STEPS}", name), ours, name)


def test_exact_resume_from_s3_after_sigterm(tmp_path, s3, reference):
    url = s3.bucket("exact") + "/run"
    run_dir = tmp_path / "run"
    # No periodic saves (losses do not depend on them): the preemption's and the final one.
    args = (*ARGS, *BIG, "--checkpoint.dir", url, "--checkpoint.save_steps", "0")
    proc = start(run_dir, 2, *args, env=s3.env())
    try:
        assert wait_for(lambda: logged_steps(run_dir) >= 5, proc)
        proc.send_signal(signal.SIGTERM)  # torchrun forwards it; every rank commits to s3
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert "preempted at step" in out, out
    storage = s3.storage(url)
    (step, name), *_ = list_committed(storage)
    assert 5 <= step < STEPS and not (run_dir / name).exists()  # in the bucket, not on disk
    result = run_launcher(run_dir, 2, *args, env=s3.env())
    assert result.returncode == 0, result.output
    assert f"resumed from {url}/{name}" in result.output
    assert_same_losses(reference, run_dir)
    assert_same_final_weights(reference, storage)


def test_async_save_survives_sigkill_mid_upload(tmp_path, s3, reference):
    url = s3.bucket("async-kill") + "/run"
    storage = s3.storage(url)
    run_dir = tmp_path / "run"
    args = (*ARGS, *BIG, "--checkpoint.dir", url, "--checkpoint.async_save", "true")
    args = (*args, "--checkpoint.save_steps", "3", "--checkpoint.save_total_limit", "2")
    rng = random.Random(7)
    in_flight_kills = 0
    for _ in range(3):
        proc = start(run_dir, 2, *args, env=s3.env())
        out = Output(proc)
        try:
            hit = wait_for(lambda out=out: in_flight(out), proc, timeout=180)
            time.sleep(rng.uniform(0, 0.1))
            in_flight_kills += hit and in_flight(out)
        finally:
            kill_tree(proc)  # torchrun and every worker, by pid
        assert_committed_are_whole(storage)
    assert in_flight_kills >= 2, "the kills missed every background write: nothing was tested"
    for _ in range(3):  # relaunch the same command until done
        result = run_launcher(run_dir, 2, *args, env=s3.env())
        if result.returncode == 0:
            break
    assert result.returncode == 0, result.output
    assert_committed_are_whole(storage)
    assert checkpoints_in(storage) == ([21, 24], [])
    assert_same_losses(reference, run_dir)
    assert_same_final_weights(reference, storage)


def test_store_outage_mid_upload_fails_loudly_then_resumes(tmp_path, s3, reference):
    url = s3.bucket("outage") + "/run"
    storage = s3.storage(url)
    run_dir = tmp_path / "run"
    args = (*ARGS, *BIG, "--checkpoint.dir", url, "--checkpoint.save_steps", "8")
    args = (*args, "--checkpoint.async_save", "true", "--checkpoint.retries", "2")
    args = (*args, "--checkpoint.storage_options", FAST_FAIL)
    proc = start(run_dir, 2, *args, env=s3.env())
    output = Output(proc)
    try:
        # The first background save is uploading: the server goes away under it.
        assert wait_for(lambda: in_flight(output), proc, timeout=180)
        s3.stop()
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
        s3.start()
    out = output.text()
    assert proc.returncode != 0, out
    assert "exitcode: 4" in out, out  # the workers' code: the store failed
    assert "checkpoint-8 was not committed" in out and "failed after 3 attempts" in out, out
    assert checkpoints_in(storage)[0] == []  # nothing committed, nothing broken
    # The store is back: the same command resumes from what was committed and ends exactly.
    result = run_launcher(run_dir, 2, *args, env=s3.env())
    assert result.returncode == 0, result.output
    assert_same_losses(reference, run_dir)
    assert_same_final_weights(reference, storage)


def test_retention_on_s3_keeps_exactly_the_limit(tmp_path, s3, capsys):
    url = s3.bucket("retention") + "/run"
    args = ("--train.max_steps", "10", "--checkpoint.save_steps", "2")
    args = (*args, "--checkpoint.save_total_limit", "2", "--checkpoint.dir", url)
    result = run_launcher(tmp_path / "run", 2, *args, env=s3.env())
    assert result.returncode == 0, result.output
    storage = s3.storage(url)
    assert checkpoints_in(storage) == ([8, 10], [])  # nothing else left, no orphan objects
    assert_committed_are_whole(storage)
    # The inspection commands read the bucket too.
    options = ["--storage-options", f"{{endpoint_url: {s3.endpoint}, key: testing, secret: x}}"]
    assert checkpoint_cli(["list", url, *options]) == 0
    listing = capsys.readouterr().out
    assert "checkpoint-10" in listing and "checkpoint-8" in listing and "committed" in listing
    assert checkpoint_cli(["verify", f"{url}/checkpoint-10", *options]) == 0
    assert "blake3 verified" in capsys.readouterr().out


def test_credentials_are_never_written(tmp_path, s3):
    """Credentials given as storage options reach s3fs, and no file, log line or object."""
    url = s3.bucket("secrets") + "/run"
    secret = "Sup3rS3cretValue-DoNotLeak"
    options = f"{{key: testing, secret: {secret}, endpoint_url: {s3.endpoint}}}"
    run_dir = tmp_path / "run"
    args = ("--train.max_steps", "4", "--checkpoint.dir", url, "--run.report_to", "[jsonl]")
    # No AWS_* variables in this process's environment: the options alone reach the server.
    result = run_launcher(run_dir, 2, *args, "--checkpoint.storage_options", options)
    assert result.returncode == 0, result.output
    assert secret not in result.output
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    assert "<redacted>" in (run_dir / "config.yaml").read_text()
    fs = s3.fs()
    for key in fs.find(url):
        assert secret.encode() not in fs.cat_file(key), key
