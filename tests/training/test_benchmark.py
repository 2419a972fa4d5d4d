"""`python -m training benchmark`: one protocol for every loss, Ray jobs, resumable output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from training.losses import available_losses
from training.runs.benchmark import BenchmarkConfig, markdown_table, resolve_losses

ROOT = Path(__file__).resolve().parents[2]
SLICE = ["--epochs", "1", "--max-classes", "30", "--max-per-class", "10", "--classes-per-batch", "8"]


def test_all_means_the_papers_losses():
    names = resolve_losses(["all"])
    assert {"raw_vthm", "proxy_anchor"} <= set(names)
    assert not [n for n in names if n.startswith("pml_")]
    assert set(names) | {n for n in available_losses() if n.startswith("pml_")} == set(available_losses())


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        ({"losses": ["no_such_loss"]}, "unknown loss 'no_such_loss'"),
        ({"losses": ["raw_vthm"], "per_loss_options": {"proxy_anchor": {}}}, "not in the benchmark: proxy_anchor"),
        ({"losses": ["raw_vthm"], "seed": 3}, "the benchmark sets seed per run"),
        ({"losses": ["raw_vthm"], "seeds": 0}, "seeds must be positive"),
        ({"losses": ["raw_vthm"], "epochs": 0}, "epochs must be positive"),
        ({"losses": ["raw_vthm"], "per_loss_options": {"raw_vthm": {"alpha": -1}}}, "alpha must be"),
        ({"losses": ["raw_vthm", "raw_vthm"]}, "listed twice"),
    ],
)
def test_bad_benchmark_configs_fail_before_training(values, fragment):
    with pytest.raises((ValueError, TypeError), match=fragment.replace("(", r"\(").replace(")", r"\)")):
        BenchmarkConfig.from_values(values)


def test_protocol_is_shared_and_losses_keep_their_options():
    cfg = BenchmarkConfig.from_values(
        {"losses": ["raw_vthm", "proxy_anchor"], "epochs": 2, "per_loss_options": {"raw_vthm": {"alpha": 3.0}}}
    )
    a, b = cfg.train_config("raw_vthm", 1), cfg.train_config("proxy_anchor", 1)
    assert a.epochs == b.epochs == 2 and a.seed == b.seed == 1 and a.split_seed == b.split_seed
    assert a.loss_options == {"alpha": 3.0} and b.loss_options == {}
    assert Path(a.out).name == "raw_vthm-seed1" and a.out != b.out


def run_cli(out: Path, *losses: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "training", "benchmark", "--out", str(out), "--losses", ",".join(losses)]
        + ["--seeds", "1", *SLICE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_benchmark_trains_tabulates_and_resumes(tmp_path):
    out = tmp_path / "bench"
    run_cli(out, "raw_vthm", "proxy_anchor")
    table = json.loads((out / "results.json").read_text())
    assert set(table["rows"]) == {"untrained", "raw_vthm", "proxy_anchor"}
    for name in ("raw_vthm", "proxy_anchor"):
        run = table["runs"][f"{name}-seed0"]
        assert table["rows"][name]["R@1"]["mean"] == run["trained"]["recall_at_k"]["1"]
    assert (out / "table.md").read_text() == markdown_table({k: table[k] for k in ("seeds", "ks", "rows")})
    assert (out / "recall.png").stat().st_size > 0
    kept = out / "runs" / "proxy_anchor-seed0" / "results.json"
    before = kept.stat().st_mtime_ns
    redo = out / "runs" / "raw_vthm-seed0"
    for path in sorted(redo.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    redo.rmdir()  # as if interrupted before this run published
    proc = run_cli(out, "raw_vthm", "proxy_anchor")
    assert kept.stat().st_mtime_ns == before  # finished runs are not trained again
    assert (redo / "results.json").is_file()
    assert "1 runs finished earlier, 1 to train" in proc.stderr


def test_table_from_runs_with_a_failed_seed():
    from training.runs.benchmark import summarize

    cfg = BenchmarkConfig.from_values({"losses": ["raw_vthm", "proxy_anchor"], "seeds": 2})

    def result(r1: float) -> dict:
        figures = {"recall_at_k": {k: r1 for k in ("1", "2", "4", "8")}, "map_at_r": r1 / 2}
        return {"trained": figures, "untrained": figures, "train_seconds": 10.0, "best_epoch": 1}

    done = {("raw_vthm", 0): result(0.9), ("raw_vthm", 1): result(0.8), ("proxy_anchor", 0): result(0.95)}
    table = summarize(cfg, done)
    table["failed"] = {"proxy_anchor-seed1": "loss became NaN"}
    assert table["rows"]["raw_vthm"]["R@1"] == pytest.approx({"mean": 0.85, "std": 0.0707107}, rel=1e-5)
    assert table["rows"]["proxy_anchor"]["seeds_finished"] == 1
    text = markdown_table(table)
    assert text.index("| proxy_anchor (some seeds failed)") < text.index("| raw_vthm |")  # best R@1 first
    assert "Failed: proxy_anchor-seed1: loss became NaN" in text
