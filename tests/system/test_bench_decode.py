"""benchmarks/bench_decode.py: both decoding paths measured, the reduced one really reduced."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULE = "benchmarks.bench_decode"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", MODULE, *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_rows_compare_the_fair_and_reduced_paths():
    done = run("--sizes", "1600x1200", "--formats", "JPEG", "PNG", "--gaps", "2", "--repeats", "1", "--no-embeddings")
    assert done.returncode == 0, done.stderr
    rows = {
        line.split("|")[2].strip(): line.split("|") for line in done.stdout.splitlines() if line.startswith("| 1600")
    }
    # mobilenet_v2's contract: shorter side to 256, gap 2 → a JPEG may be decoded down to 512: 1/2.
    assert rows["JPEG"][6].strip() == "800x600"
    assert rows["PNG"][6].strip() == "1600x1200"  # PNG has no reduced-scale decoding
    for row in rows.values():
        assert float(row[8].strip().rstrip("x")) > 0 and float(row[10].split("/")[0]) < 1.0


def test_bad_flags_are_one_clear_line():
    cases = [
        (["--sizes", "12x"], "--sizes takes WIDTHxHEIGHT values"),
        (["--gaps", "0.5"], "--gaps must be at least 1"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--model-dir", "/no/such/dir"], "is not a directory"),
    ]
    with ThreadPoolExecutor(len(cases)) as pool:  # each run imports torch: seconds, not work
        results = list(pool.map(lambda case: run(*case[0]), cases))
    for (args, message), done in zip(cases, results, strict=True):
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
