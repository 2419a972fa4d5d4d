"""bench_shards (issues 42, 47): a tiny run of each part prints its table (the query part with its
224-px image rows); bad flags are one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "benchmarks.bench_shards", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_a_tiny_run_prints_the_build_and_rerank_tables():
    tiny = [
        "--rows", "3000", "--dim", "16", "--shards", "2", "--factory", "Flat", "--factory", "IVF8,Flat",
        "--train-size", "1000", "--nlist", "8", "--pq", "4", "--queries", "32",
    ]  # fmt: skip
    out = ""
    for part in ("build", "rerank"):  # the query part starts servers: its own test, below
        done = run("--part", part, *tiny)
        assert done.returncode == 0, done.stderr
        out += done.stdout
    assert "S = 2 shards" in out and "cores (parallel/sequential can be at most min(S, cores)" in out
    build = [line for line in out.splitlines() if line.startswith(("| Flat |", "| IVF8,Flat |"))]
    assert len(build) == 2 and all(line.count("|") == 9 and "MB /" in line for line in build)
    rerank = [line for line in out.splitlines() if line.startswith(("| 1 |", "| 32 |"))]
    assert len(rerank) == 2 and all(line.count("×") == 2 and "ms |" in line for line in rerank)


def test_bad_flags_are_one_line():
    done = run("--part", "build", "--rows", "3", "--shards", "4")
    assert done.returncode == 2 and "--shards must be between 1 and --rows, got 4" in done.stderr


@pytest.mark.slow
def test_the_query_part_has_an_image_row_beside_the_embedding_rows():
    """Issue 47: 224-px JPEG image queries on the same model for the single process and each
    `serve --ray`, in the same run, each row against the single process's at its concurrency."""
    done = run(
        "--part", "query", "--rows", "2000", "--dim", "16", "--query-shards", "1", "--query-concurrency", "1",
        "--image-concurrency", "4", "--query-seconds", "1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith(("| single", "| serve --ray"))]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("| single process", "embedding", "1"),
        ("| serve --ray, S = 1", "embedding", "1"),
        ("| single process", "image, 224 px", "4"),
        ("| serve --ray, S = 1", "image, 224 px", "4"),
    ]
    assert rows[2][-1] == "1.00× |" and all(float(r[3]) > 0 for r in rows)
    assert "224-px JPEG image queries" in done.stdout
