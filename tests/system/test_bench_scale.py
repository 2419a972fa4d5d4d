"""The long benchmarks refuse bad flags in one line, before any work; bench_scale's report."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", f"benchmarks.{Path(script).stem}", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_bad_flags_are_one_clear_line(tmp_path):
    cases = [
        ("bench_scale.py", ["--stages", "train,index", "--out", str(tmp_path / "s")], "unknown stage(s) index"),
        ("bench_finetune.py", ["--variants", "defaults,fast", "--out", str(tmp_path / "f")], "unknown variant(s) fast"),
        ("bench_segments.py", ["--factories", "flat,lsh", "--size", "1000"], "unknown factory(ies) lsh"),
        ("bench_ingest.py", ["--seconds", "1"], "--seconds at least 5"),
    ]
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda case: run(case[0], *case[1]), cases))
    for (script, args, message), done in zip(cases, results, strict=True):
        assert done.returncode == 2 and message in done.stderr, (script, args, done.stderr)
    assert not (tmp_path / "f").exists()  # nothing rendered or trained


def test_report_tabulates_each_run_and_fits_two_sizes(tmp_path):
    def stage(seconds: float, gb: float) -> dict:
        return {
            "seconds": seconds,
            "peak_total_pss_gb": gb,
            "processes": {"-m index build": {"peak_rss_gb": gb, "processes": 1}},
        }

    for name, images, build in (("small", 10_000, stage(100, 1.0)), ("large", 100_000, stage(1000, 2.0))):
        (tmp_path / name).mkdir()
        run_json = {
            "images": images,
            "classes": images // 10,
            "size": 224,
            "machine": "test",
            "stages": {"build": build},
        }
        (tmp_path / name / "results.json").write_text(json.dumps(run_json))
    done = run("bench_scale.py", "--report", f"{tmp_path / 'small'},{tmp_path / 'large'}")
    assert done.returncode == 0, done.stderr
    assert "| build | 16.7 min | 100,000 | 100 |" in done.stdout
    # 1 GB more for 90,000 more images: 11.1 MB per 1k; 10 ms an image → 1M in 2.8 h at 12 GB.
    assert "| build | 10.0 ms | 11.11 MB | 2.8 h, 12.0 GB | 27.8 h, 112.0 GB |" in done.stdout
