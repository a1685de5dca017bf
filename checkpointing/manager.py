"""The checkpoint manager: save and load a mapping of names to Stateful objects, atomically.

Commit protocols (checkpointing/storage.py says which storage does which):

- Local filesystem: every rank writes its files into `.tmp-checkpoint-<step>` (fsynced as they
  are written); rank 0 gathers the digests, writes `manifest.json` last, fsyncs the directory,
  renames it to `checkpoint-<step>` and fsyncs the parent.
- Object store: every rank writes its objects under `checkpoint-<step>/`; rank 0 gathers the
  digests and, only once every object is confirmed written, writes the manifest object: that
  write is the commit. Deleting a checkpoint removes its manifest first.

Either way a kill at any instant leaves the committed set as it was, or that set plus the new
checkpoint: a temp directory never matches `checkpoint-<step>`, and a `checkpoint-<step>` without
a valid manifest is not one.

A save is a snapshot (on the training thread: state encoded and, for a background save, copied
into staging buffers) followed by a write-and-commit (checkpointing/commit.py), which runs on the
training thread or, with `async_save`, on a writer thread over a process group of its own.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from checkpointing.comm import barrier, broadcast_object
from checkpointing.commit import CheckpointSaveError, Committer, Snapshot
from checkpointing.encoding import encode_views
from checkpointing.lease import Lease, LeaseLost
from checkpointing.manifest import Manifest
from checkpointing.restore import Restorer
from checkpointing.retention import TMP_PREFIX, Housekeeping
from checkpointing.staging import BackgroundSave, SaveOutcome, Staging, updated_by_step, wait_for
from checkpointing.stateful import Entry, rank_name
from checkpointing.storage import Storage, as_storage

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Owns `<root>/checkpoint-<step>`: save (sync or in the background), find, verify, load,
    retain."""

    def __init__(
        self,
        root: str | Path | Storage,
        rank: int = 0,
        world_size: int = 1,
        save_total_limit: int | None = None,
        engine: str = "ddp",
        group: Any = None,
        greater_is_better: bool = False,
        async_save: bool = False,
        storage_options: dict[str, Any] | None = None,
        lease: Lease | None = None,
    ) -> None:
        self.storage = as_storage(root)
        self.lease = lease
        """The run's lease (checkpointing/lease.py): checked right before every commit, rename
        and delete; None writes without one."""
        self._restorer = Restorer(self.storage, rank, world_size, group, storage_options)
        # Retention by save_total_limit, ranking by the metric a save records in
        # checks["metric"]["value"] (greater_is_better), deletes and leftovers.
        self.housekeeping = Housekeeping(
            self.storage, rank, save_total_limit, greater_is_better, self._fence
        )
        self.rank = rank
        self.world_size = world_size
        self.engine = engine
        self.group = group  # a CPU (gloo) group for control messages; None: the default one
        self.async_save = async_save
        # The writer thread's collectives must never interleave with the training thread's.
        self._writer_group = None
        if async_save and dist.is_initialized() and dist.get_world_size() > 1:
            self._writer_group = dist.new_group(backend="gloo")
        self._committer = Committer(
            self.storage,
            rank,
            world_size,
            engine,
            self.housekeeping,
            self._fence,
            lambda: self.lease.epoch if self.lease is not None else None,
        )
        self._staging = Staging()
        self._inflight: BackgroundSave | None = None
        self._finished: list[SaveOutcome] = []

    @property
    def root(self) -> str:
        return self.storage.display()

    def _fence(self, what: str) -> None:
        """Raise LeaseLost unless this job still holds the run's lease."""
        if self.lease is not None:
            self.lease.check(what)

    # Retention and cleaning: checkpointing/retention.py.
    def committed(self) -> list[tuple[int, str]]:
        """Checkpoints whose manifest exists (not verified), newest first."""
        return self.housekeeping.committed()

    def newest(self) -> str | None:
        """The newest committed checkpoint's name, read on rank 0 only (None elsewhere, and
        when there is none): what rank 0 broadcasts when every rank must agree on it."""
        committed = self.committed() if self.rank == 0 else []
        return committed[0][1] if committed else None

    def best(self) -> str | None:
        """The committed checkpoint with the best recorded metric (the newest among ties)."""
        return self.housekeeping.best()

    def delete(self, name: str) -> None:
        """Remove a committed checkpoint (fenced by the lease, retried)."""
        self.housekeeping.delete(name)

    def clean_leftovers(self) -> None:
        """Remove what interrupted saves left (rank 0, before any save)."""
        self.housekeeping.clean_leftovers()

    # -- save ----------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        entries: dict[str, Entry],
        trajectory: dict[str, Any],
        config_fingerprint: str,
        checks: dict[str, Any],
        rank_checks: dict[str, Any],
        background: bool = False,
    ) -> list[SaveOutcome]:
        """Save `checkpoint-<step>` on every rank (a collective). Blocking: returns once it is
        committed. `background`: returns once the state is staged, the write and commit go on
        in a thread (see `poll`). Returns the saves that committed meanwhile (this one
        included when blocking). A failed save raises CheckpointSaveError.

        `checks` are global values recorded in the manifest; `rank_checks` are gathered from
        every rank into `checks[key] = [value of rank 0, value of rank 1, ...]`.
        """
        done = self.wait(f"saving checkpoint-{step}")
        for outcome in done:
            if outcome.error is not None:  # every rank waited for the same outcome
                raise outcome.error
        t0 = time.perf_counter()
        header = {
            "trajectory": trajectory,
            "config_fingerprint": config_fingerprint,
            "entries": {n: e.kind for n, e in entries.items()},
            "checks": checks,
        }
        snap = self._snapshot(step, entries, header, rank_checks, stage=background)
        if not background:
            location = self._committer.write_and_commit(snap, self.group)
            return [*done, SaveOutcome(step, location, time.perf_counter() - t0)]
        # Every tensor the writer will read: staging buffers and the private copies encoding
        # made (a GPU tensor is copied to the host there, so the buffers alone undercount).
        held = sum(t.numel() * t.element_size() for _, _, ts in snap.files for t in ts.values())
        logger.info(
            "checkpoint-%d staged in %.2f s (%.1f MB held for the writer); writing in the "
            "background",
            step,
            time.perf_counter() - t0,
            held / 1e6,
        )
        group, copies = self._writer_group, self._staging.enqueued()

        def work() -> str:
            wait_for(copies)  # device-to-host copies still landing in the staging buffers
            return self._committer.write_and_commit(snap, group)

        self._inflight = BackgroundSave(step, work)
        return done

    def poll(self) -> list[SaveOutcome]:
        """Background saves that ended since the last call (committed or failed)."""
        if self._inflight is not None and self._inflight.done():
            self._finished.append(self._inflight.wait())
            self._inflight = None
        out, self._finished = self._finished, []
        return out

    def wait(self, why: str = "", timeout: float | None = None) -> list[SaveOutcome]:
        """Wait for the save in flight (logging the wait), then return what `poll` would.
        With `timeout`, a save still running after it is left to its thread."""
        if self._inflight is not None and not self._inflight.done():
            t0 = time.perf_counter()
            logger.info(
                "waiting for checkpoint-%d (writing in the background)%s",
                self._inflight.step,
                f" before {why}" if why else "",
            )
            if self._inflight.wait(timeout) is None:
                logger.warning(
                    "checkpoint-%d still writing after %.0f s; left uncommitted",
                    self._inflight.step,
                    timeout,
                )
                self._inflight = None
                return self.poll()
            waited = time.perf_counter() - t0
            logger.info("waited %.2f s for checkpoint-%d", waited, self._inflight.step)
        return self.poll()

    def in_flight(self) -> int | None:
        """The step of the save being written in the background, if any."""
        return None if self._inflight is None or self._inflight.done() else self._inflight.step

    def _snapshot(
        self,
        step: int,
        entries: dict[str, Entry],
        header: dict[str, Any],
        rank_checks: dict[str, Any],
        stage: bool,
    ) -> Snapshot:
        local = self.storage.atomic_rename
        # A temp directory of its own per lease epoch: a job that lost the lease and still
        # writes never writes into the holder's.
        epoch = f"-e{self.lease.epoch}" if self.lease is not None else ""
        target = f"{TMP_PREFIX}{step}{epoch}" if local else f"checkpoint-{step}"
        error = None
        if self.rank == 0:
            try:
                self.housekeeping.store(
                    f"preparing {self.storage.display(target)}",
                    lambda: self._prepare_target(target),
                )
            except LeaseLost as e:
                error = e
            except OSError as e:
                error = CheckpointSaveError(f"checkpoint-{step} was not started: {e}")
        error = broadcast_object(error, self.group)  # every rank learns it (a barrier too)
        if error is not None:
            raise error

        files, directories, staged = [], [], None
        # Side-stream copies only for the engine's own model and optimizer (see staging.py).
        engine_state = [entries[n].obj for n in ("model", "optimizer") if n in entries]
        step_only = updated_by_step(engine_state) if stage else set()
        for name, entry in entries.items():
            if entry.kind == "directory":
                # An engine's own save writes local files, a collective: into the temp directory
                # here, or into a local folder each rank uploads from.
                if local:
                    folder = self.storage.local_path(f"{target}/{name}")
                else:
                    staged = staged or Path(tempfile.mkdtemp(prefix=f"checkpoint-{step}-stage-"))
                    folder = staged / name
                    folder.mkdir(parents=True)
                entry.obj.save_to(folder)
                directories.append(name)
                continue
            if not entry.rank_files and self.rank != 0:
                continue
            # A sharded entry's DTensors encode as pieces: each rank writes only its own.
            file = rank_name(name, self.rank) if entry.rank_files else name
            structure, tensors, live = encode_views(entry.obj.state_dict(), keep_cuda=stage)
            if stage:
                tensors = self._staging.stage(file, tensors, live, step_only)
            files.append((file, structure, tensors))
        if directories:
            barrier(self.group)  # every rank's engine files are written before any is hashed
        return Snapshot(step, target, files, directories, staged, header, rank_checks)

    def _prepare_target(self, target: str) -> None:
        """Rank 0, before any rank writes: an empty place for this step's files."""
        self._fence(f"preparing {self.storage.display(target)}")
        if self.storage.atomic_rename:
            root = self.storage.local_path()
            root.mkdir(parents=True, exist_ok=True)
            self.storage.remove(target)  # left by a save that was killed
            (root / target).mkdir()
        elif self.storage.exists(target):
            # An uncommitted attempt, or a checkpoint of an abandoned branch (a run resumed
            # from an older one): its manifest goes first, so that no instant shows a
            # committed checkpoint with objects missing.
            logger.info("removing %s left by an earlier attempt", self.storage.display(target))
            self.housekeeping.delete_once(target)

    # -- find and load ------------------------------------------------------------------------
    def resolve(self, resume_from: str) -> tuple[Storage, Manifest] | None:
        """The verified checkpoint to resume (`latest`, `none`, a path or URL); every rank
        gets the same answer. See checkpointing/restore.py."""
        return self._restorer.resolve(resume_from)

    def load(self, where: Storage, manifest: Manifest, entries: dict[str, Entry]) -> None:
        """Restore every entry from a verified checkpoint, in the mapping's order."""
        self._restorer.load(where, manifest, entries)
