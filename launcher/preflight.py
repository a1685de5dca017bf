"""Checks made before anything is built: a run that cannot write its directory fails in a second,
with the fix, instead of after its data and model are built (and then as a storage error that
says to relaunch once the store is reachable, the wrong fix for a permission)."""

from __future__ import annotations

import os
from pathlib import Path

from checkpointing.storage import local_path
from core.config import Config, ConfigError


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    # os.path.exists, not Path.exists: a folder this uid cannot search is "not there", and the
    # walk stops at the one above it, which is then the folder reported
    while not os.path.exists(path) and path != path.parent:
        path = path.parent
    return path


def check_writable(config: Config) -> None:
    """Raise ConfigError when this process cannot create or write run.output_dir (or a local
    checkpoint.dir): the directory, or the nearest existing folder above it, is checked with
    this process's uid and groups (access(2), so a read-only mount fails too)."""
    places = [("run.output_dir", config.run.output_dir)]
    if config.checkpoint.dir:
        places.append(("checkpoint.dir", config.checkpoint.dir))
    for key, where in places:
        path = local_path(where)
        if path is None:
            continue
        found = _nearest_existing(Path(path))
        if not found.is_dir() or os.access(found, os.W_OK | os.X_OK):
            continue  # a file in the way is reported where the directory is made
        st = found.stat()
        uid, gid = os.getuid(), os.getgid()
        raise ConfigError(
            f"{key}: {where} is not writable by this process (uid {uid}, gid {gid}): {found} "
            f"is owned by uid {st.st_uid} (gid {st.st_gid}, mode {st.st_mode & 0o7777:04o}); "
            f"give it to this user (on the host or volume: chown -R {uid}:{gid} {found}) or run "
            f"as its owner (docker run --user {st.st_uid})"
        )
