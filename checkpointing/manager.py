"""The checkpoint manager: save and load a mapping of names to Stateful objects, atomically.

Commit protocol (local filesystem): every rank writes its files into `.tmp-checkpoint-<step>`
(fsynced as they are written); rank 0 gathers the digests, writes `manifest.json` last, fsyncs
the directory, renames it to `checkpoint-<step>` and fsyncs the parent. A kill at any instant
leaves the committed set as it was, or that set plus the new checkpoint: a temp directory never
matches `checkpoint-<step>`, and a `checkpoint-<step>` without a valid manifest is not one.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from checkpointing.comm import barrier, broadcast_object, gather_objects
from checkpointing.manifest import (
    MANIFEST,
    CheckpointCorruptError,
    CheckpointError,
    Manifest,
    list_checkpoints,
    list_committed,
    read_manifest,
    verify,
)
from checkpointing.serialize import (
    FileDigest,
    StateFormatError,
    fsync_dir,
    load_state,
    save_state,
    sync_and_digest,
    write_json,
)
from checkpointing.stateful import DirectoryState, Stateful

logger = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-checkpoint-"
TRASH_PREFIX = ".trash-"


@dataclass
class Entry:
    """One piece of state: global entries are written once (rank 0), per-rank ones by every
    rank as `<name>/rank-<r>`; a DirectoryState writes its own files under `<name>/`."""

    obj: Stateful | DirectoryState
    per_rank: bool = False

    @property
    def kind(self) -> str:
        """How the manifest records the entry: global, per_rank or directory."""
        if isinstance(self.obj, DirectoryState) and not isinstance(self.obj, Stateful):
            return "directory"
        return "per_rank" if self.per_rank else "global"


def _rank_name(name: str, rank: int) -> str:
    return f"{name}/rank-{rank:05d}"


class CheckpointManager:
    """Owns `<root>/checkpoint-<step>` directories: save, find, verify, load, retain."""

    def __init__(
        self,
        root: str | Path,
        rank: int = 0,
        world_size: int = 1,
        save_total_limit: int | None = None,
        engine: str = "ddp",
        group: Any = None,
        greater_is_better: bool = False,
    ) -> None:
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.save_total_limit = save_total_limit
        self.engine = engine
        self.group = group  # a CPU (gloo) group for control messages; None: the default one
        # How to rank checkpoints by the metric a save records in checks["metric"]["value"].
        self.greater_is_better = greater_is_better

    # -- save ----------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        entries: dict[str, Entry],
        trajectory: dict[str, Any],
        config_fingerprint: str,
        checks: dict[str, Any],
        rank_checks: dict[str, Any],
    ) -> Path:
        """Write and commit `checkpoint-<step>` on every rank (a collective); return its path.

        `checks` are global values recorded in the manifest; `rank_checks` are gathered from
        every rank into `checks[key] = [value of rank 0, value of rank 1, ...]`.
        """
        t0 = time.perf_counter()
        final = self.root / f"checkpoint-{step}"
        tmp = self.root / f"{TMP_PREFIX}{step}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)  # left by a save that was killed
            tmp.mkdir()
        barrier(self.group)

        digests: dict[str, FileDigest] = {}
        directories = []
        for name, entry in entries.items():
            if entry.kind == "directory":
                entry.obj.save_to(tmp / name)  # a collective: every rank writes its part
                directories.append(name)
            elif entry.per_rank:
                digests.update(save_state(tmp, _rank_name(name, self.rank), entry.obj.state_dict()))
            elif self.rank == 0:
                digests.update(save_state(tmp, name, entry.obj.state_dict()))
        if directories:
            barrier(self.group)  # every rank's files are written before any is hashed
            digests.update(self._hash_share(tmp, directories))
        gathered = gather_objects((digests, rank_checks), self.group)

        if self.rank == 0:
            files: dict[str, dict[str, Any]] = {}
            all_checks = dict(checks)
            for rank_digests, rchecks in gathered:
                for rel, d in rank_digests.items():
                    files[rel] = {"size": d.size, "sha256": d.sha256}
                for key, value in rchecks.items():
                    all_checks.setdefault(key, []).append(value)
            manifest = Manifest(
                step=step,
                world_size=self.world_size,
                engine=self.engine,
                config_fingerprint=config_fingerprint,
                trajectory=trajectory,
                files=dict(sorted(files.items())),
                entries={n: e.kind for n, e in entries.items()},
                checks=all_checks,
                created=time.time(),
            )
            for sub in {p.parent for p in (tmp / rel for rel in files)}:
                fsync_dir(sub)
            write_json(tmp / MANIFEST, asdict(manifest))  # the commit marker, written last
            fsync_dir(tmp)
            self._commit(tmp, final)
            self._retain(keep=final)
            logger.info(
                "saved %s in %.2f s, %.1f MB",
                final.name,
                time.perf_counter() - t0,
                manifest.total_bytes / 1e6,
            )
        barrier(self.group)
        return final

    def _hash_share(self, tmp: Path, directories: list[str]) -> dict[str, FileDigest]:
        """fsync and hash this rank's share of the files under `directories` (written by an
        engine's own save, which neither syncs nor records them). Every rank sees the same
        files and sizes, so each computes the same split: largest first, to the rank with the
        fewest bytes so far, spreading the reading over the ranks whoever wrote what."""
        files = [p for d in directories for p in (tmp / d).rglob("*") if p.is_file()]
        sized = sorted(
            ((p.stat().st_size, p.relative_to(tmp).as_posix()) for p in files), reverse=True
        )
        load = [0] * self.world_size
        mine = []
        for size, rel in sized:
            r = min(range(self.world_size), key=lambda i: (load[i], i))
            load[r] += size
            if r == self.rank:
                mine.append(rel)
        return {rel: sync_and_digest(tmp / rel) for rel in mine}

    def _commit(self, tmp: Path, final: Path) -> None:
        if final.exists():
            # An earlier attempt at this step: uncommitted, corrupt, or left by a run that was
            # resumed from an older checkpoint. rename cannot replace a non-empty directory,
            # so move it aside first; the trash is emptied once the new one is in place.
            final.rename(self.root / f"{TRASH_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}")
        tmp.rename(final)
        fsync_dir(self.root)
        self._empty_trash()

    def _retain(self, keep: Path) -> None:
        """Delete the oldest committed checkpoints beyond save_total_limit, never the one just
        written nor the best by the recorded metric."""
        if not self.save_total_limit:
            return
        protected = {keep, self.best()}
        for _, old in self.committed()[self.save_total_limit :]:
            if old not in protected:
                logger.info("deleting %s (save_total_limit %d)", old.name, self.save_total_limit)
                self._delete(old)

    def best(self) -> Path | None:
        """The committed checkpoint with the best recorded metric (the newest among ties)."""
        scored = []
        for _, path in self.committed():
            metric = read_manifest(path).checks.get("metric")
            if metric is not None:
                scored.append((metric["value"], path))
        if not scored:
            return None
        pick = max if self.greater_is_better else min
        return pick(scored, key=lambda item: item[0])[1]

    def _delete(self, path: Path) -> None:
        # Rename first so that a half-deleted directory never looks like a checkpoint.
        trash = self.root / f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
        path.rename(trash)
        fsync_dir(self.root)
        shutil.rmtree(trash)

    def _empty_trash(self) -> None:
        for p in self.root.glob(f"{TRASH_PREFIX}*"):
            shutil.rmtree(p, ignore_errors=False)

    # -- find and load ------------------------------------------------------------------------
    def clean_leftovers(self) -> None:
        """Remove temp and trash directories of interrupted saves (rank 0, before any save)."""
        if self.rank == 0 and self.root.is_dir():
            for p in [*self.root.glob(f"{TMP_PREFIX}*"), *self.root.glob(f"{TRASH_PREFIX}*")]:
                logger.info("removing %s left by an interrupted save", p.name)
                shutil.rmtree(p)

    def committed(self) -> list[tuple[int, Path]]:
        """Checkpoints whose manifest exists (not verified), newest first."""
        return list_committed(self.root)

    def resolve(self, resume_from: str) -> tuple[Path, Manifest] | None:
        """The verified checkpoint to resume (rank 0 decides, every rank gets the answer).

        `latest`: the newest checkpoint that verifies (corrupt newer ones are reported, one line
        each); None when there is none. `none`: None. A path: that checkpoint, or an error.
        """
        answer: Any = None
        if self.rank == 0:
            try:
                answer = self._resolve_local(resume_from)
            except CheckpointError as e:
                answer = e
        answer = broadcast_object(answer, self.group)
        if isinstance(answer, CheckpointError):
            raise answer
        return answer

    def _resolve_local(self, resume_from: str) -> tuple[Path, Manifest] | None:
        if resume_from == "none":
            return None
        if resume_from != "latest":
            path = Path(resume_from)
            if not path.is_dir():
                raise CheckpointError(f"checkpoint.resume_from: no checkpoint at {path}")
            return path, verify(path)
        for _, path in list_checkpoints(self.root):
            try:
                return path, verify(path)
            except CheckpointCorruptError as e:
                logger.warning("skipping %s: %s", path.name, e)
        return None

    def load(self, path: Path, manifest: Manifest, entries: dict[str, Entry]) -> None:
        """Restore every entry from a verified checkpoint, in the mapping's order."""
        missing = sorted(set(entries) - set(manifest.entries))
        if missing:
            raise CheckpointError(f"{path}: holds no state for {', '.join(missing)}")
        bound = any(e.kind != "global" for e in entries.values())
        if bound and manifest.world_size != self.world_size:
            raise CheckpointError(
                f"{path}: saved by {manifest.world_size} ranks, this run has {self.world_size}"
            )
        for name, entry in entries.items():
            if entry.kind == "directory":
                if manifest.entries[name] != "directory":
                    raise CheckpointError(f"{path}: {name} is not a directory entry there")
                entry.obj.load_from(path / name)  # verified before: sha256 of every file
                continue
            file_name = _rank_name(name, self.rank) if entry.per_rank else name
            try:
                state = load_state(path, file_name)
            except StateFormatError as e:
                raise CheckpointCorruptError(f"refusing to load: {e}") from e
            entry.obj.load_state_dict(state)
