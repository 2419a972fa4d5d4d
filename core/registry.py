"""One name registry for everything a configuration names: losses, backbones, datasets, miners.

    LOSSES = Registry("loss", plural="losses", base=nn.Module, base_label="nn.Module")

    @LOSSES.register("raw_vthm")
    class RawVthmLoss(nn.Module): ...

    LOSSES.alias("multi_similarity", "raw_vthm", options={"margin": "gamma", "epsilon": "margin"})
    loss = LOSSES.create("multi_similarity", margin=0.5)  # RawVthmLoss(gamma=0.5)

Rules, the same for every registry:

* A name is registered once. Registering it again raises, except for a class with the same
  qualified name (``importlib.reload`` re-creates the class; two different classes under one
  name would make configurations silently ambiguous).
* An unknown name raises ``ValueError`` listing the known names (and aliases).
* ``create`` checks keyword options against the entry's signature before calling it, so a typo
  in a configuration is a ``TypeError`` that lists the valid options rather than a traceback
  from deep inside a constructor.
* ``build`` accepts a name or a ready-made instance of ``base`` (a configuration's string or an
  object passed in code).
* An alias is an old spelling of a name, with optional option renames, resolved here and
  nowhere else; ``names()`` lists only canonical names, so iterating a registry never yields
  the same entry twice.

Torch-free, like the rest of ``core``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


def _qualified_name(obj: object) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"  # type: ignore[attr-defined]


def _same_definition(existing: object, new: object) -> bool:
    """Whether ``new`` re-defines ``existing`` (the same class, or the same class reloaded)."""
    return isinstance(existing, type) and isinstance(new, type) and _qualified_name(existing) == _qualified_name(new)


def _signature_options(obj: Callable[..., Any]) -> tuple[dict[str, inspect.Parameter], bool]:
    """Keyword-passable parameters of a class's constructor (or a function) and whether it takes ``**kwargs``."""
    if isinstance(obj, type):
        params = dict(inspect.signature(obj.__init__).parameters)
        params.pop("self", None)
    else:
        params = dict(inspect.signature(obj).parameters)
    takes_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = {
        n: p
        for n, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return named, takes_var_kw


class Registry(Generic[T]):
    """Entries (classes, factories or plain values) by name, plus aliases.

    Args:
        kind: what an entry is, for messages ("loss", "backbone", ...).
        plural: plural of ``kind`` (default ``kind + "s"``).
        base: if given, every entry must be a subclass of it.
        base_label: how messages name ``base`` (default its ``__qualname__``).
    """

    def __init__(
        self, kind: str, plural: str | None = None, base: type | None = None, base_label: str | None = None
    ) -> None:
        self.kind = kind
        self.plural = plural or f"{kind}s"
        self.base = base
        self.base_label = base_label or (base.__qualname__ if base is not None else "")
        self._entries: dict[str, T] = {}
        self._aliases: dict[str, tuple[str, dict[str, str]]] = {}

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"

    def copy(self) -> Registry[T]:
        """An independent registry with the same entries (tests register throw-away entries in it)."""
        other: Registry[T] = Registry(self.kind, self.plural, self.base, self.base_label)
        other._entries = dict(self._entries)
        other._aliases = dict(self._aliases)
        return other

    def register(self, name: str, obj: T | None = None) -> Any:
        """Add ``obj`` under ``name``; without ``obj``, a decorator doing so (it returns the class)."""
        if not isinstance(name, str) or not name or name != name.strip():
            raise ValueError(f"invalid {self.kind} name {name!r}")

        def add(entry: T) -> T:
            if self.base is not None and not (isinstance(entry, type) and issubclass(entry, self.base)):
                raise TypeError(f"{self.kind} {name!r} must be a {self.base_label} subclass, got {entry!r}")
            if name in self._aliases:
                raise ValueError(f"{self.kind} name {name!r} is already an alias of {self._aliases[name][0]!r}")
            existing = self._entries.get(name)
            if existing is not None and not _same_definition(existing, entry):
                where = _qualified_name(existing) if isinstance(existing, type) else repr(existing)
                raise ValueError(f"{self.kind} name {name!r} is already registered to {where}")
            self._entries[name] = entry
            return entry

        return add if obj is None else add(obj)

    def alias(self, name: str, target: str, options: Mapping[str, str] | None = None) -> None:
        """Accept ``name`` for ``target``; ``options`` maps the alias's option names to the target's."""
        if target not in self._entries:
            raise ValueError(f"cannot alias {name!r} to unregistered {self.kind} {target!r}")
        if name in self._entries:
            raise ValueError(f"{self.kind} name {name!r} is already registered")
        self._aliases[name] = (target, dict(options or {}))

    def names(self) -> list[str]:
        """Sorted canonical names (aliases excluded)."""
        return sorted(self._entries)

    def aliases(self) -> dict[str, str]:
        """Alias → canonical name."""
        return {alias: target for alias, (target, _) in sorted(self._aliases.items())}

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._aliases

    def resolve(self, name: str) -> str:
        """The canonical name for ``name`` (itself, or the target of an alias)."""
        if name in self._entries:
            return name
        if name in self._aliases:
            return self._aliases[name][0]
        known = ", ".join(self.names()) or "(none)"
        aliases = ", ".join(f"{a} (= {t})" for a, t in self.aliases().items())
        raise ValueError(
            f"unknown {self.kind} {name!r}; known {self.plural}: {known}" + (f"; aliases: {aliases}" if aliases else "")
        )

    def get(self, name: str) -> T:
        """The entry registered under ``name`` (or under the name it aliases)."""
        return self._entries[self.resolve(name)]

    def build(self, value: Any) -> Any:
        """``value`` itself if it is already an instance of ``base``, else ``create(value)`` with no
        options: how a configuration's name for a default-configured object (a miner, a
        reducer) and a ready-made object are accepted alike."""
        if self.base is not None and isinstance(value, self.base):
            return value
        if not isinstance(value, str) or value not in self:
            raise ValueError(f"{self.kind} must be one of {self.names()} or a {self.base_label} object, got {value!r}")
        return self.create(value)

    def create(self, name: str, /, **options: Any) -> Any:
        """Call the entry for ``name`` with keyword ``options`` (renamed if ``name`` is an alias).

        ``TypeError`` naming the offending options for unknown or missing options (checked
        against the signature first, in the spelling of ``name``); invalid option values raise
        the entry's own errors.
        """
        entry = self.get(name)
        renames = self._aliases[name][1] if name in self._aliases else {}
        spelled = {target: alias for alias, target in renames.items()}  # target's option → alias's spelling
        named, takes_var_kw = _signature_options(entry)  # type: ignore[arg-type]
        valid = [spelled.get(n, n) for n in named]
        if not takes_var_kw:
            unknown = sorted(set(options) - set(valid))
            if unknown:
                raise TypeError(
                    f"{self.kind} {name!r} got unknown option(s) {', '.join(map(repr, unknown))}; "
                    f"valid options: {', '.join(valid) or '(none)'}"
                )
        missing = [spelled.get(n, n) for n, p in named.items() if p.default is inspect.Parameter.empty]
        missing = [n for n in missing if n not in options]
        if missing:
            raise TypeError(f"{self.kind} {name!r} requires option(s) {', '.join(map(repr, missing))}")
        return entry(**{renames.get(k, k): v for k, v in options.items()})  # type: ignore[operator]
