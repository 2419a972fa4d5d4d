"""Progress lines for logs, bars for terminals, and third-party noise kept out of both."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core import progress
from core.progress import Progress, stage, track

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


def test_a_stage_without_a_count_says_how_long_it_took_and_when_slow_that_it_started(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="simsearch.progress")
    with stage("export: loading"):
        pass  # quick: one line, its end
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("export: loading — done in ") and lines[0].endswith("s")
    caplog.clear()
    monkeypatch.setattr(progress, "STAGE_START_LINE_S", 0.05)
    with stage("export: tracing the model to ONNX"):
        time.sleep(0.5)  # past the start line's moment: said while it runs, before its end
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "export: tracing the model to ONNX …"
    assert lines[1].startswith("export: tracing the model to ONNX — done in ") and len(lines) == 2
    caplog.clear()
    with stage("quiet", enabled=False):
        time.sleep(0.2)
    assert not caplog.records


def test_an_epoch_counts_without_a_closing_line(caplog):
    caplog.set_level(logging.INFO, logger="simsearch.progress")
    assert list(track(range(3), 3, "epoch 1/2", "batch", mode="lines", closing_line=False)) == [0, 1, 2]
    assert not caplog.records  # the epoch's own line sums it up
    with Progress(3, "epoch 2/2", "batch", mode="lines", every_s=0.0, closing_line=False) as counting:
        counting.update(3)  # a slow epoch: its lines on the way, still no closing one
    assert [r.getMessage()[:19] for r in caplog.records] == ["epoch 2/2: 3/3 batc"]
    assert " — done" not in caplog.records[-1].getMessage()


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


def test_the_first_estimate_comes_after_the_first_batches_not_a_whole_interval_in(caplog):
    """A long build said nothing for its first 30 s (issue 40, item 10)."""
    import time

    caplog.set_level(logging.INFO, logger="simsearch.progress")
    with Progress(1000, "embed", "img", mode="lines", every_s=30, first_s=0.05) as progress:
        progress.update(100)  # the first batch: too soon to say
        time.sleep(0.06)
        progress.update(100)  # an estimate
        progress.update(100)  # then quiet for the interval
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("embed: 200/1,000 img (20%), ") and "eta " in lines[0], lines
    assert lines[1].endswith("— done")


def test_index_build_embeds_with_an_early_estimate(tmp_path, caplog, monkeypatch):
    from core.data.catalog import read_catalog
    from index.build import embed
    from index.embedder import OnnxEmbedder
    from tests.support.index import write_images, write_tiny_model

    write_images(tmp_path / "photos", 30)
    embedder = OnnxEmbedder(write_tiny_model(tmp_path / "model"), provider="cpu")
    monkeypatch.setattr(embed, "FIRST_ESTIMATE_S", 0.0)  # what 10 s of a long build would show
    caplog.set_level(logging.INFO, logger="simsearch.progress")
    embed.embed_catalog(read_catalog(tmp_path / "photos"), embedder, batch_size=10, progress=True)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("embed: 10/30 img (33%), ") and "eta " in lines[0], lines
