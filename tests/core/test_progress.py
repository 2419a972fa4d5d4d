"""Progress lines for logs, bars for terminals, and third-party noise kept out of both."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from core.progress import Progress, track

ROOT = Path(__file__).resolve().parents[2]


def test_lines_come_every_interval_with_rate_and_eta(caplog):
    caplog.set_level(logging.INFO, logger="simsearch.progress")
    with Progress(1000, "embed", "img", mode="lines", every_s=0) as progress:
        progress.update(250)
        progress.update(250)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("embed: 250/1,000 img (25%), ") and "img/s" in lines[0] and "eta " in lines[0]
    assert lines[1].startswith("embed: 500/1,000 img (50%)")
    assert lines[-1].startswith("embed: 500/1,000 img (50%)") and lines[-1].endswith("— done")


def test_quiet_between_intervals_and_off_means_off(caplog):
    caplog.set_level(logging.INFO, logger="simsearch.progress")
    assert list(track(range(5), 5, "rows", "row", mode="lines")) == [0, 1, 2, 3, 4]
    assert [r.getMessage()[:14] for r in caplog.records] == ["rows: 5/5 row "]  # only the closing line
    caplog.clear()
    assert list(track(range(5), 5, "rows", mode="off")) == [0, 1, 2, 3, 4]
    assert not caplog.records
    with pytest.raises(ValueError, match="progress mode must be"):
        Progress(1, "x", mode="loud")


def test_auto_is_lines_when_stderr_is_not_a_terminal():
    assert Progress(1, "x").mode == "lines"  # pytest captures stderr: not a tty


CHATTER = "import logging; from core.cli import configure_logging; configure_logging({}); import faiss"


@pytest.mark.parametrize("verbose", [False, True])
def test_faiss_loader_lines_only_with_verbose(verbose):
    done = subprocess.run(
        [sys.executable, "-c", CHATTER.format(verbose)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert ("Loading faiss" in done.stderr) == verbose
