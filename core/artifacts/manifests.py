"""What every typed manifest shares: its fields read and checked, its schema version, and the
file read and written. The manifests themselves: a model artifact's and a text model's
(`core.artifacts.model_manifests`), an index version's with the quality report inside it
(`core.artifacts.index_manifest`).

Each is the one reader and the one writer of its `manifest.json`: the keys on disk are those
the stages have always written, plus `schema_version` (a manifest without one is version 1).
A key this code does not know is kept (`extra`) and written back unchanged. A manifest that is
not what it should be raises `ArtifactError` naming the file and the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from core.artifacts.layout import MANIFEST, ArtifactError, read_manifest, write_json_atomic

SCHEMA_VERSION = 1  # the version these classes write; files without the field are version 1
SCHEMA_KEY = "schema_version"

NUMBER = (int, float)
M = TypeVar("M", bound="Manifest")


class ManifestFields:
    """Reads the fields of one manifest dict, each checked, with errors naming file and field."""

    def __init__(self, data: Mapping[str, Any], source: str, section: str = "") -> None:
        if not isinstance(data, Mapping):
            what = section or "the manifest"
            raise ArtifactError(f"{source}: {what} must be a JSON object, got {type(data).__name__}")
        self.data, self.source, self.section = data, source, section
        self.used: set[str] = set()

    def get(self, name: str, types: type | tuple[type, ...], required: bool = True, default: Any = None) -> Any:
        self.used.add(name)
        where = f"{self.section}.{name}" if self.section else name
        if name not in self.data:
            if required:
                raise ArtifactError(f"{self.source}: field {where!r} is missing")
            return default
        value = self.data[name]
        if value is None and not required:
            return None
        # bool is an int in Python, never a count or a figure in a manifest
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
            wanted = " or ".join(t.__name__ for t in _tuple(types))
            raise ArtifactError(f"{self.source}: field {where!r} must be {wanted}, got {value!r}")
        return value

    def section_of(self, name: str, required: bool = True) -> ManifestFields | None:
        value = self.get(name, dict, required)
        if value is None:
            return None
        return ManifestFields(value, self.source, f"{self.section}.{name}" if self.section else name)

    def rest(self) -> dict[str, Any]:
        return {k: v for k, v in self.data.items() if k not in self.used}


def _tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def without_none(d: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """`d` less those of `keys` that are None: fields written only when they have a value."""
    return {k: v for k, v in d.items() if not (k in keys and v is None)}


class Manifest:
    """The file-level half every manifest shares: schema version, read, write."""

    schema_version: int
    extra: dict[str, Any]
    _READS: ClassVar[int] = SCHEMA_VERSION  # the newest schema version this class reads

    @classmethod
    def from_dict(cls: type[M], data: Mapping[str, Any], source: str | Path = MANIFEST) -> M:
        fields = ManifestFields(data, str(source))
        version = fields.get(SCHEMA_KEY, int, required=False, default=1)
        if not 1 <= version <= cls._READS:
            raise ArtifactError(
                f"{source}: field {SCHEMA_KEY!r} is {version}; this simsearch reads versions 1 to {cls._READS}"
            )
        return cls._parse(fields, version)

    @classmethod
    def _parse(cls: type[M], fields: ManifestFields, version: int) -> M:
        raise NotImplementedError

    def _dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        return {**self.extra, **self._dict(), SCHEMA_KEY: self._writes()}

    def _writes(self) -> int:
        """The schema version this manifest is written as."""
        return SCHEMA_VERSION

    def _values(self) -> dict[str, Any]:
        """The dataclass fields as they are (not yet JSON), less the file-level ones."""
        skip = ("extra", "schema_version")
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}

    @classmethod
    def read(cls: type[M], directory: str | Path) -> M:
        return cls.from_dict(read_manifest(directory), Path(directory) / MANIFEST)

    def write(self, directory: str | Path) -> Path:
        return write_json_atomic(Path(directory) / MANIFEST, self.to_dict())
