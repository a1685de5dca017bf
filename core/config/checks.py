"""What every config section's checks share: the error type and the one-line checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration a user wrote is invalid; the message is one line naming the key."""


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _read_mapping(path: str, key: str) -> dict[str, Any]:
    """A JSON or YAML file holding a mapping (JSON is YAML, so one parser reads both), or such
    a mapping written inline (`--engine.deepspeed_config '{zero_optimization: {stage: 2}}'`)."""
    inline = path.lstrip().startswith("{")
    p = Path(path)
    _check(inline or p.is_file(), key, f"no such file {path!r}")
    try:
        value = yaml.safe_load(path if inline else p.read_text())
    except yaml.YAMLError as e:
        why = e.__class__.__name__
        raise ConfigError(f"{key}: {path} is not valid JSON or YAML ({why})") from e
    _check(isinstance(value, dict), key, f"{path} must hold a mapping")
    return value


def _one_of(value: str, key: str, accepted: tuple[str, ...]) -> None:
    _check(value in accepted, key, f"unknown value {value!r}; accepted: {', '.join(accepted)}")


def first_line(e: BaseException) -> str:
    """An exception's message cut to its first line (its type when it has none): what a
    one-line error quotes of a library's error."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
