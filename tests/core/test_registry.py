"""core.registry: the one name registry losses, backbones and datasets use."""

from __future__ import annotations

import pytest

from core.registry import Registry


class Base:
    pass


def make_registry() -> Registry:
    registry: Registry = Registry("widget", base=Base)

    @registry.register("plain")
    class Plain(Base):
        def __init__(self, size: int = 1, colour: str = "red") -> None:
            self.size, self.colour = size, colour

    @registry.register("needs_size")
    class NeedsSize(Base):
        def __init__(self, size: int) -> None:
            self.size = size

    return registry


def test_register_get_create_and_names() -> None:
    registry = make_registry()
    assert registry.names() == ["needs_size", "plain"]
    assert "plain" in registry and "nope" not in registry
    widget = registry.create("plain", size=3)
    assert isinstance(widget, registry.get("plain")) and widget.size == 3 and widget.colour == "red"


def test_unknown_name_lists_the_known_ones() -> None:
    registry = make_registry()
    with pytest.raises(ValueError, match=r"unknown widget 'nope'; known widgets: needs_size, plain$"):
        registry.get("nope")
    empty: Registry = Registry("loss", plural="losses")
    with pytest.raises(ValueError, match=r"unknown loss 'x'; known losses: \(none\)"):
        empty.create("x")


def test_options_are_checked_against_the_signature() -> None:
    registry = make_registry()
    with pytest.raises(TypeError, match=r"widget 'plain' got unknown option\(s\) 'sise'; valid options: size, colour"):
        registry.create("plain", sise=2)
    with pytest.raises(TypeError, match=r"widget 'needs_size' requires option\(s\) 'size'"):
        registry.create("needs_size")


def test_a_name_is_registered_once() -> None:
    registry = make_registry()

    class Other(Base):
        pass

    with pytest.raises(ValueError, match="already registered"):
        registry.register("plain", Other)
    # The same class defined again (what importlib.reload does) is harmless.
    again = type("Plain", (Base,), {"__module__": registry.get("plain").__module__})
    again.__qualname__ = registry.get("plain").__qualname__
    registry.register("plain", again)
    # Plain values (not classes) are never re-registered, not even the same object.
    values: Registry = Registry("spec")
    spec = object()
    values.register("a", spec)
    with pytest.raises(ValueError, match="already registered"):
        values.register("a", spec)


def test_base_class_and_name_are_checked() -> None:
    registry = make_registry()
    with pytest.raises(TypeError, match="must be a Base subclass"):
        registry.register("dict")(dict)
    assert "dict" not in registry
    for bad in ("", " padded", 3):
        with pytest.raises(ValueError, match="invalid widget name"):
            registry.register(bad)  # type: ignore[arg-type]


def test_alias_renames_options_in_one_place() -> None:
    registry = make_registry()
    registry.alias("old_plain", "plain", options={"width": "size"})
    assert registry.names() == ["needs_size", "plain"]  # aliases are not listed twice
    assert registry.aliases() == {"old_plain": "plain"}
    assert registry.resolve("old_plain") == "plain" and registry.get("old_plain") is registry.get("plain")
    widget = registry.create("old_plain", width=5, colour="blue")
    assert (widget.size, widget.colour) == (5, "blue")
    # The alias speaks its own spelling only.
    with pytest.raises(TypeError, match=r"'old_plain' got unknown option\(s\) 'size'; valid options: width, colour"):
        registry.create("old_plain", size=5)
    with pytest.raises(ValueError, match=r"known widgets: needs_size, plain; aliases: old_plain \(= plain\)"):
        registry.get("nope")
    with pytest.raises(ValueError, match="unregistered"):
        registry.alias("x", "nope")
    with pytest.raises(ValueError, match="already registered"):
        registry.alias("plain", "needs_size")
    with pytest.raises(ValueError, match="already an alias"):
        registry.register("old_plain", registry.get("plain"))


def test_copy_is_independent() -> None:
    registry = make_registry()
    copy = registry.copy()

    @copy.register("extra")
    class Extra(Base):
        pass

    assert "extra" in copy and "extra" not in registry


def test_build_takes_a_name_or_an_instance() -> None:
    registry = make_registry()
    assert isinstance(registry.build("plain"), registry.get("plain"))
    ready = registry.create("plain", size=7)
    assert registry.build(ready) is ready
    for bad in ("nope", 3):
        with pytest.raises(ValueError, match=r"widget must be one of \['needs_size', 'plain'\] or a Base object"):
            registry.build(bad)
