"""Run configuration: dataclass defaults ← optional YAML/TOML file ← command-line flags.

Every stage resolves its configuration this way and writes the result next to its artifact.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration file or value that cannot be used."""


def load_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() == ".toml":
            data = tomllib.loads(text)
        elif path.suffix.lower() in (".yaml", ".yml", ".json"):
            data = yaml.safe_load(text)
        else:
            raise ConfigError(f"{path}: config must be .yaml, .yml, .toml or .json")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot parse: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of option names to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args and str not in args:
            return None  # how a flag spells "unset" where the field is not a string (--embedding-dim none)
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(name, value, arg)
            except ConfigError:
                continue
        raise ConfigError(f"{name}: {value!r} is not a valid {annotation}")
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        items = [_coerce(name, v, inner) for v in value]
        return tuple(items) if origin is tuple else items
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if annotation in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        try:
            number = annotation(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: expected {annotation.__name__}, got {value!r}") from None
        if annotation is int and isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        return number
    if annotation is str:
        if not isinstance(value, (str, int, float)):
            raise ConfigError(f"{name}: expected a string, got {value!r}")
        return str(value)
    if annotation is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a mapping, got {value!r}")
        return dict(value)
    return value


def resolve_config(cls: type[T], *layers: dict[str, Any]) -> T:
    """Build `cls` from layers of overrides (later wins), checking names and types."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    merged: dict[str, Any] = {}
    for layer in layers:
        unknown = sorted(set(layer) - fields)
        if unknown:
            raise ConfigError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
        merged.update({k: v for k, v in layer.items()})
    values = {k: _coerce(k, v, hints[k]) for k, v in merged.items()}
    try:
        return cls(**values)
    except TypeError as exc:
        raise ConfigError(str(exc)) from exc


def explicit_args(args: argparse.Namespace, skip: tuple[str, ...] = ("config", "command", "verbose")) -> dict:
    """Flags the user actually gave (parsers use default=None so absence is visible)."""
    return {k: v for k, v in vars(args).items() if v is not None and k not in skip}


def from_cli(cls: type[T], args: argparse.Namespace) -> T:
    file_values = load_config_file(args.config) if getattr(args, "config", None) else {}
    return resolve_config(cls, file_values, explicit_args(args))


def to_jsonable(config: Any) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))
