"""The background writer of report lines: order, errors, and every line on disk before a
checkpoint commits, after a crash and after a preemption (the thread itself never writes in
these tests: its interval is an hour, so only the drains can have written)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

import core.reporting.line_writer
from checkpointing.lease import Holder, Lease, LeaseLost, try_acquire
from checkpointing.storage import open_storage
from core.callbacks import TrainerCallback, TrainerControl
from core.config import load_config
from core.loop import DistInfo
from core.reporting.line_writer import LineWriter
from core.reporting.metrics import JsonlMetrics, Progress, truncate_metrics
from core.run import build_trainer
from core.state import TrainState
from core.trainer import Trainer
from tests.launch import SMALL, read_metrics


@pytest.fixture
def idle_thread(monkeypatch):
    monkeypatch.setattr(core.reporting.line_writer, "INTERVAL_S", 3600.0)


def config_for(tmp_path, *overrides):
    return load_config(
        None, [*SMALL, "--run.output_dir", str(tmp_path), "--train.max_steps", "8", *overrides]
    )


def test_calls_run_in_order_on_the_thread_and_on_drain():
    writer, out = LineWriter(interval_s=0.01), []
    for i in range(500):
        writer.submit(out.append, i)
    deadline = time.monotonic() + 10
    while len(out) < 500 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert out == list(range(500))  # written by the thread, without a drain
    for i in range(500, 1000):
        writer.submit(out.append, i)
    writer.drain()
    assert out == list(range(1000))
    writer.close()
    assert not any(t.name == "line-writer" for t in threading.enumerate())


def test_after_batch_runs_once_per_batch(idle_thread):
    writer, out, flushes = LineWriter(), [], []
    writer.after_batch(lambda: flushes.append(len(out)))
    for i in range(3):
        writer.submit(out.append, i)
    writer.drain()
    writer.drain()  # nothing ran: no flush
    assert flushes == [3]
    writer.close()


def test_a_failed_write_is_raised_on_the_step_thread(idle_thread, caplog):
    writer, out = LineWriter(), []

    def full_disk(line):
        raise OSError(28, "No space left on device")

    writer.submit(out.append, 1)
    writer.submit(full_disk, 2)
    writer.submit(out.append, 3)
    with pytest.raises(OSError, match="No space left"):
        writer.drain()
    assert out == [1]  # nothing after the failed call is written
    with pytest.raises(OSError):
        writer.submit(out.append, 4)
    with caplog.at_level(logging.WARNING):
        writer.close(quiet=True)  # on the way out after another error: logged, not raised
    assert "No space left" in caplog.text


class ReadMetricsAtSave(TrainerCallback):
    def __init__(self, path):
        self.path, self.seen = path, {}

    def on_save(self, config, state, control, **kwargs):
        self.seen[state.global_step] = [m["step"] for m in read_metrics(self.path)]


def test_lines_are_on_disk_when_a_checkpoint_commits(tmp_path, idle_thread):
    config = config_for(tmp_path, "--checkpoint.save_steps", "3")
    probe = ReadMetricsAtSave(tmp_path)
    build_trainer(config, DistInfo(), torch.device("cpu"), callbacks=[probe]).train()
    assert probe.seen == {3: [1, 2, 3], 6: [1, 2, 3, 4, 5, 6], 8: list(range(1, 9))}


class FailAt(TrainerCallback):
    def on_step_end(self, config, state, control, **kwargs):
        if state.global_step == 5:
            raise RuntimeError("boom at step 5")


def test_lines_are_on_disk_after_a_crash(tmp_path, idle_thread, caplog):
    with caplog.at_level(logging.INFO), pytest.raises(RuntimeError, match="boom"):
        Trainer(args=config_for(tmp_path), callbacks=[FailAt()]).train()
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    lines = [r.getMessage() for r in caplog.records if r.name == "core.reporting.metrics"]
    assert [line.split()[1] for line in lines] == [f"{k}/8" for k in range(1, 6)]
    assert not any(t.name == "line-writer" for t in threading.enumerate())


class TakenOverAt(TrainerCallback):
    """Another job takes the run over after step 3's line was queued, and this one learns it
    (its heartbeat does) before step 4: test_lease's frozen job, in one process."""

    def __init__(self, run_dir):
        self.run_dir = run_dir

    def on_log(self, config, state, control, logs):
        if logs.get("step") == 3:
            holder = Holder("elsewhere", 4242, None, None, "job-7", time.time())
            taken = try_acquire(open_storage(self.run_dir), holder, 1.0, now=time.time() + 10)
            assert isinstance(taken, Lease)
            time.sleep(1.0)  # four heartbeats of a 1 s lease: the loss is known


def test_a_job_that_lost_the_run_writes_none_of_its_queued_lines(tmp_path, idle_thread, caplog):
    """Its drain on the way out would have appended steps 1-3 after the new holder's lines."""
    config = config_for(tmp_path, "--run.lease_timeout_s", "1")
    with caplog.at_level(logging.WARNING), pytest.raises(LeaseLost):
        Trainer(args=config, callbacks=[TakenOverAt(tmp_path)]).train()
    assert read_metrics(tmp_path) == []
    assert "no longer this job's: 3 report line(s) dropped" in caplog.text


def test_lines_are_on_disk_after_a_preemption(tmp_path, idle_thread, caplog):
    trainer = None

    def stop() -> bool:
        return trainer is not None and trainer.loop.state.global_step >= 4

    trainer = Trainer(args=config_for(tmp_path), stop_requested=stop)
    with caplog.at_level(logging.INFO):
        state = trainer.train()
    assert trainer.preempted and state.global_step == 4
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2, 3, 4]
    assert "train_runtime" in read_metrics(tmp_path, summary=True)[-1]
    messages = [r.getMessage() for r in caplog.records]
    warned = messages.index("stop requested: checkpointing at step 4")
    assert messages.index(next(m for m in messages if m.startswith("step 4/8 loss"))) < warned


def test_a_line_keeps_the_time_of_its_step(idle_thread, caplog):
    writer = LineWriter()
    progress = Progress(10, "never", writer)
    progress.on_train_begin(None, TrainState(), TrainerControl())
    logs = {"step": 1, "loss": 2.5, "lr": 1e-3, "epoch": 0.1, "samples": 8, "step_time_s": 0.01}
    with caplog.at_level(logging.INFO):
        stepped = time.time()
        progress.on_log(None, TrainState(), TrainerControl(), logs)
        time.sleep(0.05)
        assert not caplog.records  # queued, not written
        writer.drain()
    (record,) = caplog.records
    assert record.getMessage().startswith("step 1/10 loss 2.5000 lr 1.000e-03")
    assert stepped <= record.created < stepped + 0.04
    assert record.msecs == int((record.created - int(record.created)) * 1000)
    assert record.filename == "metrics.py" and record.funcName == "_report"
    progress.close()


def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    truncate_metrics(path, 5)  # a kill mid-write left step 3 without its newline
    assert path.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'


def test_metrics_lines_wait_for_the_writer(tmp_path, idle_thread):
    writer = LineWriter()
    metrics = JsonlMetrics(tmp_path, writer)
    metrics.on_train_begin(None, TrainState(), TrainerControl())
    for step in range(1, 4):
        metrics.on_log(None, TrainState(), TrainerControl(), {"step": step, "loss": 0.1 * step})
    assert (tmp_path / "metrics.jsonl").read_text() == ""  # queued
    writer.drain()
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2, 3]
    metrics.close()
