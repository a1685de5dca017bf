"""Running the launcher as a subprocess (alone or under torchrun), with cleanup of every worker.

torchrun starts each worker in its own session, so killing torchrun's process group leaves the
workers running: cleanup walks torchrun's descendants and kills each one by pid.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from checkpointing.manifest import list_checkpoints, verify

REPO = Path(__file__).resolve().parent.parent
# A small in-process run: 625 samples of 32 bytes, 8 per batch, logging every step.
SMALL = [
    "--data.max_bytes",
    "20000",
    "--data.seq_len",
    "32",
    "--train.per_device_batch_size",
    "8",
    "--train.logging_steps",
    "1",
    "--train.progress_bar",
    "never",
]
BIN = Path(sys.executable).parent


@dataclass
class Result:
    returncode: int
    output: str


def launcher_cmd(nproc: int | None, args: list[str]) -> list[str]:
    """`python -m launcher ARGS`, or under `torchrun --standalone --nproc-per-node N`."""
    if nproc is None:
        return [sys.executable, "-m", "launcher", *args]
    return [
        str(BIN / "torchrun"),
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "launcher",
        *args,
    ]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = str(REPO)
    env["OMP_NUM_THREADS"] = "1"
    env["HF_HUB_OFFLINE"] = "1"  # nothing downloads
    env.pop("PYTEST_CURRENT_TEST", None)
    # Each launch imports the project afresh: let the first compile it for the others (this
    # machine's environment sets PYTHONDONTWRITEBYTECODE; a user's rarely does).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc` and all its descendants (each by pid: they may be in other sessions)."""
    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    # A SIGKILLed process can take a moment to die on a loaded machine (in the kernel, say):
    # a lost node's processes are gone, so wait until each is (or is a zombie nobody reaped).
    deadline = time.monotonic() + 30
    for p in procs:
        while time.monotonic() < deadline:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)


def run(
    cmd: list[str], cwd: Path, timeout: float = 240, env: dict[str, str] | None = None
) -> Result:
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=child_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    return Result(proc.returncode, out)


def launcher_args(tmp: Path, overrides: tuple[str, ...], config: str | None) -> list[str]:
    """The launcher's arguments for a run in `tmp`: the config (tiny.yaml unless given), no
    progress bar, then `overrides`."""
    return [
        "--config",
        config or str(REPO / "configs" / "tiny.yaml"),
        "--run.output_dir",
        str(tmp),
        "--train.progress_bar",
        "never",
        *overrides,
    ]


def run_launcher(
    tmp: Path,
    nproc: int | None,
    *overrides: str,
    config: str | None = None,
    timeout: float = 240,
    env: dict[str, str] | None = None,
) -> Result:
    args = launcher_args(tmp, overrides, config)
    return run(launcher_cmd(nproc, args), cwd=tmp.parent, timeout=timeout, env=env)


def refused_here(tmp: Path, *overrides: str, config: str | None = None) -> Result:
    """`python -m launcher` on one process, run in this one, for a job that must be refused
    before it trains (an exit code and its log lines): the same main() as a launch, without a
    process that spends seconds importing torch. The logging setup main() replaces is put back
    (its session restores the signal handlers itself)."""
    from launcher.main import main

    args = launcher_args(tmp, overrides, config)
    root, fsspec_log = logging.getLogger(), logging.getLogger("fsspec")
    handlers, level, fsspec_level = root.handlers[:], root.level, fsspec_log.level
    out = io.StringIO()
    try:
        with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
            # Without torch's @record (it enables faulthandler on a real stderr for torchrun).
            code = main.__wrapped__(args)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        fsspec_log.setLevel(fsspec_level)
    assert code != 0, f"the job was not refused:\n{out.getvalue()}"
    return Result(code, out.getvalue())


def read_metrics(run_dir: Path, summary: bool = False) -> list[dict]:
    """metrics.jsonl records; the closing summary line (train_runtime...) only if asked."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if summary or "train_runtime" not in r]


def start(
    run_dir: Path,
    nproc: int | None,
    *args: str,
    torchrun_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    cmd = launcher_cmd(
        nproc, ["--run.output_dir", str(run_dir), "--train.progress_bar", "never", *args]
    )
    if torchrun_args:
        cmd[1:1] = list(torchrun_args)
    return subprocess.Popen(
        cmd,
        cwd=run_dir.parent,
        env=child_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 120) -> bool:
    """Poll until predicate() or the process ends; True if the predicate held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.005)
    raise TimeoutError("the run neither reached the point nor ended")


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def saving(run_dir: Path) -> bool:
    return any(run_dir.glob(".tmp-checkpoint-*"))


class Output:
    """A process's combined output, collected line by line on a thread, so that a test can
    wait for a log line while the process runs."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append(line)

    def count(self, text: str) -> int:
        return sum(text in line for line in list(self.lines))

    def text(self) -> str:
        self._thread.join(timeout=30)
        return "".join(self.lines)


def launch(run_dir: Path, args: tuple[str, ...], env: dict[str, str]) -> str:
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    result = run(
        launcher_cmd(2, ["--run.output_dir", str(run_dir), *args]), run_dir.parent, env=env
    )
    assert result.returncode == 0, result.output
    return result.output


def last_checkpoint(run_dir: Path) -> Path:
    (_, name), *_ = list_checkpoints(run_dir)  # the newest
    return run_dir / name


def kill_and_finish(run_dir: Path, args: tuple[str, ...], env: dict, plans: list[str], seed: int):
    """Kill the run at each plan's moment (torchrun and every worker), then run it to the end."""
    rng = random.Random(seed)
    hits = 0
    for plan in plans:
        proc = start(run_dir, 2, *args, env=env)
        if plan == "save":
            hit = wait_for(lambda: saving(run_dir), proc, timeout=180)
            time.sleep(rng.uniform(0, 0.03))
        else:
            target = logged_steps(run_dir) + rng.randint(2, 5)
            hit = wait_for(lambda t=target: logged_steps(run_dir) >= t, proc, timeout=180)
            time.sleep(rng.uniform(0, 0.05))
        kill_tree(proc)
        hits += hit
        for _, name in list_checkpoints(run_dir):
            verify(run_dir / name)  # a checkpoint-<step> that exists is always complete
    assert hits >= len(plans) - 1, "the run ended before the kills: the test tested nothing"
    return launch(run_dir, args, env)
