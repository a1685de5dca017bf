"""SIGKILL at random moments (mid-save included), SIGTERM preemption, torchrun restarts: each
relaunched with the same command until done, ending bit-identical to an uninterrupted run."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from checkpointing.manifest import list_checkpoints, verify
from core.reporting.history import AttemptStart, read_history
from tests.checkpoints import assert_same_checkpoint, assert_same_losses
from tests.launch import (
    kill_and_finish,
    kill_tree,
    logged_steps,
    read_metrics,
    run_launcher,
    saving,
    start,
    wait_for,
)

STEPS = 30
ARGS = (
    "--train.max_steps",
    str(STEPS),
    "--train.logging_steps",
    "1",
    "--checkpoint.save_steps",
    "2",
    "--checkpoint.save_total_limit",
    "3",
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    ref = tmp_path_factory.mktemp("ref") / "run"
    result = run_launcher(ref, 2, *ARGS)
    assert result.returncode == 0, result.output
    return ref


def assert_every_checkpoint_valid(run_dir: Path) -> None:
    for _, name in list_checkpoints(run_dir):
        verify(run_dir / name)  # a `checkpoint-<step>` that exists is always complete


def test_sigkill_at_random_moments_including_mid_save(tmp_path, reference):
    """Killed (torchrun and every worker) twice the instant a save is under way and once at a
    random step, every checkpoint verified after each kill; the relaunch ends bit-identical."""
    run_dir = tmp_path / "run"
    kill_and_finish(run_dir, ARGS, {}, ["save", "step", "save"], seed=1234)
    assert_same_losses(reference, run_dir)
    assert_same_checkpoint(reference / f"checkpoint-{STEPS}", run_dir / f"checkpoint-{STEPS}")


def test_sigterm_under_torchrun_checkpoints_and_resumes(tmp_path, reference):
    run_dir = tmp_path / "run"
    args = (*ARGS, "--checkpoint.save_steps", "0")
    proc = start(run_dir, 2, *args)
    assert wait_for(lambda: logged_steps(run_dir) >= 5, proc)
    proc.send_signal(signal.SIGTERM)  # torchrun forwards it to every worker
    out, _ = proc.communicate(timeout=120)
    # torchrun itself exits 1 on the signal; each worker committed and exited 75 (preempted)
    assert proc.returncode == 1
    assert "preempted at step" in out, out
    (step, name), *_ = list_checkpoints(run_dir)
    path = run_dir / name
    assert verify(path).step == step and 5 <= step < STEPS
    assert read_metrics(run_dir)[-1]["step"] == step
    result = run_launcher(run_dir, 2, *args)
    assert result.returncode == 0, result.output
    assert f"resumed from {path}" in result.output
    assert_same_losses(reference, run_dir)
    assert_same_checkpoint(reference / f"checkpoint-{STEPS}", run_dir / f"checkpoint-{STEPS}")


def test_second_sigterm_during_save_is_harmless(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, None, "--train.max_steps", "2000", "--checkpoint.save_steps", "0")
    assert wait_for(lambda: logged_steps(run_dir) >= 2, proc)
    proc.send_signal(signal.SIGTERM)
    assert wait_for(lambda: saving(run_dir), proc, timeout=60) or proc.poll() is not None
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out
    assert "preempted at step" in out
    assert_every_checkpoint_valid(run_dir)
    assert len(list_checkpoints(run_dir)) == 1


def test_sigusr1_preempts_too(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, None, "--train.max_steps", "2000", "--checkpoint.save_steps", "0")
    assert wait_for(lambda: logged_steps(run_dir) >= 2, proc)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out


def test_torchrun_max_restarts_resumes_after_a_worker_crash(tmp_path, reference):
    """The crashing model is TinyGPT until it crashes: the module's reference is its run."""
    marker = tmp_path / "crashed"
    model = ("--model.name", "tests.crashy_model:factory", "--checkpoint.save_steps", "5")
    kwargs = f"{{marker: {marker}, crash_at: 13, crash_rank: 1}}"
    run_dir = tmp_path / "run"
    proc = start(
        run_dir, 2, *ARGS, *model, "--model.kwargs", kwargs, torchrun_args=("--max-restarts", "1")
    )
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode == 0, out
    assert marker.exists() and "injected crash on rank 1" in out
    assert "resumed from" in out
    assert "waiting up to" not in out  # the restarted workers took the run's lease at once
    starts = [r for r in read_history(run_dir) if isinstance(r, AttemptStart)]
    assert [(s.cause, s.restart_count) for s in starts] == [("fresh", 0), ("restarted", 1)]
    assert_same_losses(reference, run_dir)
    assert_same_checkpoint(reference / f"checkpoint-{STEPS}", run_dir / f"checkpoint-{STEPS}")
