"""benchmarks/bench_text.py (issue 49): text and image queries on one server, interleaved, on the
demo's artifacts — the served text answers equal the offline search of the same text model, and
every level of both kinds is measured without an error."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_text", *args], capture_output=True, text=True, cwd=ROOT, timeout=900
    )


def test_text_and_image_queries_measured_on_one_server(demo_run):
    done = run("--run", str(demo_run), "--seconds", "1", "--repeats", "1")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    same = re.search(r"equal the offline text → image search: (\d+) of (\d+) phrases", done.stdout)
    assert same and same.group(1) == same.group(2) and int(same.group(2)) > 0
    rows = [line.split("|") for line in done.stdout.splitlines() if re.match(r"\s+(1|8|32) \|", line)]
    assert [int(row[0]) for row in rows] == [1, 8, 32]
    for row in rows:
        assert float(row[1]) > 0 and float(row[2]) > 0 and float(row[3].strip().rstrip("×")) > 0
    assert "errors: 0" in done.stdout
    assert re.search(r"text → image, unseen classes .*R@1 \d\.\d{3} \(chance \d\.\d{3}\)", done.stdout)


def test_bad_flags_are_one_clear_line():
    done = run("--seconds", "0")
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].endswith(
        "--seconds must be > 0, --repeats and --text-epochs at least 1"
    )
