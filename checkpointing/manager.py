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
into staging buffers) followed by a write-and-commit, which runs on the training thread or, with
`async_save`, on a writer thread over a process group of its own.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from checkpointing.comm import barrier, broadcast_object, gather_objects
from checkpointing.manifest import (
    MANIFEST,
    CheckpointCorruptError,
    CheckpointError,
    Manifest,
    checkpoint_step,
    list_checkpoints,
    list_committed,
    read_manifest,
    verify_file,
)
from checkpointing.serialize import (
    FileDigest,
    StateFormatError,
    encode_views,
    json_bytes,
    load_state,
    sync_and_digest,
    write_encoded,
)
from checkpointing.staging import BackgroundSave, SaveOutcome, Staging
from checkpointing.stateful import DirectoryState, Stateful
from checkpointing.storage import (
    Storage,
    StorageError,
    as_storage,
    digest_stream,
    open_storage,
    retrying,
)

logger = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-checkpoint-"
TRASH_PREFIX = ".trash-"


class CheckpointSaveError(StorageError):
    """A save could not be committed (the store failed after its retries, on some rank)."""


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


@dataclass
class _Snapshot:
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


def _split_by_size(sized: list[tuple[int, str]], world_size: int, rank: int) -> list[str]:
    """This rank's share of files: largest first, each to the rank with the fewest bytes so far.
    Every rank computes the same split from the same list."""
    load = [0] * world_size
    mine = []
    for size, rel in sorted(sized, reverse=True):
        r = min(range(world_size), key=lambda i: (load[i], i))
        load[r] += size
        if r == rank:
            mine.append(rel)
    return mine


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
    ) -> None:
        self.storage = as_storage(root)
        self.storage_options = storage_options  # for a resume_from URL elsewhere
        self.rank = rank
        self.world_size = world_size
        self.save_total_limit = save_total_limit
        self.engine = engine
        self.group = group  # a CPU (gloo) group for control messages; None: the default one
        # How to rank checkpoints by the metric a save records in checks["metric"]["value"].
        self.greater_is_better = greater_is_better
        self.async_save = async_save
        # The writer thread's collectives must never interleave with the training thread's.
        self._writer_group = None
        if async_save and dist.is_initialized() and dist.get_world_size() > 1:
            self._writer_group = dist.new_group(backend="gloo")
        self._staging = Staging()
        self._inflight: BackgroundSave | None = None
        self._finished: list[SaveOutcome] = []

    @property
    def root(self) -> str:
        return self.storage.display()

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
        t0 = time.perf_counter()
        header = {
            "trajectory": trajectory,
            "config_fingerprint": config_fingerprint,
            "entries": {n: e.kind for n, e in entries.items()},
            "checks": checks,
        }
        snap = self._snapshot(step, entries, header, rank_checks, stage=background)
        if not background:
            location = self._write_and_commit(snap, self.group)
            return [*done, SaveOutcome(step, location, time.perf_counter() - t0)]
        logger.info(
            "checkpoint-%d staged in %.2f s (%.1f MB held for the writer); writing in the "
            "background",
            step,
            time.perf_counter() - t0,
            self._staging.nbytes / 1e6,
        )
        group = self._writer_group
        self._inflight = BackgroundSave(step, lambda: self._write_and_commit(snap, group))
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
    ) -> _Snapshot:
        local = self.storage.atomic_rename
        target = f"{TMP_PREFIX}{step}" if local else f"checkpoint-{step}"
        if self.rank == 0:
            self._prepare_target(step, target)
        barrier(self.group)

        files, directories, staged = [], [], None
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
            if not entry.per_rank and self.rank != 0:
                continue
            file = _rank_name(name, self.rank) if entry.per_rank else name
            structure, tensors, live = encode_views(entry.obj.state_dict())
            if stage:
                tensors = self._staging.stage(file, tensors, live)
            files.append((file, structure, tensors))
        if directories:
            barrier(self.group)  # every rank's engine files are written before any is hashed
        return _Snapshot(step, target, files, directories, staged, header, rank_checks)

    def _prepare_target(self, step: int, target: str) -> None:
        """Rank 0, before any rank writes: an empty place for this step's files."""
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
            self._delete(target)

    def _write_and_commit(self, snap: _Snapshot, group: Any) -> str:
        """Write this rank's files, gather every rank's digests (or errors), commit on rank 0;
        every rank learns the outcome. Returns the committed checkpoint's location."""
        target = self.storage.child(snap.target)
        digests: dict[str, FileDigest] = {}
        error = None
        try:
            for file, structure, tensors in snap.files:
                digests.update(write_encoded(target, file, structure, tensors))
            if snap.directories:
                digests.update(self._directory_digests(target, snap))
        except Exception as e:
            error = f"rank {self.rank}: {e}"
            logger.error("checkpoint-%d: %s", snap.step, error)
        finally:
            if snap.staged is not None:
                shutil.rmtree(snap.staged, ignore_errors=True)
        gathered = gather_objects((digests, snap.rank_checks, error), group)
        outcome = None
        if self.rank == 0:
            errors = [err for _, _, err in gathered if err]
            if errors:
                outcome = f"checkpoint-{snap.step} was not committed: {errors[0]}"
            else:
                try:
                    self._commit(snap, gathered)
                except Exception as e:
                    outcome = f"checkpoint-{snap.step} was not committed: {e}"
        outcome = broadcast_object(outcome, group)
        if outcome is not None:
            raise CheckpointSaveError(outcome)
        return self.storage.display(f"checkpoint-{snap.step}")

    def _directory_digests(self, target: Storage, snap: _Snapshot) -> dict[str, FileDigest]:
        if snap.staged is None:
            # Local: the engine wrote into the shared temp directory; each rank fsyncs and
            # hashes a share of its files, whoever wrote what.
            root = target.local_path()
            sized = [(target.size(rel), rel) for d in snap.directories for rel in target.files(d)]
            mine = _split_by_size(sized, self.world_size, self.rank)
            return {rel: sync_and_digest(root / rel) for rel in mine}
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

    def _commit(self, snap: _Snapshot, gathered: list[Any]) -> None:
        files: dict[str, dict[str, Any]] = {}
        checks = dict(snap.header["checks"])
        for rank_digests, rchecks, _ in gathered:
            for rel, d in rank_digests.items():
                files[rel] = {"size": d.size, "sha256": d.sha256}
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
        )
        final = f"checkpoint-{snap.step}"
        target = self.storage.child(snap.target)
        data = json_bytes(asdict(manifest))
        if self.storage.atomic_rename:
            for sub in sorted({rel.rpartition("/")[0] for rel in files}):
                target.sync_dir(sub)
            target.write_bytes(MANIFEST, data)  # the commit marker, written last
            target.sync_dir()
            self._rename_into_place(snap.target, final)
        else:
            # Every object is confirmed written (each rank's upload returned): the manifest
            # object is the commit.
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
        self._retain(keep=final)

    def _rename_into_place(self, tmp: str, final: str) -> None:
        if self.storage.exists(final):
            # An earlier attempt at this step: uncommitted, corrupt, or left by a run that was
            # resumed from an older checkpoint. rename cannot replace a non-empty directory,
            # so move it aside first; the trash is emptied once the new one is in place.
            self.storage.rename(final, f"{TRASH_PREFIX}{final}-{uuid.uuid4().hex[:8]}")
        self.storage.rename(tmp, final)
        self.storage.sync_dir()
        self._empty_trash()

    def _retain(self, keep: str) -> None:
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
                    self._delete(old)
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
        """Remove a checkpoint so that no instant shows it committed with files missing."""
        self._delete(name)

    def _delete(self, name: str) -> None:
        if self.storage.atomic_rename:
            # Rename first so that a half-deleted directory never looks like a checkpoint.
            trash = f"{TRASH_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
            self.storage.rename(name, trash)
            self.storage.sync_dir()
            self.storage.remove(trash)
            return
        # No rename on an object store: the manifest goes first, then the objects.
        child = self.storage.child(name)
        retrying(f"deleting {child.display(MANIFEST)}", lambda: child.remove(MANIFEST), 3)
        retrying(f"deleting {child.display()}", lambda: self.storage.remove(name), 3)

    def _empty_trash(self) -> None:
        for name in self.storage.listdir():
            if name.startswith(TRASH_PREFIX):
                self.storage.remove(name)

    # -- find and load ------------------------------------------------------------------------
    def clean_leftovers(self) -> None:
        """Remove what interrupted saves left (rank 0, before any save): temp and trash
        directories, and on object stores `checkpoint-<step>/` objects without a manifest."""
        if self.rank != 0:
            return
        committed = {name for _, name in self.committed()}
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
        return list_committed(self.storage)

    def resolve(self, resume_from: str) -> tuple[Storage, Manifest] | None:
        """The verified checkpoint to resume; every rank gets the same answer.

        `latest`: the newest checkpoint that verifies (corrupt newer ones are reported, one line
        each); None when there is none. `none`: None. A path or URL: that checkpoint, or an
        error. The ranks verify in parallel: each rank its own per-rank files and a share of
        the others, so per-rank pieces are read by their ranks only.
        """
        if resume_from == "none":
            return None
        explicit = resume_from != "latest"
        names: Any = None
        if self.rank == 0:
            try:
                listed = [resume_from] if explicit else list_checkpoints(self.storage)
                names = [n if explicit else n[1] for n in listed]
            except Exception as e:
                names = e
        names = broadcast_object(names, self.group)
        if isinstance(names, BaseException):
            raise names
        for name in names:
            if explicit:
                storage = open_storage(resume_from, self.storage_options, self.storage.retries)
            else:
                storage = self.storage.child(name)
            found = self._verify_together(storage, explicit)
            if found is not None:
                return storage, found
        return None

    def _verify_together(self, storage: Storage, explicit: bool) -> Manifest | None:
        manifest: Any = None
        if self.rank == 0:
            try:
                if explicit and not storage.isdir():
                    raise CheckpointError(
                        f"checkpoint.resume_from: no checkpoint at {storage.display()}"
                    )
                manifest = read_manifest(storage)
            except Exception as e:
                manifest = e
        manifest = broadcast_object(manifest, self.group)
        error: BaseException | None = manifest if isinstance(manifest, BaseException) else None
        if error is None:
            try:
                for rel in self._verify_share(manifest):
                    verify_file(storage, rel, manifest.files[rel])
            except Exception as e:
                error = e
            errors = gather_objects(error, self.group)
            if self.rank == 0:
                # A store failure beats corruption: it says nothing about the checkpoint.
                errors = [e for e in errors if e is not None]
                errors.sort(key=lambda e: isinstance(e, CheckpointCorruptError))
                error = errors[0] if errors else None
            error = broadcast_object(error, self.group)
        if error is None:
            return manifest
        if explicit or not isinstance(error, CheckpointCorruptError):
            raise error
        if self.rank == 0:
            logger.warning("skipping %s: %s", storage.display().rsplit("/", 1)[-1], error)
        return None

    def _verify_share(self, manifest: Manifest) -> list[str]:
        """The files this rank verifies: its own per-rank files, and a share of the rest."""
        own, rest = [], []
        for rel, meta in manifest.files.items():
            owner = _rank_owner(rel, manifest.entries)
            if owner is not None and owner < self.world_size:
                if owner == self.rank:
                    own.append(rel)
            else:
                rest.append((meta["size"], rel))
        return own + _split_by_size(rest, self.world_size, self.rank)

    def load(self, where: Storage, manifest: Manifest, entries: dict[str, Entry]) -> None:
        """Restore every entry from a verified checkpoint, in the mapping's order."""
        missing = sorted(set(entries) - set(manifest.entries))
        if missing:
            raise CheckpointError(f"{where.display()}: holds no state for {', '.join(missing)}")
        bound = any(e.kind != "global" for e in entries.values())
        if bound and manifest.world_size != self.world_size:
            raise CheckpointError(
                f"{where.display()}: saved by {manifest.world_size} ranks, this run has "
                f"{self.world_size}"
            )
        for name, entry in entries.items():
            if entry.kind == "directory":
                if manifest.entries[name] != "directory":
                    raise CheckpointError(
                        f"{where.display()}: {name} is not a directory entry there"
                    )
                self._load_directory(where, manifest, name, entry.obj)
                continue
            file_name = _rank_name(name, self.rank) if entry.per_rank else name
            try:
                state = load_state(where, file_name, manifest.files)
            except StateFormatError as e:
                raise CheckpointCorruptError(f"refusing to load: {e}") from e
            entry.obj.load_state_dict(state)

    def _load_directory(self, where: Storage, manifest: Manifest, name: str, obj: Any) -> None:
        local = where.local_path(name)
        if local is not None:
            obj.load_from(local)  # verified before: sha256 of every file
            return
        # An engine reads local files: download the entry, checking each file as it lands.
        with tempfile.TemporaryDirectory(prefix="checkpoint-load-") as tmp:
            for rel, meta in manifest.files.items():
                if rel.startswith(f"{name}/"):
                    retrying(
                        f"downloading {where.display(rel)}",
                        lambda rel=rel, meta=meta: _download(where, rel, Path(tmp) / rel, meta),
                        where.retries,
                    )
            obj.load_from(Path(tmp) / name)


def _rank_owner(rel: str, entries: dict[str, str]) -> int | None:
    """The rank whose per-rank file `rel` is (`<name>/rank-<r>.<ext>`), else None."""
    head, _, tail = rel.partition("/")
    if entries.get(head) != "per_rank" or not tail.startswith("rank-"):
        return None
    digits = tail[len("rank-") :].split(".", 1)[0]
    return int(digits) if digits.isdigit() else None


def _upload(target: Storage, rel: str, path: Path) -> FileDigest:
    with path.open("rb") as f, target.writer(rel) as w:
        while chunk := f.read(16 << 20):
            w.write(chunk)
    return w.digest()


def _download(where: Storage, rel: str, dest: Path, meta: dict[str, Any]) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with where.open_read(rel) as src, dest.open("wb") as out:
        shutil.copyfileobj(src, out, 16 << 20)
    with dest.open("rb") as f:
        size, sha = digest_stream(f)
    if (size, sha) != (meta["size"], meta["sha256"]):
        raise CheckpointCorruptError(f"{where.display(rel)}: differs from the manifest")
