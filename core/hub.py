"""Where an `hf:` name points: a local directory, or a Hugging Face Hub id.

A name that exists on disk is a directory; one that looks like a path (absolute, `./`, `~`, or
more than one `/`) but does not exist is refused as a missing directory; anything else
(`gpt2`, `org/name`) is a hub id, fetched by transformers where the hub, or its cache with
`HF_HUB_OFFLINE=1`, is reachable.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from core.config import HF_PREFIX, ConfigError


@dataclass(frozen=True)
class HFLocation:
    spec: str
    """What the config says, without `hf:`."""
    local: Path | None
    """The directory, or None for a hub id."""

    @property
    def where(self) -> str:
        """What transformers' from_pretrained is given."""
        return str(self.local) if self.local is not None else self.spec

    def __str__(self) -> str:
        return self.where


def hf_location(name: str, key: str, error: type[ValueError] = ConfigError) -> HFLocation:
    """Resolve `hf:<dir or id>` given under config key `key`; `error` for a missing directory."""
    spec = name[len(HF_PREFIX) :] if name.startswith(HF_PREFIX) else name
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise error(f"{key}: {spec} is a file; give the directory save_pretrained wrote")
        return HFLocation(spec, path)
    looks_like_path = spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or "\\" in spec
    if looks_like_path:
        raise error(f"{key}: no such directory {spec!r}")
    return HFLocation(spec, None)
