"""Finding, verifying and loading a checkpoint, on every rank together.

Rank 0 lists and reads manifests; every rank verifies a share of the files (its own per-rank
files and, split by size, a share of the others), so the reading is spread over the ranks and
per-rank pieces are read by their ranks only. What a rank then loads from a store that is not a
local filesystem is hashed again as it is parsed (`load_state`), so what is loaded is what was
verified.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from checkpointing.comm import broadcast_object, gather_objects
from checkpointing.digest import digest_stream, recorded
from checkpointing.manifest import (
    CheckpointCorruptError,
    CheckpointError,
    Manifest,
    list_checkpoints,
    read_manifest,
    verify_file,
)
from checkpointing.retry import retrying
from checkpointing.serialize import StateFormatError, load_state
from checkpointing.sharded import SavedState, piece_bases
from checkpointing.stateful import Entry, rank_name, split_by_size
from checkpointing.storage import Storage, open_storage

logger = logging.getLogger(__name__)
# Files a rank verifies at once (the first error, in the share's order, is the one reported).
VERIFY_THREADS = 4


class Restorer:
    """Resolves `resume_from` to a verified checkpoint and loads entries from it."""

    def __init__(
        self,
        storage: Storage,
        rank: int,
        world_size: int,
        group: Any,
        storage_options: dict[str, Any] | None,
    ) -> None:
        self.storage = storage
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.storage_options = storage_options  # for a resume_from URL elsewhere

    def _names(self) -> list[str]:
        listed = retrying(
            f"listing {self.storage.display()}",
            lambda: list_checkpoints(self.storage),
            self.storage.retries,
        )
        return [name for _, name in listed]

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
                names = [resume_from] if explicit else self._names()
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
                # Files on threads of their own: reads and BLAKE3 release the GIL.
                files = manifest.files
                with ThreadPoolExecutor(VERIFY_THREADS, thread_name_prefix="verify") as pool:
                    checks = [(storage, rel, files[rel]) for rel in self._verify_share(manifest)]
                    list(pool.map(lambda c: verify_file(*c), checks))
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
            owner = rank_owner(rel, manifest.entries)
            if owner is not None and owner < self.world_size:
                if owner == self.rank:
                    own.append(rel)
            else:
                rest.append((meta["size"], rel))
        return own + split_by_size(rest, self.world_size, self.rank)

    def load(self, where: Storage, manifest: Manifest, entries: dict[str, Entry]) -> None:
        """Restore every entry from a verified checkpoint, in the mapping's order."""
        missing = sorted(set(entries) - set(manifest.entries))
        required = [n for n in missing if not entries[n].optional]
        if required:
            raise CheckpointError(f"{where.display()}: holds no state for {', '.join(required)}")
        entries = {n: e for n, e in entries.items() if n not in missing}
        if manifest.world_size != self.world_size:
            bound = sorted(
                n
                for n, e in entries.items()
                if e.kind in ("per_rank", "directory") and not e.elastic
            )
            if bound:
                raise CheckpointError(
                    f"{where.display()}: saved by {manifest.world_size} ranks, this run has "
                    f"{self.world_size}, and {', '.join(bound)} cannot be resharded"
                )
        for name, entry in entries.items():
            if entry.kind == "directory":
                if manifest.entries[name] != "directory":
                    raise CheckpointError(
                        f"{where.display()}: {name} is not a directory entry there"
                    )
                self._load_directory(where, manifest, name, entry.obj)
                continue
            if "sharded" in (entry.kind, manifest.entries[name]):
                self._load_sharded(where, manifest, name, entry)
                continue
            file_name = (
                rank_name(name, source_rank(self.rank, manifest.world_size))
                if entry.rank_files
                else name
            )
            try:
                state = load_state(where, file_name, manifest.files)
            except StateFormatError as e:
                raise CheckpointCorruptError(f"refusing to load: {e}") from e
            try:
                entry.obj.load_state_dict(state)
            except ValueError as e:  # the state does not fit this run (sizes, shapes)
                raise CheckpointError(f"{where.display()}: {name}: {e}") from e

    def _load_sharded(self, where: Storage, manifest: Manifest, name: str, entry: Entry) -> None:
        """A sharded entry (or one saved sharded): read by regions, on any number of ranks."""
        saved_kind = manifest.entries[name]
        if saved_kind not in ("sharded", "global"):
            raise CheckpointError(f"{where.display()}: {name} is a {saved_kind} entry there")
        try:
            if saved_kind == "sharded":
                bases = piece_bases(name, manifest.files, manifest.world_size)
                saved = SavedState(
                    where, manifest.files, bases, source_rank(self.rank, manifest.world_size)
                )
            else:
                saved = SavedState(where, manifest.files, [name], 0)
            if entry.kind == "sharded":
                entry.obj.load_pieces(saved)
            else:
                entry.obj.load_state_dict(saved.full())
        except StateFormatError as e:
            raise CheckpointCorruptError(f"refusing to load: {e}") from e
        except ValueError as e:  # the state does not fit this run (names, shapes, dtypes)
            raise CheckpointError(f"{where.display()}: {name}: {e}") from e

    def _load_directory(self, where: Storage, manifest: Manifest, name: str, obj: Any) -> None:
        local = where.local_path(name)
        if local is not None:
            obj.load_from(local)  # verified before: the hash of every file
            return
        # An engine reads local files: download the entry, checking each file as it lands.
        with tempfile.TemporaryDirectory(prefix="checkpoint-load-") as tmp:
            for rel, meta in manifest.files.items():
                if rel.startswith(f"{name}/"):
                    retrying(
                        f"downloading {where.display(rel)}",
                        lambda rel=rel, meta=meta: download(where, rel, Path(tmp) / rel, meta),
                        where.retries,
                    )
            obj.load_from(Path(tmp) / name)


def source_rank(rank: int, saved_world_size: int) -> int:
    """The saved rank whose per-rank piece `rank` loads: itself, or on a different number of
    ranks `rank mod saved_world_size` (deterministic; see Entry.elastic)."""
    return rank % saved_world_size


def rank_owner(rel: str, entries: dict[str, str]) -> int | None:
    """The rank whose per-rank file `rel` is (`<name>/rank-<r>.<ext>`), else None."""
    head, _, tail = rel.partition("/")
    if entries.get(head) not in ("per_rank", "sharded") or not tail.startswith("rank-"):
        return None
    digits = tail[len("rank-") :].split(".", 1)[0]
    return int(digits) if digits.isdigit() else None


def download(where: Storage, rel: str, dest: Path, meta: dict[str, Any]) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with where.open_read(rel) as src, dest.open("wb") as out:
        shutil.copyfileobj(src, out, 16 << 20)
    size, algorithm, digest = recorded(meta)
    with dest.open("rb") as f:
        if digest_stream(f, algorithm) != (size, digest):
            raise CheckpointCorruptError(f"{where.display(rel)}: differs from the manifest")
