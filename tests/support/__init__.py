"""Helpers only tests use — fake datasets, images, loopback servers, small models — shared by
test modules, which never import one another."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
