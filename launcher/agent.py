"""`python -m launcher.agent [torchrun options] -m launcher ...`: torchrun, with an exit code that
says what the workers said.

torchrun's own exit code cannot tell a preemption from a crash: a SIGTERM to torchrun (what
`docker stop`, the kubelet and Slurm send) makes it forward the signal, wait for the workers to
commit their checkpoint and exit 75, and then exit 1 itself with a `SignalException` traceback.
A container's, a pod's or a Slurm step's exit code is torchrun's, so an orchestrator could not
know that a relaunch will continue the run. This runs torchrun's agent in this process (the same
CLI and the same `PET_*` environment variables, `torch.distributed.run`) and exits with:

- 0 when torchrun succeeded;
- the workers' own code when every worker of this node's last attempt ended with the same one
  (75: preempted, checkpoint committed; 2: bad config; 73: the run's lease is held ...);
- 1 otherwise (a crash, workers that disagree, a worker killed before it could say).

Each worker records its exit code in a file of a directory this process creates and names in
`LAUNCHER_EXIT_DIR` (launcher/dist.py `exit_worker`): after a signal torchrun's agent stops the
workers and keeps no exit codes, so only the workers can tell. A graceful stop prints one line,
no traceback.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from launcher import exit_codes

logger = logging.getLogger("launcher.agent")

EXIT_DIR_ENV = "LAUNCHER_EXIT_DIR"
"""Where each worker writes `attempt-<restart>-rank-<local rank>.json` holding its exit code."""


def record_exit(code: int) -> None:
    """Called by a worker as it exits: leave its code for the agent, when one asked for it."""
    directory = os.environ.get(EXIT_DIR_ENV)
    if not directory:
        return
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    record = {"code": code}  # attempt and local rank are in the name
    path = Path(directory) / f"attempt-{attempt}-rank-{local_rank}.json"
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)
    except OSError:
        pass  # the agent then reports 1: it cannot know what this worker said


def recorded_codes(directory: Path) -> dict[int, int]:
    """Local rank -> exit code, of the last attempt that recorded anything."""
    found: dict[int, dict[int, int]] = {}
    for path in directory.glob("attempt-*-rank-*.json"):
        try:
            record = json.loads(path.read_text())
            _, attempt, _, local_rank = path.stem.split("-")
            found.setdefault(int(attempt), {})[int(local_rank)] = int(record["code"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found[max(found)] if found else {}


def agreed_code(codes: dict[int, int], local_world_size: int | None) -> int | None:
    """The one code every local worker ended with, or None (some missing, or they differ)."""
    if local_world_size is None or len(codes) != local_world_size:
        return None
    values = set(codes.values())
    return values.pop() if len(values) == 1 else None


def first_failure_code(
    failed: dict[int, int], recorded: dict[int, int], local_world_size: int | None
) -> int | None:
    """When torchrun failed on its own: the code the workers that ended by themselves agree on.

    A worker that never reached exit_worker (killed, or another entry point) has the code
    torchrun saw; one torchrun stopped with SIGTERM after the first failure, before it could
    say anything (a slow peer still loading when rank 0 refused the config), is collateral and
    not counted, as long as some worker said something."""
    merged = {**failed, **recorded}
    if local_world_size is None or len(merged) != local_world_size:
        return None
    deciding = {r: c for r, c in merged.items() if c != -signal.SIGTERM}
    return agreed_code(deciding, len(deciding)) if deciding else None


def _local_world_size(nproc_per_node: str) -> int | None:
    from torch.distributed.run import determine_local_world_size

    try:
        return determine_local_world_size(nproc_per_node)
    except ValueError:
        return None


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    directory = Path(tempfile.mkdtemp(prefix="launcher-exits-"))
    os.environ[EXIT_DIR_ENV] = str(directory)  # the workers inherit the agent's environment
    stopped_by: str | None = None
    failure: ChildFailedError | None = None
    try:
        run(args)
        return exit_codes.OK
    except SignalException as e:
        stopped_by = signal.Signals(e.sigval).name
    except ChildFailedError as e:
        failure = e
    finally:
        # torchrun's handlers raise on a second signal: none may interrupt the report below.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)
        codes = recorded_codes(directory)
        shutil.rmtree(directory, ignore_errors=True)
    local_world_size = _local_world_size(args.nproc_per_node)
    code = agreed_code(codes, local_world_size)
    if code is None and failure is not None and stopped_by is None:
        failed = {f.local_rank: f.exitcode for f in failure.failures.values()}
        code = first_failure_code(failed, codes, local_world_size)
    if code == exit_codes.PREEMPTED:
        how = f"stopped by {stopped_by}" if stopped_by else "preempted"
        logger.warning(
            "workers %s: checkpoint committed (exit %d); relaunch the same command to continue",
            how,
            code,
        )
        return code
    if failure is not None:
        print(failure.format_msg(), file=sys.stderr)  # torchrun's failure report, no traceback
    if code is not None:
        if code != exit_codes.OK:
            logger.error("workers exited %d", code)
        return code
    if stopped_by is not None:
        logger.error("stopped by %s; workers' exit codes: %s", stopped_by, codes or "none recorded")
    return exit_codes.FAILURE


if __name__ == "__main__":
    sys.exit(main())
