"""Shared command-line behaviour: user errors become one clear line and exit code 2."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from index.artifacts import ArtifactError
from index.catalog import CatalogError
from index.config import ConfigError
from index.preprocess import ImageDecodeError

USER_ERRORS: tuple[type[BaseException], ...] = (
    ArtifactError,
    CatalogError,
    ConfigError,
    ImageDecodeError,
    FileNotFoundError,
    ValueError,
)


def run_cli(command: Callable[[], None]) -> int:
    """Run a command; print user errors without a traceback (exit 2), keep tracebacks for bugs."""
    try:
        command()
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception:
        logging.getLogger("simsearch").exception("unexpected failure")
        return 1
    return 0
