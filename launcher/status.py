"""`python -m launcher status RUN_DIR [--json]`: where a run stands, from its files alone.

Reads metrics.jsonl (steps, speed), history.jsonl (attempts, causes, ends) and the committed
checkpoints' manifests (never verified here: that reads every byte; `python -m checkpointing
verify` does it). Works on a live run, a finished one or a dead one.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from checkpointing.lease import LeaseError, read_lease
from checkpointing.manifest import CheckpointError, list_committed, read_manifest
from checkpointing.redact import REDACTED
from checkpointing.storage import Storage, open_storage
from core.reporting.history import AttemptEnd, AttemptStart, read_history, read_jsonl
from core.reporting.metrics import METRICS_FILE, Throughput, format_eta


class ReportError(Exception):
    """A run directory cannot be reported on; the message is one line naming it."""


@dataclass
class Attempt:
    attempt: int
    started: float
    step: int
    """Step the attempt started from."""
    resumed_from: str | None
    cause: str
    total_steps: int
    end_reason: str | None = None
    """done, preempted, error; None: no end record (still running, or killed)."""
    end_step: int | None = None
    ended: float | None = None
    error: str | None = None


@dataclass
class RunStatus:
    run_dir: str
    step: int
    """Last logged step (metrics.jsonl), else the last committed checkpoint's."""
    total_steps: int | None
    last_checkpoint: str | None
    last_checkpoint_step: int | None
    last_checkpoint_age_s: float | None
    checkpoints: int
    """Committed checkpoints on disk."""
    attempts: list[Attempt] = field(default_factory=list)
    samples_per_second: float | None = None
    step_time_s: float | None = None
    eta_s: float | None = None
    """0 once done; None when unknown or when no job is training the run (not live)."""
    lease: dict | None = None
    """The run's lease: holder, epoch, heartbeat age, released, live (None: never leased)."""
    live: bool = False
    """A job is training the run now: its lease is held and renewed (a run without a lease:
    its last attempt has no end record)."""
    state: str = ""
    """One line: done, running, or how the last attempt ended and what to do."""

    @property
    def resumes(self) -> list[Attempt]:
        return self.attempts[1:]

    @property
    def done(self) -> bool:
        last = self.attempts[-1] if self.attempts else None
        return last is not None and last.end_reason == "done"


def attempts_of(run_dir: Path) -> list[Attempt]:
    out: list[Attempt] = []
    for r in read_history(run_dir):
        if isinstance(r, AttemptStart):
            out.append(Attempt(r.attempt, r.time, r.step, r.resumed_from, r.cause, r.total_steps))
        elif isinstance(r, AttemptEnd) and out:
            a = out[-1]
            a.end_reason, a.end_step, a.ended, a.error = r.reason, r.step, r.time, r.error
    return out


def checkpoint_storage(run_dir: Path) -> Storage:
    """Where a run's checkpoints are: checkpoint.dir of its config.yaml, else the run dir.
    Redacted storage options are left out (credentials come from the environment)."""
    ck: dict = {}
    config = run_dir / "config.yaml"
    if config.is_file():
        try:
            ck = (yaml.safe_load(config.read_text()) or {}).get("checkpoint") or {}
        except yaml.YAMLError as e:
            raise ReportError(f"{config}: not valid YAML ({type(e).__name__})") from e
    options = {k: v for k, v in (ck.get("storage_options") or {}).items() if v != REDACTED}
    try:
        return open_storage(ck.get("dir") or run_dir, options)
    except (ImportError, ValueError) as e:
        raise ReportError(f"{run_dir}: cannot open its checkpoint store: {e}") from e


def _newest_checkpoint(run_dir: Path) -> tuple[int, str, float, int | None, int]:
    """(step, name, created, total_steps, count) of the newest committed checkpoint."""
    storage = checkpoint_storage(run_dir)
    try:
        committed = list_committed(storage)
        for step, name in committed:
            try:
                m = read_manifest(storage.child(name))
            except CheckpointError:
                continue  # a corrupt manifest: the next older one is what a resume would use
            return step, name, m.created, m.trajectory.get("total_steps"), len(committed)
    except OSError as e:
        raise ReportError(f"{storage.display()}: cannot list checkpoints: {e}") from e
    return -1, "", 0.0, None, len(committed)


def lease_status(storage: Storage, now: float) -> dict | None:
    """Who holds the run's lease and whether it is live (checkpointing/lease.py)."""
    try:
        record = read_lease(storage)
    except LeaseError as e:
        return {"live": True, "error": str(e)}
    except OSError as e:
        raise ReportError(f"{storage.display()}: cannot read its lease: {e}") from e
    if record is None:
        return None
    free = record.free(record.timeout_s, now)
    return {
        "epoch": record.epoch,
        "holder": asdict(record.holder),
        "heartbeat_age_s": record.age(now),
        "timeout_s": record.timeout_s,
        "released": record.released,
        "live": free is None,
        "why_not_live": free,
    }


def run_status(run_dir: str | Path, now: float | None = None) -> RunStatus:
    run_dir = Path(run_dir)
    now = time.time() if now is None else now
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run directory")
    try:
        attempts = attempts_of(run_dir)
        records = [r for r in read_jsonl(run_dir / METRICS_FILE) if "loss" in r]
    except ValueError as e:
        raise ReportError(str(e)) from e
    ck_step, ck_name, ck_created, ck_total, count = _newest_checkpoint(run_dir)
    if not attempts and not records and count == 0:
        raise ReportError(
            f"{run_dir}: not a run directory (no history.jsonl, metrics.jsonl or checkpoint)"
        )
    # The latest attempt's figure: a relaunch may have raised max_steps.
    total = attempts[-1].total_steps if attempts else ck_total
    status = RunStatus(
        run_dir=str(run_dir),
        step=records[-1]["step"] if records else max(ck_step, 0),
        total_steps=total,
        last_checkpoint=ck_name or None,
        last_checkpoint_step=ck_step if ck_name else None,
        last_checkpoint_age_s=now - ck_created if ck_name else None,
        checkpoints=count,
        attempts=attempts,
        lease=lease_status(checkpoint_storage(run_dir), now),
    )
    latest = attempts[-1] if attempts else None
    if status.lease is not None:  # a released lease is not live (LeaseRecord.free)
        status.live = bool(status.lease["live"])
    else:
        status.live = latest is not None and latest.end_reason is None
    status.state = _state(status, latest, now)
    if records and total is not None:
        speed = Throughput(total)
        for r in records:
            last = speed.update(r)
        status.samples_per_second = last.samples_per_second
        status.step_time_s = records[-1]["step_time_s"]
        status.eta_s = last.eta_s if status.live else None  # a stopped run has no ETA
    if status.done:
        status.eta_s = 0.0
    return status


def _state(s: RunStatus, last: Attempt | None, now: float) -> str:
    if s.done:
        return "done"
    if s.live:
        return "running"
    if last is None:
        return "not running; no attempt recorded"
    if last.end_reason is None:
        return (
            f"not running: attempt #{last.attempt} left no end record (killed, or its node "
            f"was lost); relaunch to resume from the last checkpoint"
        )
    when = f" ({_ago(now - last.ended)})" if last.ended is not None else ""
    if last.end_reason == "preempted":
        return (
            f"preempted at step {last.end_step}{when}, checkpoint committed; relaunch the "
            f"same command to continue"
        )
    error = f": {last.error}" if last.error else ""
    return f"{last.end_reason} at step {last.end_step}{when}{error}"


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _ago(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit} ago"
    return f"{seconds:.0f} s ago"


def _ending(a: Attempt) -> str:
    if a.end_reason is None:
        return "no end record (running, or killed)"
    text = f"{a.end_reason} at step {a.end_step}"
    return f"{text}: {a.error}" if a.error else text


def _lease_line(lease: dict) -> str:
    if "error" in lease:
        return f"unreadable, treated as held: {lease['error']}"
    h = lease["holder"]
    job = f", job {h['job_id']}" if h.get("job_id") else ""
    who = f"epoch {lease['epoch']}, {h['host']} pid {h['pid']}{job}"
    if lease["released"]:
        return f"{who}, released (free)"
    beat = f"heartbeat {_ago(max(0.0, lease['heartbeat_age_s']))}"
    if lease["live"]:
        return f"{who}, {beat}: live (another job waits for it)"
    return f"{who}, {beat}: not live ({lease['why_not_live']}; the next job takes it over)"


def format_status(s: RunStatus, now: float | None = None) -> str:
    now = time.time() if now is None else now
    total = "?" if s.total_steps is None else str(s.total_steps)
    pct = f" ({100 * s.step / s.total_steps:.0f}%)" if s.total_steps else ""
    lines = [
        f"run         {s.run_dir}",
        f"state       {s.state}",
        f"steps       {s.step}/{total}{pct}",
    ]
    if s.last_checkpoint is None:
        lines.append("checkpoint  none committed")
    else:
        age = _ago(s.last_checkpoint_age_s or 0.0)
        lines.append(
            f"checkpoint  {s.last_checkpoint} (step {s.last_checkpoint_step}), committed {age}; "
            f"{s.checkpoints} on disk"
        )
    if s.lease is not None:
        lines.append(f"lease       {_lease_line(s.lease)}")
    causes = ", ".join(a.cause for a in s.resumes)
    lines.append(f"resumes     {len(s.resumes)}" + (f" ({causes})" if causes else ""))
    for a in s.attempts:
        origin = f"from {a.resumed_from}" if a.resumed_from else f"from step {a.step}"
        lines.append(
            f"  #{a.attempt:<3} {_clock(a.started)}  {a.cause:<9}  {origin:<28} -> {_ending(a)}"
        )
    if s.samples_per_second is not None:
        lines.append(
            f"speed       {s.samples_per_second:.1f} samples/s ({s.step_time_s:.3f} s/step)"
        )
    if s.done or s.live:
        lines.append("ETA         " + ("done" if s.done else format_eta(s.eta_s)))
    return "\n".join(lines)


def status_main(run_dir: Path, as_json: bool) -> int:
    s = run_status(run_dir)
    if as_json:
        print(json.dumps({**asdict(s), "done": s.done}, indent=1))
    else:
        print(format_status(s))
    return 0
