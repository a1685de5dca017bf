"""Writing and committing one checkpoint: every rank writes its files of a snapshot (hashing as
it writes), rank 0 gathers the digests and commits with the manifest, every rank learns the
outcome. The commit protocols are in checkpointing/manager.py's docstring; the manager takes
the snapshot and owns the order of saves (sync or in the background)."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from checkpointing.comm import broadcast_object, gather_objects
from checkpointing.lease import LeaseLost
from checkpointing.manifest import MANIFEST, Manifest
from checkpointing.retention import Housekeeping
from checkpointing.retry import StorageError, retrying
from checkpointing.serialize import FileDigest, json_bytes, sync_and_digest, write_encoded
from checkpointing.stateful import split_by_size
from checkpointing.storage import Storage

logger = logging.getLogger(__name__)

WRITE_THREADS = 4
"""Files of one rank's checkpoint written at once (each hashed on a thread of its own too)."""


class CheckpointSaveError(StorageError):
    """A save could not be committed (the store failed after its retries, on some rank)."""


@dataclass
class Snapshot:
    """One rank's part of a save, taken on the training thread."""

    step: int
    target: str
    """Where files are written: the temp directory (local) or checkpoint-<step> (object store)."""
    files: list[tuple[str, Any, dict[str, torch.Tensor]]]
    """(state name, JSON structure, tensors) this rank writes."""
    directories: list[str]
    staged: Path | None
    """Object stores: the local folder holding this rank's directory-entry files to upload."""
    header: dict[str, Any]
    rank_checks: dict[str, Any]
    t0: float = field(default_factory=time.perf_counter)


class Committer:
    """One rank's side of writing and committing snapshots into `storage`."""

    def __init__(
        self,
        storage: Storage,
        rank: int,
        world_size: int,
        engine: str,
        housekeeping: Housekeeping,
        fence: Callable[[str], None],
        lease_epoch: Callable[[], int | None],
    ) -> None:
        self.storage = storage
        self.rank = rank
        self.world_size = world_size
        self.engine = engine
        self.housekeeping = housekeeping
        self._fence = fence
        """Raises LeaseLost unless this job still holds the run's lease."""
        self.lease_epoch = lease_epoch
        """The lease epoch the manifest records (None: written without a lease)."""

    def write_and_commit(self, snap: Snapshot, group: Any) -> str:
        """Write this rank's files, gather every rank's digests (or errors), commit on rank 0;
        every rank learns the outcome. Returns the committed checkpoint's location."""
        target = self.storage.child(snap.target)
        digests: dict[str, FileDigest] = {}
        error = None
        lost = False
        try:
            self._fence(f"writing checkpoint-{snap.step}")
            digests.update(_write_files(target, snap.files))
            if snap.directories:
                digests.update(self._directory_digests(target, snap))
        except Exception as e:
            error, lost = f"rank {self.rank}: {e}", isinstance(e, LeaseLost)
            logger.error("checkpoint-%d: %s", snap.step, error)
        finally:
            if snap.staged is not None:
                shutil.rmtree(snap.staged, ignore_errors=True)
        gathered = gather_objects((digests, snap.rank_checks, (error, lost)), group)
        outcome = None
        if self.rank == 0:
            errors = [err for _, _, err in gathered if err[0]]
            if errors:
                error, lost = errors[0]
                outcome = (f"checkpoint-{snap.step} was not committed: {error}", lost)
            else:
                try:
                    self._commit(snap, gathered)
                except Exception as e:
                    lost = isinstance(e, LeaseLost)
                    outcome = (f"checkpoint-{snap.step} was not committed: {e}", lost)
        outcome = broadcast_object(outcome, group)
        if outcome is not None:
            message, lost = outcome
            raise (LeaseLost if lost else CheckpointSaveError)(message)
        return self.storage.display(f"checkpoint-{snap.step}")

    def _directory_digests(self, target: Storage, snap: Snapshot) -> dict[str, FileDigest]:
        if snap.staged is None:
            # Local: the engine wrote into the shared temp directory; each rank fsyncs and
            # hashes a share of its files, whoever wrote what.
            root = target.local_path()
            sized = [(target.size(rel), rel) for d in snap.directories for rel in target.files(d)]
            mine = split_by_size(sized, self.world_size, self.rank)
            with ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="checkpoint-sync") as pool:
                digests = pool.map(lambda rel: sync_and_digest(root / rel), mine)
                return dict(zip(mine, digests, strict=True))
        # Object store: each rank uploads what its engine wrote into its own staging folder.
        out = {}
        for path in sorted(p for p in snap.staged.rglob("*") if p.is_file()):
            rel = path.relative_to(snap.staged).as_posix()
            out[rel] = retrying(
                f"uploading {target.display(rel)}",
                lambda path=path, rel=rel: _upload(target, rel, path),
                target.retries,
            )
        return out

    def _commit(self, snap: Snapshot, gathered: list[Any]) -> None:
        files: dict[str, dict[str, Any]] = {}
        checks = dict(snap.header["checks"])
        for rank_digests, rchecks, _ in gathered:
            for rel, d in rank_digests.items():
                files[rel] = d.record()
            for key, value in rchecks.items():
                checks.setdefault(key, []).append(value)
        manifest = Manifest(
            step=snap.step,
            world_size=self.world_size,
            engine=self.engine,
            config_fingerprint=snap.header["config_fingerprint"],
            trajectory=snap.header["trajectory"],
            files=dict(sorted(files.items())),
            entries=snap.header["entries"],
            checks=checks,
            created=time.time(),
            lease_epoch=self.lease_epoch(),
        )
        final = f"checkpoint-{snap.step}"
        target = self.storage.child(snap.target)
        data = json_bytes(asdict(manifest))
        if self.storage.atomic_rename:
            for sub in sorted({rel.rpartition("/")[0] for rel in files}):
                target.sync_dir(sub)
            self._fence(f"committing {final}")
            target.write_bytes(MANIFEST, data)  # the commit marker, written last
            target.sync_dir()
            self.housekeeping.rename_into_place(snap.target, final)
        else:
            # Every object is confirmed written (each rank's upload returned): the manifest
            # object is the commit.
            self._fence(f"committing {final}")
            retrying(
                f"writing {target.display(MANIFEST)}",
                lambda: target.write_bytes(MANIFEST, data),
                target.retries,
            )
        logger.info(
            "saved %s in %.2f s, %.1f MB",
            final,
            time.perf_counter() - snap.t0,
            manifest.total_bytes / 1e6,
        )
        self.housekeeping.retain(keep=final)


def _write_files(target: Storage, files: list[tuple[str, Any, Any]]) -> dict[str, FileDigest]:
    """Write the entries' files, up to WRITE_THREADS at once. Each file's hash runs on a
    thread of its own beside its writes (BLAKE3 and file writes release the GIL), so with
    several large entries (model, optimizer) a save is not bound by one core's hashing speed.
    The first error, in entry order, is raised
    once every write has ended."""
    if len(files) <= 1:  # no pool for one file
        return write_encoded(target, *files[0]) if files else {}
    with ThreadPoolExecutor(min(WRITE_THREADS, len(files)), "checkpoint-write") as pool:
        futures = [pool.submit(write_encoded, target, *f) for f in files]
        wait(futures)
    digests: dict[str, FileDigest] = {}
    for future in futures:
        digests.update(future.result())
    return digests


def _upload(target: Storage, rel: str, path: Path) -> FileDigest:
    with path.open("rb") as f, target.writer(rel) as w:
        while chunk := f.read(16 << 20):
            w.write(chunk)
    return w.digest()
