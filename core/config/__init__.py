"""Typed run configuration: the sections of core/config/sections.py and inputs.py, loaded from
YAML and overridden by `--section.key VALUE` flags.

Precedence is CLI > file > defaults. Unknown keys, wrong types and out-of-range values raise
`ConfigError` with one line naming the key and what is accepted.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from checkpointing.redact import display_url, redact_options
from core.config.checks import ConfigError, _check, first_line
from core.config.inputs import DATA_FORMATS, HF_PREFIX, DataConfig, ModelConfig
from core.config.roles import Role, field_roles
from core.config.sections import (
    OPTIMIZERS,
    SCHEDULERS,
    CheckpointConfig,
    Config,
    EngineConfig,
    EvalConfig,
    OptimConfig,
    RunConfig,
    SchedulerConfig,
    TrainConfig,
    metric_greater_is_better,
)

__all__ = [
    "DATA_FORMATS",
    "DEFAULT_CONFIG",
    "HF_PREFIX",
    "OPTIMIZERS",
    "SCHEDULERS",
    "SECTIONS",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EngineConfig",
    "EvalConfig",
    "ModelConfig",
    "OptimConfig",
    "RunConfig",
    "SchedulerConfig",
    "TrainConfig",
    "build_config",
    "config_roles",
    "dump_config",
    "first_line",
    "load_config",
    "metric_greater_is_better",
    "parse_overrides",
]

SECTIONS: dict[str, type] = typing.get_type_hints(Config)
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check `value` against a field annotation; ints are accepted where floats are."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        # A mapping where the union admits one, text where it admits str, else the first.
        for a in inner:
            if (isinstance(value, dict) and typing.get_origin(a) is dict) or (
                isinstance(value, str) and a is str
            ):
                return _coerce(key, value, a)
        return _coerce(key, value, inner[0])
    if origin is list:
        _check(
            isinstance(value, list) and all(isinstance(v, str) for v in value),
            key,
            f"expected a list of strings, got {value!r}",
        )
        return list(value)
    if origin is dict or annotation is dict:
        _check(isinstance(value, dict), key, f"expected a mapping, got {value!r}")
        return dict(value)
    if annotation is bool:
        _check(isinstance(value, bool), key, f"expected true or false, got {value!r}")
        return value
    if annotation is int:
        _check(
            isinstance(value, int) and not isinstance(value, bool),
            key,
            f"expected an integer, got {value!r}",
        )
        return value
    if annotation is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        _check(ok, key, f"expected a number, got {value!r}")
        return float(value)
    if annotation is str:
        hint = " (quote YAML words such as 'no')" if isinstance(value, bool) else ""
        _check(isinstance(value, str), key, f"expected a string, got {value!r}{hint}")
        return value
    raise TypeError(f"unsupported config annotation {annotation!r} for {key}")


def _build_section(name: str, cls: type, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(valid))
    _check(
        not unknown,
        f"{name}.{unknown[0]}" if unknown else name,
        f"unknown key; valid keys of [{name}]: {', '.join(valid)}",
    )
    kwargs = {k: _coerce(f"{name}.{k}", v, hints[k]) for k, v in values.items()}
    return cls(**kwargs)


def config_roles() -> dict[str, Role | None]:
    """{"section.key": the field's declared Role (core/config/roles.py), None if undeclared}."""
    return {
        f"{section}.{name}": role
        for section, cls in SECTIONS.items()
        for name, role in field_roles(cls).items()
    }


def build_config(values: dict[str, Any]) -> Config:
    """Build and validate a Config from a nested mapping {section: {key: value}}."""
    _check(isinstance(values, dict), "config", "the file must hold a mapping of sections")
    unknown = sorted(set(values) - set(SECTIONS))
    _check(
        not unknown,
        unknown[0] if unknown else "config",
        f"unknown section; valid sections: {', '.join(SECTIONS)}",
    )
    sections = {}
    for name, cls in SECTIONS.items():
        raw = values.get(name) or {}
        _check(isinstance(raw, dict), name, f"section must be a mapping, got {raw!r}")
        sections[name] = _build_section(name, cls, raw)
    return Config(**sections)


def _is_text_field(section: str, name: str) -> bool:
    hint = typing.get_type_hints(SECTIONS[section]).get(name)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return str in typing.get_args(hint)
    return hint is str


def parse_overrides(args: list[str]) -> dict[str, dict[str, Any]]:
    """Parse `--section.key value` / `--section.key=value` flags; values are YAML scalars."""
    out: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        _check(
            arg.startswith("--") and "." in arg,
            arg,
            "expected an override of the form --section.key VALUE or --section.key=VALUE",
        )
        if "=" in arg:
            key, raw = arg[2:].split("=", 1)
            i += 1
        else:
            _check(i + 1 < len(args), arg, "missing value")
            key, raw = arg[2:], args[i + 1]
            i += 2
        section, _, name = key.partition(".")
        _check(section in SECTIONS, f"--{key}", f"unknown section; valid: {', '.join(SECTIONS)}")
        if _is_text_field(section, name) and raw not in ("null", "~"):
            value: Any = raw  # keep words such as `no` or `on` as typed, not as YAML booleans
        else:
            try:
                value = yaml.safe_load(raw) if raw != "" else ""
            except yaml.YAMLError:
                value = raw
        out.setdefault(section, {})[name] = value
    return out


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a YAML file (configs/tiny.yaml when `path` is None) and apply CLI overrides."""
    p = Path(path) if path is not None else DEFAULT_CONFIG
    _check(p.is_file(), "--config", f"no such file {str(p)!r}")
    try:
        values = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config: {p} is not valid YAML ({e.__class__.__name__})") from e
    _check(isinstance(values, dict), "--config", f"{p} must hold a mapping of sections")
    for section, kv in parse_overrides(overrides or []).items():
        current = values.get(section) or {}
        _check(isinstance(current, dict), section, "section must be a mapping")
        values[section] = {**current, **kv}
    return build_config(values)


def dump_config(config: Config) -> str:
    """The config as YAML for config.yaml, with every storage option that may hold a
    credential replaced by a placeholder."""
    values = config.to_dict()
    ck = values["checkpoint"]
    ck["storage_options"] = redact_options(ck["storage_options"])
    if ck["dir"] is not None:
        ck["dir"] = display_url(ck["dir"])
    data = values["data"]
    data["storage_options"] = redact_options(data["storage_options"])
    for key in ("source", "store"):
        if data[key] is not None:
            data[key] = display_url(data[key])
    return yaml.safe_dump(values, sort_keys=False)
