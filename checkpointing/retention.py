"""What a checkpoint manager does around its saves: fencing with the lease, putting a save in
place, retention, deletes, and cleaning what interrupted saves left.

A CheckpointManager (checkpointing/manager.py) holds one `Housekeeping` over its storage and
hands it the fence: the manager's check that this job still holds the run's lease.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import TypeVar

from checkpointing.lease import CLAIMS, LEASE, LeaseLost
from checkpointing.manifest import MANIFEST, checkpoint_step, list_committed, read_manifest
from checkpointing.retry import retrying
from checkpointing.storage import Storage

logger = logging.getLogger("checkpointing.manager")  # one logger for what a manager does
T = TypeVar("T")

TMP_PREFIX = ".tmp-checkpoint-"
TRASH_PREFIX = ".trash-"


class Housekeeping:
    """Putting saves in place, retention, deletes and leftovers of the checkpoints under
    `storage`. `fence(what)` raises LeaseLost unless this job still holds the run's lease: it is
    called right before every rename and delete."""

    def __init__(
        self,
        storage: Storage,
        rank: int,
        save_total_limit: int | None,
        greater_is_better: bool,
        fence: Callable[[str], None],
    ) -> None:
        self.storage = storage
        self.rank = rank
        self.save_total_limit = save_total_limit
        self.greater_is_better = greater_is_better
        self._fence = fence

    @property
    def root(self) -> str:
        return self.storage.display()

    def rename_into_place(self, tmp: str, final: str) -> None:
        self._fence(f"renaming {tmp} to {final}")
        if self.storage.exists(final):
            # An earlier attempt at this step: uncommitted, corrupt, or left by a run that was
            # resumed from an older checkpoint. rename cannot replace a non-empty directory,
            # so move it aside first; the trash is emptied once the new one is in place.
            self.storage.rename(final, f"{TRASH_PREFIX}{final}-{uuid.uuid4().hex[:8]}")
        self.storage.rename(tmp, final)
        self.storage.sync_dir()
        self._empty_trash()

    def retain(self, keep: str) -> None:
        """Delete the oldest committed checkpoints beyond save_total_limit, never the one just
        written nor the best by the recorded metric. A store error here is logged: the new
        checkpoint is committed, and the next save tries again."""
        if not self.save_total_limit:
            return
        try:
            protected = {keep, self.best()}
            for _, old in self.committed()[self.save_total_limit :]:
                if old not in protected:
                    logger.info("deleting %s (save_total_limit %d)", old, self.save_total_limit)
                    self.delete(old)
        except LeaseLost as e:  # the checkpoint committed; the loop stops at the next step
            logger.error("retention: %s", e)
        except OSError as e:
            logger.warning("retention: %s; the next save retries", e)

    def best(self) -> str | None:
        """The committed checkpoint with the best recorded metric (the newest among ties)."""
        scored = []
        for _, name in self.committed():
            metric = read_manifest(self.storage.child(name)).checks.get("metric")
            if metric is not None:
                scored.append((metric["value"], name))
        if not scored:
            return None
        pick = max if self.greater_is_better else min
        return pick(scored, key=lambda item: item[0])[1]

    def delete(self, name: str) -> None:
        """Remove a checkpoint so that no instant shows it committed with files missing
        (retried; StorageError when the store keeps failing)."""
        self.store(f"deleting {self.storage.display(name)}", lambda: self.delete_once(name))

    def delete_once(self, name: str) -> None:
        """`delete` without its retries: inside an operation that is retried as a whole."""
        self._fence(f"deleting {self.storage.display(name)}")
        if self.storage.atomic_rename:
            # Rename first so that a half-deleted directory never looks like a checkpoint.
            trash = f"{TRASH_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
            self.storage.rename(name, trash)
            self.storage.sync_dir()
            self.storage.remove(trash)
            return
        # No rename on an object store: the manifest goes first, then the objects.
        child = self.storage.child(name)
        child.remove(MANIFEST)
        self.storage.remove(name)

    def _empty_trash(self) -> None:
        for name in self.storage.listdir():
            if name.startswith(TRASH_PREFIX):
                self.storage.remove(name)

    def clean_leftovers(self) -> None:
        """Remove what interrupted saves left (rank 0, before any save): temp and trash
        directories, and on object stores `checkpoint-<step>/` objects without a manifest."""
        if self.rank == 0:
            self.store(f"cleaning {self.root}", self._clean_leftovers)

    def _clean_leftovers(self) -> None:
        self._fence(f"cleaning {self.root}")
        committed = {name for _, name in list_committed(self.storage)}
        for folder in ("", CLAIMS):  # a lease file's copy left by a kill mid-write
            for name in self.storage.listdir(folder):
                if name.startswith(f".{LEASE}." if not folder else "."):
                    self.storage.remove(f"{folder}/{name}" if folder else name)
        for name in self.storage.listdir():
            leftover = name.startswith((TMP_PREFIX, TRASH_PREFIX)) or (
                not self.storage.atomic_rename
                and checkpoint_step(name) is not None
                and name not in committed
            )
            if leftover:
                logger.info("removing %s left by an interrupted save", self.storage.display(name))
                self.storage.remove(name)

    def committed(self) -> list[tuple[int, str]]:
        """Checkpoints whose manifest exists (not verified), newest first."""
        return self.store(f"listing {self.root}", lambda: list_committed(self.storage))

    def store(self, what: str, fn: Callable[[], T]) -> T:
        """A store operation of the training thread, retried; StorageError when it fails."""
        return retrying(what, fn, self.storage.retries)
