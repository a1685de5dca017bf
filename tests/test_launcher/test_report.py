"""What a user sees: history.jsonl causes, `status`, `plot` and TensorBoard after a real run that
was preempted (SIGTERM), then killed (SIGKILL of torchrun and every worker), then resumed."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from checkpointing.manifest import list_checkpoints, read_manifest
from core.reporting.history import AttemptEnd, AttemptStart, CheckpointCommit, read_history
from launcher.status import format_status, run_status
from tests.launch import (
    REPO,
    SMALL,
    child_env,
    kill_tree,
    logged_steps,
    read_metrics,
    run_launcher,
    start,
    wait_for,
)

STEPS = 40
ARGS = (
    *SMALL,
    "--train.max_steps",
    str(STEPS),
    "--checkpoint.save_steps",
    "10",
    "--run.report_to",
    "[jsonl, tensorboard]",
)


def report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launcher", *args],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> dict:
    """One run in three attempts under torchrun (2 ranks): SIGTERM, SIGKILL, then to the end."""
    run_dir = tmp_path_factory.mktemp("interrupted") / "run"
    proc = start(run_dir, 2, *ARGS)
    assert wait_for(lambda: logged_steps(run_dir) >= 3, proc)
    proc.send_signal(signal.SIGTERM)  # torchrun forwards it; the workers commit and exit 75
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "preempted at step" in out, out
    preempted_at = list_checkpoints(run_dir)[0][0]
    assert preempted_at < 10
    after_preemption = run_status(run_dir)

    proc = start(run_dir, 2, *ARGS)
    try:
        # Past checkpoint-10 by a few logged steps, well before checkpoint-20.
        assert wait_for(lambda: logged_steps(run_dir) >= 13, proc)
    finally:
        kill_tree(proc)  # SIGKILL torchrun and every worker: no end record, no cleanup
    killed_at = read_metrics(run_dir)[-1]["step"]
    assert killed_at > list_checkpoints(run_dir)[0][0] == 10, "no steps past the checkpoint"
    after_kill = run_status(run_dir)

    result = run_launcher(run_dir, 2, *ARGS)
    assert result.returncode == 0, result.output
    return {
        "dir": run_dir,
        "preempted_at": preempted_at,
        "killed_at": killed_at,
        "after_kill": after_kill,
        "after_preemption": after_preemption,
        "output": result.output,
    }


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    result = run_launcher(run_dir, None, *SMALL, "--train.max_steps", "25")
    assert result.returncode == 0, result.output
    return run_dir


def test_history_records_attempts_causes_and_commits(interrupted):
    run_dir, p = interrupted["dir"], interrupted["preempted_at"]
    history = read_history(run_dir)
    starts = [r for r in history if isinstance(r, AttemptStart)]
    assert [(s.attempt, s.step, s.resumed_from, s.cause) for s in starts] == [
        (1, 0, None, "fresh"),
        (2, p, f"checkpoint-{p}", "preempted"),
        (3, 10, "checkpoint-10", "crashed"),
    ]
    assert {(s.world_size, s.total_steps, s.restart_count) for s in starts} == {(2, STEPS, 0)}
    ends = [r for r in history if isinstance(r, AttemptEnd)]
    assert [(e.step, e.reason) for e in ends] == [(p, "preempted"), (STEPS, "done")]
    # Attempt 2 (SIGKILLed) left no end: its start is followed by commits only, then attempt 3.
    second = history.index(starts[1])
    assert not any(isinstance(r, AttemptEnd) for r in history[second : history.index(starts[2])])
    commits = [r for r in history if isinstance(r, CheckpointCommit)]
    assert [c.step for c in commits] == [p, 10, 20, 30, STEPS]
    for c in commits:  # recorded after the commit: the manifest already existed
        assert c.time >= read_manifest(run_dir / c.path).created and c.save_seconds > 0


def test_status_of_a_killed_run_and_of_the_finished_one(interrupted):
    run_dir = interrupted["dir"]
    dead = interrupted["after_kill"]
    assert dead.step == interrupted["killed_at"] and dead.total_steps == STEPS
    assert dead.last_checkpoint == "checkpoint-10" and not dead.done
    # Its job is gone (SIGKILL: the lease's holder is dead): no ETA, and the state says so.
    assert not dead.live and dead.eta_s is None and dead.state.startswith("not running")
    assert [a.cause for a in dead.resumes] == ["preempted"]
    text = format_status(dead)
    assert "no end record (running, or killed)" in text and "ETA" not in text
    assert "state       not running: attempt #2 left no end record" in text

    result = report("status", str(run_dir))
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert f"steps       {STEPS}/{STEPS} (100%)" in text and "state       done" in text
    assert re.search(rf"checkpoint  checkpoint-{STEPS} \(step {STEPS}\), committed \d+ s ago", text)
    assert "resumes     2 (preempted, crashed)" in text
    assert re.search(r"speed       [\d.]+ samples/s", text) and "ETA         done" in text
    assert len(re.findall(r"^  #\d", text, re.M)) == 3

    as_json = json.loads(report("status", str(run_dir), "--json").stdout)
    assert (as_json["step"], as_json["total_steps"], as_json["done"]) == (STEPS, STEPS, True)
    assert [a["cause"] for a in as_json["attempts"]] == ["fresh", "preempted", "crashed"]
    assert [a["end_reason"] for a in as_json["attempts"]] == ["preempted", None, "done"]


def test_status_of_a_preempted_run_says_to_relaunch_and_has_no_eta(interrupted):
    s = interrupted["after_preemption"]
    p = interrupted["preempted_at"]
    assert not s.live and s.eta_s is None and s.lease["released"]
    assert s.state.startswith(f"preempted at step {p} (") and "relaunch" in s.state
    assert "ETA" not in format_status(s)


def test_plain_progress_lines_show_throughput_and_eta(interrupted):
    line = re.search(
        r"step 39/40 loss \S+ lr \S+ epoch \S+ \S+ s/step (\S+) samples/s ETA (\S+)",
        interrupted["output"],
    )
    assert line, interrupted["output"]
    assert float(line.group(1)) > 0 and re.fullmatch(r"\d+:\d\d(:\d\d)?", line.group(2))


def test_plot_two_runs_writes_a_png(interrupted, uninterrupted, tmp_path):
    out = tmp_path / "fig" / "loss.png"
    result = report("plot", str(interrupted["dir"]), str(uninterrupted), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 10_000
    image = imread(out)
    assert image.ndim == 3 and image.shape[0] > 400 and image.shape[1] > 600
    assert np.ptp(image[..., :3]) > 0.5  # not a blank canvas


def test_plot_and_status_refuse_a_directory_that_is_not_a_run(tmp_path):
    for args in (("status", str(tmp_path)), ("plot", str(tmp_path / "nope"))):
        result = report(*args)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr


def scalars(log_dir: Path, tag: str, purge: bool = True) -> list:
    acc = EventAccumulator(str(log_dir), purge_orphaned_data=purge)
    acc.Reload()
    return acc.Scalars(tag)


def test_tensorboard_after_kill_and_resume_has_each_step_once(interrupted):
    run_dir = interrupted["dir"]
    log_dir = run_dir / "tensorboard"
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 3  # one stream, three writers
    # The killed attempt really wrote steps past its checkpoint (the test tests something).
    raw = [e.step for e in scalars(log_dir, "train/loss", purge=False)]
    assert len(raw) > STEPS and sorted(set(raw)) == list(range(1, STEPS + 1))
    events = scalars(log_dir, "train/loss")
    losses = {m["step"]: m["loss"] for m in read_metrics(run_dir)}
    assert [e.step for e in events] == list(range(1, STEPS + 1))
    assert [e.value for e in events] == [np.float32(losses[e.step]) for e in events]
    saves = scalars(log_dir, "checkpoint/save_seconds")
    assert [e.step for e in saves] == [interrupted["preempted_at"], 10, 20, 30, STEPS]
    for tag in ("train/lr", "train/grad_norm", "train/samples_per_second"):
        assert [e.step for e in scalars(log_dir, tag)][-1] == STEPS


def test_default_report_to_writes_no_tensorboard(uninterrupted):
    assert not (uninterrupted / "tensorboard").exists()
    assert (uninterrupted / "history.jsonl").is_file()


def test_status_and_plot_read_a_run_without_torch():
    """`status` runs in a Slurm script after every failed attempt (docker/examples/slurm.sbatch)
    and on login nodes: importing torch made each call take seconds."""
    code = "import sys, launcher.report; sys.exit('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], env=child_env(), timeout=60)
    assert result.returncode == 0, "launcher.report imported torch"
