"""The environment is the lock: every package `make setup` installs is pinned in requirements.lock,
each pin satisfies pyproject.toml's range, and the installed packages are the pinned ones."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements.lock"


def locked() -> dict[str, str]:
    """The lock's pins by canonical package name."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and version, f"requirements.lock: {line!r} is not name==version"
        pins[canonicalize_name(name)] = version
    return pins


def project_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in project["dependencies"] + extras["train"] + extras["dev"]]


def test_every_requirement_is_pinned_within_its_range():
    pins = locked()
    for requirement in project_requirements():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is required by pyproject.toml but not pinned: run `make lock`"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"the lock pins {requirement.name}=={pins[name]} outside pyproject.toml's {requirement.specifier}: "
            "run `make lock`"
        )


def test_the_installed_environment_is_the_locked_one():
    drifted = []
    for name, version in locked().items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            drifted.append(f"{name} (pinned {version}) is not installed")
            continue
        if installed != version:
            drifted.append(f"{name} {installed} is installed, the lock pins {version}")
    assert not drifted, "; ".join(drifted) + " — run `make setup`"
