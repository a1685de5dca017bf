"""`python -m launcher.agent`: torchrun whose exit code says what the workers said (75 after a
graceful stop that committed a checkpoint, their own code when they agree, 1 otherwise), and the
check that fails an unwritable run directory before anything is built."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from checkpointing.manifest import list_checkpoints
from launcher.agent import agreed_code, first_failure_code, recorded_codes
from tests.launch import REPO, SMALL, child_env, kill_tree, logged_steps, wait_for

TINY = str(REPO / "configs" / "tiny.yaml")


def agent(run_dir, *args: str, nproc: int = 2) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "launcher.agent", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "launcher", "--config", TINY, "--run.output_dir", str(run_dir), *SMALL, *args]
    return subprocess.Popen(
        cmd,
        cwd=run_dir.parent,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 180) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    return out


def test_recorded_codes_are_the_last_attempts(tmp_path):
    for attempt, rank, code in [(0, 0, 1), (0, 1, 1), (1, 0, 75), (1, 1, 75)]:
        record = {"code": code, "rank": rank, "attempt": attempt}
        (tmp_path / f"attempt-{attempt}-rank-{rank}.json").write_text(json.dumps(record))
    (tmp_path / "attempt-1-rank-2.json").write_text("{not json")  # a torn write is no answer
    assert recorded_codes(tmp_path) == {0: 75, 1: 75}
    assert agreed_code({0: 75, 1: 75}, 2) == 75
    assert agreed_code({0: 75}, 2) is None  # a worker that said nothing (SIGKILLed)
    assert agreed_code({0: 75, 1: 1}, 2) is None
    assert agreed_code({0: 2, 1: 2}, None) is None  # the worker count is unknown


def test_a_peer_torchrun_stopped_before_it_could_say_does_not_count():
    # rank 0 refused the config (exit 2, recorded); rank 1, still loading, was stopped by
    # torchrun with SIGTERM before it reached the config: the run's code is 2
    assert first_failure_code({0: 2, 1: -15}, {0: 2}, 2) == 2
    assert first_failure_code({1: 1, 0: -15}, {1: 1}, 2) == 1  # a crash stays a crash
    assert first_failure_code({0: 2, 1: -9}, {0: 2}, 2) is None  # SIGKILLed: unknown
    assert first_failure_code({0: -15, 1: -15}, {}, 2) is None  # nobody said anything
    assert first_failure_code({0: 2}, {0: 2}, 2) is None  # rank 1 unaccounted for


def test_a_signal_to_the_agent_exits_75_without_a_traceback(tmp_path):
    """What `docker stop` / the kubelet / Slurm do: SIGTERM to the entry point. torchrun itself
    exits 1 with a SignalException traceback here (tests/test_launcher/test_report.py shows it)."""
    run_dir = tmp_path / "run"
    proc = agent(run_dir, "--train.max_steps", "400")
    try:
        assert wait_for(lambda: logged_steps(run_dir) >= 3, proc), finish(proc)
        proc.send_signal(signal.SIGTERM)
        out = finish(proc)
    finally:
        kill_tree(proc)
    assert proc.returncode == 75, out
    assert "Traceback" not in out and "SignalException" not in out, out
    assert "workers stopped by SIGTERM: checkpoint committed (exit 75)" in out
    (step, _), *_ = list_checkpoints(run_dir)
    assert 3 <= step < 400


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        # every worker exits 2 on a bad config: the agent says 2, not torchrun's 1
        (("--train.max_steps", "-3"), 2, "workers exited 2"),
        # one worker crashes (its peer is stopped by torchrun): 1, with torchrun's report
        (
            (
                "--model.name",
                "tests.crashy_model:factory",
                "--model.kwargs",
                "{marker: MARKER, crash_at: 3}",
                "--train.max_steps",
                "20",
            ),
            1,
            "injected crash on rank 1",
        ),
    ],
    ids=["bad-config", "crash"],
)
def test_workers_that_agree_give_their_code_others_give_1(tmp_path, args, code, says):
    args = tuple(a.replace("MARKER", str(tmp_path / "marker")) for a in args)
    proc = agent(tmp_path / "run", *args)
    out = finish(proc)
    assert proc.returncode == code, out
    assert says in out
    assert "raise ChildFailedError" not in out  # torchrun's report, not the agent's traceback


# As a container runs it: uid 10001 with a volume owned by root. The interpreter may live where
# that uid cannot read (here under /root), so the child imports as root, then drops to the uid.
AS_UID = """
import os, sys
from launcher.main import main
if os.getuid() == 0:
    os.setgroups([]); os.setgid(10001); os.setuid(10001)
sys.exit(main(sys.argv[1:]))
"""


def test_an_unwritable_run_directory_fails_before_anything_is_built():
    with tempfile.TemporaryDirectory() as tmp:  # in /tmp: pytest's own folders are 0700
        check_unwritable(Path(tmp))


def check_unwritable(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)  # root's alone to write, as a fresh volume's directory
    cmd = [sys.executable, "-c", AS_UID, "--config", TINY, "--run.output_dir", str(locked / "run")]
    cmd += ["--data.max_bytes", "0"]  # the whole stdlib corpus: building it would take a while
    result = subprocess.run(
        cmd, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    err = result.stderr.strip().splitlines()
    assert len(err) == 1, err
    uid = 10001 if os.getuid() == 0 else os.getuid()
    assert f"run.output_dir: {locked / 'run'} is not writable by this process (uid {uid}" in err[0]
    assert f"{locked} is owned by uid {os.getuid()}" in err[0]
    assert f"chown -R {uid}:" in err[0] and "--user" in err[0]
    assert not (locked / "run").exists()
