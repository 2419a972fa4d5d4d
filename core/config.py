"""Run configuration: dataclass defaults ← optional YAML/TOML file ← command-line flags.

An option is declared once, as a dataclass field made with `option(...)`: its type, default, help,
choices and flag spelling live there, and the command-line parser (`add_options`), the config
file reader (`resolve_config`) and the reference in docs/configuration.md (`options_table`) are
derived from it. A field whose type is itself a dataclass is a section: its options nest in
config files (`[batching]` in TOML, `batching:` in YAML; the flat spelling is read too) and keep
flat flags. Every stage resolves its configuration this way and writes the result next to its
artifact. Checks that read files or datasets belong in a stage's explicit resolve step, not in
the dataclass, so a configuration can be built, printed and documented anywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import tomllib
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration file or value that cannot be used."""


# One spelling for "where does this run": every device option takes these values.
DEVICES = ("auto", "cpu", "gpu")


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    choices: Sequence[str] | None = None,
    flag: str | None = None,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    cli: bool = True,
) -> Any:
    """A configuration field: `help` (and `choices`) are shown by --help and in the reference;
    `flag` overrides the spelling derived from the name (`batch_size` → `--batch-size`); `cli=False`
    keeps it to config files."""
    metadata = {"help": help, "choices": tuple(choices) if choices else None, "flag": flag, "cli": cli}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def section(cls: type, help: str) -> Any:
    """A nested group of options (a dataclass), built from its own defaults."""
    return dataclasses.field(default_factory=cls, metadata={"help": help, "section": True})


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of a configuration class, as the parser, the file reader and the docs see it."""

    name: str  # unique across sections: the flag's dest and the config-file key
    attribute: str  # the field's name on its dataclass (differs where a flag names it)
    section: tuple[str, ...]  # the sections it is nested in, outermost first
    annotation: Any
    default: Any
    help: str
    choices: tuple[str, ...] | None
    flag: str
    cli: bool

    @property
    def is_bool(self) -> bool:
        """A switch (--x / --no-x), unset (None) meaning the default's own rule where it allows None."""
        return self.annotation is bool or set(typing.get_args(self.annotation)) == {bool, type(None)}


def _is_section(f: dataclasses.Field, hint: Any) -> bool:
    return bool(f.metadata.get("section")) or (isinstance(hint, type) and dataclasses.is_dataclass(hint))


def options(cls: type, _section: tuple[str, ...] = ()) -> Iterator[Option]:
    """Every option of `cls`, sections flattened in declaration order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        hint = hints[f.name]
        if _is_section(f, hint):
            yield from options(hint, (*_section, f.name))
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        choices = f.metadata.get("choices")
        if choices is None and typing.get_origin(hint) is typing.Literal:
            choices = tuple(typing.get_args(hint))
        flag = f.metadata.get("flag")
        yield Option(
            name=flag[2:].replace("-", "_") if flag else f.name,
            attribute=f.name,
            section=_section,
            annotation=hint,
            default=default,
            help=f.metadata.get("help", ""),
            choices=choices,
            flag=flag or "--" + f.name.replace("_", "-"),
            cli=f.metadata.get("cli", True),
        )


def _flag_type(opt: Option) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            value = _coerce(opt.flag, text, opt.annotation)
            # "--embedding-dim none" is given, not absent: keep the word, resolve_config reads it as None.
            return text if value is None else value
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{opt.flag}: ")) from None

    convert.__name__ = _type_name(opt.annotation)  # argparse names it in "invalid <type> value"
    return convert


def _type_name(annotation: Any) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return _type_name(args[0])
    if typing.get_origin(annotation) in (list, tuple):
        return f"comma-separated {_type_name(args[0]) if args else 'value'}s"
    if annotation is dict or typing.get_origin(annotation) is dict:
        return "JSON object"
    return getattr(annotation, "__name__", str(annotation))


def _shown_default(opt: Option) -> str | None:
    if opt.default is dataclasses.MISSING or opt.default is None or opt.default == {} or opt.default == "":
        return None
    if opt.is_bool:
        return "on" if opt.default else "off"
    if isinstance(opt.default, (list, tuple)):
        return ",".join(str(v) for v in opt.default)
    return str(opt.default)


def add_options(parser: argparse.ArgumentParser, cls: type, exclude: Sequence[str] = ()) -> None:
    """Flags for every option of `cls` (default None, so `explicit_args` sees what was given)."""
    for opt in options(cls):
        if not opt.cli or opt.name in exclude:
            continue
        shown = _shown_default(opt)
        text = opt.help + (f" (default: {shown})" if shown is not None else "")
        if opt.is_bool:
            parser.add_argument(opt.flag, dest=opt.name, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            parser.add_argument(
                opt.flag, dest=opt.name, type=_flag_type(opt), choices=opt.choices, default=None, help=text,
                metavar=None if opt.choices else opt.name.upper(),
            )  # fmt: skip


def options_table(cls: type, exclude: Sequence[str] = ()) -> str:
    """The Markdown reference of `cls`'s options: flag, config-file key, type, default, help."""
    lines = ["| flag | config key | type | default | what it sets |", "| --- | --- | --- | --- | --- |"]
    for opt in options(cls):
        if opt.name in exclude:
            continue
        key = ".".join((*opt.section, opt.name))  # as a config file nests it (flat: the last part)
        kind = "/".join(opt.choices) if opt.choices else ("on/off" if opt.is_bool else _type_name(opt.annotation))
        flag = (f"`{opt.flag}`" + (f" / `--no-{opt.flag[2:]}`" if opt.is_bool else "")) if opt.cli else "–"
        default = _shown_default(opt)
        text = opt.help.replace("|", "\\|")
        lines.append(f"| {flag} | `{key}` | {kind} | {'' if default is None else f'`{default}`'} | {text} |")
    return "\n".join(lines)


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
        if isinstance(value, str):  # a flag: JSON
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{name}: not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a mapping, got {value!r}")
        return dict(value)
    return value


def _flatten(layer: dict[str, Any], sections: set[str], where: str = "") -> dict[str, Any]:
    """A config file's nested sections read as flat option names (`batching: {max_wait_ms: 2}` is
    `max_wait_ms: 2`)."""
    flat: dict[str, Any] = {}
    for key, value in layer.items():
        key = str(key).replace("-", "_")
        if key in sections and isinstance(value, dict):
            flat.update(_flatten(value, sections, f"{where}{key}."))
        else:
            flat[key] = value
    return flat


def _build(cls: type[T], values: dict[str, Any]) -> T:
    hints = typing.get_type_hints(cls)
    names = {opt.attribute: opt.name for opt in options(cls) if not opt.section}
    kwargs = {}
    for f in dataclasses.fields(cls):
        if _is_section(f, hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], values)
        elif names.get(f.name) in values:
            kwargs[f.name] = values[names[f.name]]
    return cls(**kwargs)


def resolve_config(cls: type[T], *layers: dict[str, Any], spelled: Mapping[str, str] | None = None) -> T:
    """Build `cls` from layers of overrides (later wins), checking names and types; a layer may
    nest options in their sections or name them flat. `spelled`: how the user wrote options
    (their flags, `from_cli`), for the dataclasses' own checks to name them so (`said_as`)."""
    all_options = {opt.name: opt for opt in options(cls)}
    sections = {name for opt in all_options.values() for name in opt.section}
    merged: dict[str, Any] = {}
    for layer in layers:
        layer = _flatten(layer, sections)
        unknown = sorted(set(layer) - set(all_options))
        if unknown:
            raise ConfigError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(all_options))}")
        merged.update(layer)
    values = {k: _coerce(k, v, all_options[k].annotation) for k, v in merged.items()}
    for name, value in values.items():
        choices = all_options[name].choices
        if choices is not None and value is not None and value not in choices:
            raise ConfigError(f"{name}: {value!r} is not one of {', '.join(map(str, choices))}")
    try:
        return _build(cls, values)
    except TypeError as exc:
        raise ConfigError(str(exc)) from exc
    except ValueError as exc:  # a dataclass's own check, naming options by their config keys
        said = said_as(str(exc), spelled or {})
        if said == str(exc):
            raise
        raise ConfigError(said) from exc


def said_as(message: str, spelled: Mapping[str, str]) -> str:
    """`message` with each option it names by its config key (`shard_replicas`) named as the
    user gave it instead (`--shard-replicas`), where `spelled` says; other keys stay keys, as a
    config file spells them."""
    if not spelled:
        return message
    names = "|".join(re.escape(name) for name in sorted(spelled, key=len, reverse=True))

    def said(match: re.Match) -> str:
        # A key of one word is also an ordinary noun ("unknown backbone 'vgg'"): it is the key
        # only where a check names one — opening the message or a clause, or showing its value.
        name = match.group(1)
        opens = match.start() == 0 or message[: match.start()].endswith(("; ", ": "))
        if "_" in name or opens or message.startswith(" (", match.end()):
            return spelled[name]
        return name

    # a whole word: not part of a longer name, a flag already, or a possessive ("the model's")
    return re.sub(rf"(?<![\w-])({names})(?![\w'-])", said, message)


def explicit_args(args: argparse.Namespace, skip: tuple[str, ...] = ("config", "command", "verbose")) -> dict:
    """Flags the user actually gave (parsers use default=None so absence is visible)."""
    return {k: v for k, v in vars(args).items() if v is not None and k not in skip}


def from_cli(cls: type[T], args: argparse.Namespace) -> T:
    """`cls` from the config file under the flags given; a check's error names an option by the
    flag when a flag set it (`--shard-replicas must be at least 1`), by its key when the file did."""
    file_values = load_config_file(args.config) if getattr(args, "config", None) else {}
    flags = explicit_args(args)
    return resolve_config(cls, file_values, flags, spelled=flag_spellings(flags, cls))


def flag_spellings(flags: dict[str, Any], *classes: type) -> dict[str, str]:
    """Each option among `flags` (`explicit_args`) → its flag, for `resolve_config(spelled=…)`."""
    return {opt.name: opt.flag for cls in classes for opt in options(cls) if opt.name in flags}


def to_jsonable(config: Any) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))
