"""Credentials never reach a log line or a written file: URLs without `user:password@`, and
storage options with every value not known to be harmless replaced by a marker."""

from __future__ import annotations

import re
from typing import Any


def display_url(url: str) -> str:
    """`url` without any user:password part, for logs and error messages."""
    return re.sub(r"^([a-zA-Z][\w+.-]*://)[^/@]*@", r"\1", url)


# Storage options that never hold a secret; every other value is redacted where it is written.
_PUBLIC_OPTIONS = frozenset(
    {
        "endpoint_url",
        "region_name",
        "anon",
        "use_ssl",
        "verify",
        "client_kwargs",
        "config_kwargs",
        "s3",
        "addressing_style",
        "signature_version",
        "retries",
        "max_attempts",
        "mode",
        "connect_timeout",
        "read_timeout",
        "max_pool_connections",
        "requester_pays",
        "default_block_size",
        "default_fill_cache",
        "version_aware",
        "cache_regions",
        "use_listings_cache",
        "listings_expiry_time",
        "skip_instance_cache",
        "max_concurrency",
        "project",
        "location",
        "auto_mkdir",
    }
)
REDACTED = "<redacted>"


def redact_options(options: Any) -> Any:
    """`options` with every value under a key not known to be public replaced by REDACTED."""
    if isinstance(options, str):
        return display_url(options)
    if not isinstance(options, dict):
        return options
    return {k: redact_options(v) if k in _PUBLIC_OPTIONS else REDACTED for k, v in options.items()}
