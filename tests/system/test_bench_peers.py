"""bench_peers: bad flags are one line and exit 2 before any work; its simsearch side runs end to
end at a tiny size (the peers' packages are an optional extra CI does not install, so their side
is exercised by the benchmark's own runs, docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.bench_peers import table

ROOT = Path(__file__).resolve().parents[2]


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "benchmarks.bench_peers", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_bad_flags_are_one_clear_line():
    cases = [
        (["--systems", "simsearch,milvus"], "--systems: unknown milvus"),
        (["--systems", ","], "--systems: unknown empty list"),
        (["--rows", "0"], "--rows must be at least 1, got 0"),
        (["--rows", "5", "--k", "10"], "--k 10 exceeds --rows 5"),
        (["--concurrency", "1,x"], "--concurrency must be integers"),
        (["--seconds", "0"], "--seconds must be positive"),
    ]
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda case: bench(*case[0], timeout=120), cases))
    for (args, message), done in zip(cases, results, strict=True):
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and message in lines[0], (args, done.stderr)
        assert lines[0].startswith("bench_peers: ")


def test_a_peer_without_its_packages_is_one_line(tmp_path):
    # An interpreter that cannot import the peers, named on purpose: refused before any server starts.
    bare = tmp_path / "python"
    bare.write_text("#!/bin/sh\nexit 1\n")
    bare.chmod(0o755)
    done = bench("--systems", "pgvector", "--rows", "50", "--queries", "2", "--peers-python", str(bare))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "cannot import the peers' packages" in lines[0], done.stderr


def test_simsearch_side_runs_at_a_tiny_size(tmp_path):
    out = tmp_path / "peers.json"
    done = bench(
        "--systems", "simsearch", "--rows", "300", "--queries", "12", "--dim", "16", "--seconds", "0.3",
        "--concurrency", "1,2", "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    targets = {t["kind"]: t for t in report["targets"]}
    assert set(targets) == {"hnsw", "exact"}
    assert targets["exact"]["recall"] == 1.0 and targets["hnsw"]["recall"] > 0.9
    for t in targets.values():
        assert t["build_s"] > 0
        for level in ("1", "2"):
            assert t["levels"][level]["qps"] > 0 and t["levels"][level]["p50_ms"] > 0
    assert "| simsearch `serve` (gRPC, by embedding) | Flat" in done.stdout


def test_table_divides_by_pgvector_of_the_same_kind():
    def target(peer: str, kind: str, qps: float) -> dict:
        levels = {1: {"qps": qps, "p50_ms": 1.0}, 8: {"qps": 2 * qps, "p50_ms": 2.0}}
        return {"system": peer, "peer": peer, "index": kind, "kind": kind, "recall": 1.0, "levels": levels}

    rows = table(
        [target("simsearch", "hnsw", 500), target("pgvector", "hnsw", 1000), target("simsearch", "exact", 300),
         target("pgvector", "exact", 30)],
        [1, 8], 10,
    ).splitlines()  # fmt: skip
    assert "| 500 (0.50×) | 1,000 (0.50×) |" in rows[2]
    assert "| 1,000 | 2,000 |" in rows[3]  # pgvector itself: no ratio
    assert "| 300 (10.00×) | 600 (10.00×) |" in rows[4]
