"""One writer per run: the lease on a run's checkpoint store (checkpointing/lease.py).

In-process: create-if-absent on a filesystem, memory:// and a real S3-compatible server (moto),
races between would-be holders, takeovers (a dead pid on this host at once, a stale heartbeat
after the timeout), fencing of commits and deletes, unreadable lease files. As processes: two
launches of one command into one run (1 and 2 workers), a job that holds the lease makes a
second one exit 73 without touching the run, and a job frozen with SIGSTOP after staging a save
is taken over and, once resumed, commits nothing.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import fsspec
import pytest
import torch

from checkpointing.holder import Holder
from checkpointing.lease import (
    LEASE,
    Lease,
    LeaseHeld,
    LeaseLost,
    LeaseRecord,
    LeaseUnreadable,
    acquire,
    claim_name,
    read_lease,
    try_acquire,
)
from checkpointing.manager import CheckpointManager, Entry
from checkpointing.manifest import list_committed, read_manifest
from checkpointing.storage import FsspecStorage, Storage, open_storage
from core.reporting.history import AttemptEnd, AttemptStart, read_history
from launcher import exit_codes
from launcher.status import format_status, run_status
from tests.checkpoints import Weights, assert_same_checkpoint, memory_url
from tests.launch import SMALL, Output, kill_tree, last_checkpoint, run_launcher, start, wait_for
from tests.objectstore import S3Server

# 4 samples per rank x 2 micro-batches: 1 and 2 workers can each resume the other's checkpoint.
ARGS = (
    *SMALL,
    "--train.per_device_batch_size",
    "4",
    "--train.gradient_accumulation_steps",
    "2",
    "--train.max_steps",
    "24",
    "--checkpoint.save_steps",
    "4",
    "--checkpoint.async_save",
    "true",
)


def other_holder(host: str = "elsewhere", pid: int = 4242) -> Holder:
    return Holder(host, pid, None, None, "job-7", time.time())


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture(params=["local", "memory", "s3"])
def store(request, tmp_path) -> Storage:
    if request.param == "local":
        return open_storage(tmp_path / "run")
    if request.param == "memory":
        return open_storage(memory_url())
    server = request.getfixturevalue("s3")
    bucket = server.bucket(f"lease-{os.urandom(4).hex()}")
    return server.storage(f"{bucket}/run")


def test_create_if_absent_is_exclusive(store):
    assert store.create_exclusive("x/claim", b"first")
    assert not store.create_exclusive("x/claim", b"second")
    assert store.read_bytes("x/claim") == b"first"


def test_of_jobs_racing_for_a_run_exactly_one_holds_it(store):
    holders = [other_holder("elsewhere", 100 + i) for i in range(6)]
    got: list = [None] * len(holders)
    barrier = threading.Barrier(len(holders))

    def take(i: int) -> None:
        barrier.wait()
        got[i] = try_acquire(store, holders[i], timeout_s=60)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(len(holders))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [g for g in got if isinstance(g, Lease)]
    assert len(winners) == 1, got
    assert all(isinstance(g, LeaseRecord) and g.epoch == 1 for g in got if g is not winners[0])
    assert read_lease(store).holder == winners[0].record.holder


def test_a_dead_holder_on_this_host_is_taken_over_at_once(store):
    gone = Holder.this_process()
    gone = Holder(gone.host, dead_pid(), None, None, None, time.time())
    first = try_acquire(store, gone, timeout_s=3600)
    assert isinstance(first, Lease)
    me = Holder.this_process()
    second = try_acquire(store, me, timeout_s=3600)  # the heartbeat is fresh: the pid decides
    assert isinstance(second, Lease) and second.epoch == 2
    assert read_lease(store).holder == me
    # A live holder is not: this very process holds it now.
    blocked = try_acquire(store, Holder.this_process(), timeout_s=3600)
    assert isinstance(blocked, LeaseRecord) and blocked.holder == me


def test_a_store_without_create_if_absent_gets_an_advisory_lease(tmp_path, caplog):
    fs = fsspec.filesystem("file", auto_mkdir=True)  # through fsspec: no primitive we use
    store = FsspecStorage(fs, str(tmp_path / "run"), f"file-like://{tmp_path}/run")
    with caplog.at_level(logging.WARNING, logger="checkpointing.lease"):
        lease = acquire(store, other_holder(), 0, timeout_s=60, wait_s=0)
    assert "the lease is advisory" in caplog.text
    with pytest.raises(LeaseHeld, match="elsewhere pid 4242"):
        acquire(store, Holder.this_process(), 0, timeout_s=60, wait_s=0)
    lease.release()
    mine = acquire(store, Holder.this_process(), 0, timeout_s=60, wait_s=0)
    assert mine.epoch == 2
    mine.check("committing")
    mine.release()


def test_a_worker_restarted_by_the_same_torchrun_keeps_the_lease_and_epoch(tmp_path):
    store = open_storage(tmp_path / "run")
    host = socket.gethostname()
    before = Holder(host, dead_pid(), None, "run-id/100", None, time.time())
    assert isinstance(try_acquire(store, before, timeout_s=3600), Lease)
    after = Holder(host, os.getpid(), None, "run-id/100", None, time.time())
    kept = try_acquire(store, after, timeout_s=3600)
    assert isinstance(kept, Lease) and kept.epoch == 1 and read_lease(store).holder == after
    other_job = try_acquire(store, Holder(host, 1, None, "run-id/200", None, 0), 3600)
    assert isinstance(other_job, LeaseRecord)  # the holder (this process) lives: it waits


def test_a_stale_heartbeat_is_taken_over_and_the_old_holder_is_fenced(store):
    old = try_acquire(store, other_holder(), timeout_s=5)
    assert isinstance(old, Lease)
    assert isinstance(try_acquire(store, Holder.this_process(), timeout_s=5), LeaseRecord)
    later = time.time() + 6  # the holder on another host stopped renewing 6 s ago
    new = try_acquire(store, Holder.this_process(), timeout_s=5, now=later)
    assert isinstance(new, Lease) and new.epoch == 2
    with pytest.raises(LeaseLost, match="epoch 2"):
        old.check("committing checkpoint-8")
    with pytest.raises(LeaseLost):
        old.renew()
    old.release()  # lost: leaves the new holder's lease alone
    assert read_lease(store) == new.record and not read_lease(store).released
    new.check("committing")  # the new holder is not fenced
    new.release()
    assert read_lease(store).released
    third = try_acquire(store, other_holder(), timeout_s=5)  # released: free at once
    assert isinstance(third, Lease) and third.epoch == 3


def test_a_late_write_of_the_lease_copy_by_a_lost_holder_decides_nothing(store):
    old = try_acquire(store, other_holder(), timeout_s=5)
    new = try_acquire(store, Holder.this_process(), timeout_s=5, now=time.time() + 6)
    store.replace_bytes(LEASE, old.record.to_bytes())  # written by the old holder, paused
    assert read_lease(store).epoch == 2 and read_lease(store).holder == new.record.holder


def test_a_lost_lease_commits_and_deletes_nothing(store):
    lease = try_acquire(store, other_holder(), timeout_s=5)
    manager = CheckpointManager(store, lease=lease)
    weights = Weights(torch.arange(6.0))

    def save(step: int):
        return manager.save(step, {"w": Entry(weights)}, {}, "fp", {}, {})

    save(4)
    assert read_manifest(store.child("checkpoint-4")).lease_epoch == 1
    try_acquire(store, Holder.this_process(), timeout_s=5, now=time.time() + 6)
    with pytest.raises(LeaseLost, match="lost"):
        save(8)
    with pytest.raises(LeaseLost):
        manager.delete("checkpoint-4")
    assert [name for _, name in list_committed(store)] == ["checkpoint-4"]
    assert lease.lost


def test_lease_copies_left_by_a_kill_mid_write_are_cleaned(tmp_path):
    run = tmp_path / "run"
    lease = try_acquire(open_storage(run), Holder.this_process(), 60)
    (run / ".LEASE.99-deadbeef").write_bytes(b"{")
    (run / ".lease" / ".1.99-deadbeef").write_bytes(b"{")
    CheckpointManager(run, lease=lease).clean_leftovers()
    assert sorted(p.name for p in run.iterdir()) == [".lease", "LEASE"]
    assert [p.name for p in (run / ".lease").iterdir()] == ["1"]
    assert read_lease(open_storage(run)) == lease.record


def _hostile_holder() -> bytes:
    record = json.loads(LeaseRecord(1, other_holder(), time.time(), 60).to_bytes())
    record["holder"]["pid"] = "1; rm -rf /"
    return json.dumps(record).encode()


HOSTILE_LEASES = {
    "not-json": b"{not json",
    "other-format": b'{"format": 99, "epoch": 1}',
    "a-list": b"[]",
    "no-fields": b'{"format": 1}',
    "pid-not-a-number": _hostile_holder(),
    "huge": b" " * (1 << 20) + b"{}",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_LEASES))
def test_an_unreadable_lease_is_held_and_never_deleted(tmp_path, kind):
    content = HOSTILE_LEASES[kind]
    store = open_storage(tmp_path / "run")
    store.replace_bytes(LEASE, content)
    assert isinstance(try_acquire(store, Holder.this_process(), 60), LeaseUnreadable)
    with pytest.raises(LeaseHeld, match="delete it by hand"):
        acquire(store, Holder.this_process(), rank=0, timeout_s=60, wait_s=0)
    assert store.read_bytes(LEASE) == content
    assert not store.exists(claim_name(1))


def test_a_directory_in_place_of_the_lease_is_held(tmp_path):
    (tmp_path / "run" / LEASE).mkdir(parents=True)
    store = open_storage(tmp_path / "run")
    with pytest.raises(LeaseHeld, match="not a lease file"):
        acquire(store, Holder.this_process(), rank=0, timeout_s=60, wait_s=0)
    assert (tmp_path / "run" / LEASE).is_dir()


def test_a_waiting_job_takes_the_lease_once_it_is_released(tmp_path):
    store = open_storage(tmp_path / "run")
    holder = try_acquire(store, other_holder(), timeout_s=60)
    threading.Timer(0.5, holder.release).start()
    t0 = time.monotonic()
    lease = acquire(store, Holder.this_process(), 0, timeout_s=60, wait_s=30)
    assert lease.epoch == 2 and time.monotonic() - t0 < 10
    lease.release()


def test_the_holder_renews_its_heartbeat_and_status_shows_it(tmp_path):
    run = tmp_path / "run"
    lease = acquire(open_storage(run), Holder.this_process(), 0, timeout_s=0.4, wait_s=0)
    first = read_lease(open_storage(run)).heartbeat
    time.sleep(0.5)
    assert read_lease(open_storage(run)).heartbeat > first
    CheckpointManager(run).save(4, {"w": Entry(Weights(torch.ones(2)))}, {}, "fp", {}, {})
    text = format_status(run_status(run))
    assert f"epoch 1, {socket.gethostname()} pid {os.getpid()}" in text and ": live" in text
    lease.release()
    assert "released (free)" in format_status(run_status(run))


# -- as processes ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Uninterrupted runs of ARGS, by worker count (made when first asked for)."""
    made: dict = {}

    def get(nproc: int | None) -> Path:
        if nproc not in made:
            run_dir = tmp_path_factory.mktemp("reference") / f"run-{nproc}"
            result = run_launcher(run_dir, nproc, *ARGS)
            assert result.returncode == 0, result.output
            made[nproc] = run_dir
        return made[nproc]

    return get


def tree(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run but interrupted saves' temp directories, with its bytes."""
    return {
        p.relative_to(run_dir).as_posix(): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and not p.relative_to(run_dir).parts[0].startswith(".tmp-checkpoint-")
    }


def assert_one_run(run_dir: Path) -> None:
    """history.jsonl reads as one run: attempts one after the other, each ended."""
    records = read_history(run_dir)
    open_attempt = False
    for r in records:
        if isinstance(r, AttemptStart):
            assert not open_attempt, records
            open_attempt = True
        elif isinstance(r, AttemptEnd):
            assert open_attempt, records
            open_attempt = False
    assert not open_attempt and records[-1].reason == "done", records


def race_once_let_go(run_dir: Path, nprocs: list[int | None]) -> list[str]:
    """Launch a job of each worker count in `nprocs` into `run_dir` while this process holds
    its lease, wait until every one is waiting for it, let go; the jobs' outputs, once all
    have exited 0."""
    held = acquire(open_storage(run_dir), other_holder(), 0, timeout_s=60, wait_s=0)
    jobs = [start(run_dir, n, *ARGS, "--run.lease_wait_s", "240") for n in nprocs]
    outputs = [Output(p) for p in jobs]
    try:
        assert wait_for(lambda: all(o.count("waiting up to") for o in outputs), jobs[0], 120)
    finally:
        held.release()
    for p in jobs:
        p.wait(timeout=300)
    texts = [o.text() for o in outputs]
    assert [p.returncode for p in jobs] == [0, 0], texts
    return texts


def test_two_launches_into_one_run_train_it_once(tmp_path, references):
    """Both launches (two workers each; one worker against two: the next test) start while the
    run is held elsewhere, so that they race for it on any machine (started one after the
    other, the first may finish its 24 steps before the second has imported torch); once it is
    let go, one trains the whole run while the other waits, then finds it finished."""
    nproc = 2
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    race_once_let_go(run_dir, [nproc, nproc])
    assert_same_checkpoint(last_checkpoint(run_dir), last_checkpoint(references(nproc)))
    assert_one_run(run_dir)
    starts = [r for r in read_history(run_dir) if isinstance(r, AttemptStart)]
    assert [s.step for s in starts] == [0, 24]  # the second found the run finished
    epochs = {read_manifest(run_dir / name).lease_epoch for _, name in list_committed(run_dir)}
    assert epochs == {2}  # every checkpoint by the one job that took the run after the holder


def test_jobs_of_other_worker_counts_waiting_on_one_run_resume_what_the_holder_left(
    tmp_path, references
):
    """Both built on an empty run, then waited; the one that gets the run second finds a
    checkpoint of another number of ranks and is built again for it."""
    run_dir = tmp_path / "run"
    texts = race_once_let_go(run_dir, [None, 2])
    second = [i for i, t in enumerate(texts) if "building it again" in t]
    assert len(second) == 1, texts
    winner = (None, 2)[1 - second[0]]
    assert_same_checkpoint(last_checkpoint(run_dir), last_checkpoint(references(winner)))
    assert_one_run(run_dir)


def test_a_held_run_makes_a_second_job_exit_73_untouched(tmp_path, references):
    run_dir = tmp_path / "run"
    done = references(2)
    for p in sorted(done.rglob("*")):  # a finished run, now held by this test process
        if p.is_file() and not p.relative_to(done).parts[0].startswith((".lease", LEASE)):
            (run_dir / p.relative_to(done)).parent.mkdir(parents=True, exist_ok=True)
            (run_dir / p.relative_to(done)).write_bytes(p.read_bytes())
    lease = acquire(open_storage(run_dir), Holder.this_process(), 0, timeout_s=60, wait_s=0)
    before = tree(run_dir)
    try:
        result = run_launcher(run_dir, 2, *ARGS, "--run.lease_wait_s", "1")
    finally:
        lease.release()
    assert result.returncode != 0
    assert f"exitcode  : {exit_codes.LEASE}" in result.output or (
        f"exitcode: {exit_codes.LEASE}" in result.output
    ), result.output
    line = next(x for x in result.output.splitlines() if "leased by another job" in x)
    assert f"pid {os.getpid()}" in line and "last heartbeat" in line and "waited 1 s" in line
    after = tree(run_dir)
    lease_files = {LEASE, claim_name(1)}
    assert {k: v for k, v in after.items() if k not in lease_files} == {
        k: v for k, v in before.items() if k not in lease_files
    }


def test_a_frozen_job_taken_over_commits_nothing_once_resumed(tmp_path, references):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    frozen = start(run_dir, None, *ARGS, "--run.lease_timeout_s", "2")
    frozen_out = Output(frozen)
    try:
        assert wait_for(lambda: frozen_out.count("checkpoint-12 staged"), frozen, timeout=120)
        os.killpg(frozen.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        second = run_launcher(run_dir, None, *ARGS, "--run.lease_timeout_s", "2")
        assert second.returncode == 0, second.output
        assert "took over the lease" in second.output and "heartbeat" in second.output
        assert time.monotonic() - stopped >= 2
        settled = tree(run_dir)
        os.killpg(frozen.pid, signal.SIGCONT)
        frozen.wait(timeout=120)
    finally:
        if frozen.poll() is None:
            os.killpg(frozen.pid, signal.SIGCONT)
            kill_tree(frozen)
    text = frozen_out.text()
    assert frozen.returncode == exit_codes.LEASE, text
    assert "lost: the run was taken over" in text, text
    if "saved checkpoint-12" in text:  # committed before the freeze (a slow test thread)
        assert text.index("saved checkpoint-12") < text.index("lost: the run was taken"), text
    assert tree(run_dir) == settled  # nothing the frozen job wrote became part of the run
    assert_same_checkpoint(last_checkpoint(run_dir), last_checkpoint(references(None)))
    manifest = read_manifest(last_checkpoint(run_dir))
    assert manifest.lease_epoch == 2
    history = read_history(run_dir)
    assert [r.cause for r in history if isinstance(r, AttemptStart)] == ["fresh", "crashed"]
    assert sum(isinstance(r, AttemptEnd) for r in history) == 1
    assert json.loads((run_dir / LEASE).read_text())["released"]


def test_a_run_held_on_s3_makes_a_second_job_exit_73_untouched(tmp_path, s3):
    url = s3.bucket("held-run") + "/run"
    storage = s3.storage(url)
    lease = acquire(storage, other_holder(), 0, timeout_s=60, wait_s=0)
    try:
        result = run_launcher(
            tmp_path / "run",
            None,
            *ARGS,
            "--checkpoint.dir",
            url,
            "--run.lease_wait_s",
            "0",
            env=s3.env(),
        )
    finally:
        lease.release()
    assert result.returncode == exit_codes.LEASE, result.output
    assert "elsewhere pid 4242, job job-7, last heartbeat" in result.output
    assert storage.listdir() == [".lease", LEASE]
    assert not (tmp_path / "run").exists()  # not even config.yaml
