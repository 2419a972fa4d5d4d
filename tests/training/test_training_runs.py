"""Real Ray Train runs: a killed worker, a killed driver resumed with --resume, and training on
miniature replicas of the benchmark datasets in their published layouts."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from tests.support.datasets import write_replica
from tests.support.training import finish, kill_run, output_of_run, start_training, wait_for_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def train_workers(driver: subprocess.Popen) -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process(driver.pid).children(recursive=True)
        if "RayTrainWorker" in " ".join(p.cmdline() or [p.name()])
    ]


@pytest.mark.slow
def test_killed_worker_resumes_from_its_last_checkpoint(tmp_path):
    out = tmp_path / "run"
    process = start_training(out, "--max-failures", "2")
    wait_for_checkpoint(out, process)
    workers = train_workers(process)
    assert workers, "no Ray Train worker process found"
    for worker in workers:
        worker.send_signal(signal.SIGKILL)
    finish(process)
    results = json.loads((out / "results.json").read_text())
    assert [row["epoch"] for row in results["history"]] == [-1, 0, 1, 2, 3]  # -1: before training
    assert results["resumed"], "the restarted worker began from scratch instead of the checkpoint"
    assert 1 <= results["resumed"][0]["at_epoch"] <= 3


@pytest.mark.slow
def test_stopped_run_continues_with_resume(tmp_path):
    out = tmp_path / "run"
    process = start_training(out)
    wait_for_checkpoint(out, process)
    kill_run(process)
    assert not (out / "results.json").exists()
    finish(start_training(out, "--resume"))
    results = json.loads((out / "results.json").read_text())
    assert [row["epoch"] for row in results["history"]] == [-1, 0, 1, 2, 3]  # -1: before training
    assert results["resumed"] and results["resumed"][0]["at_epoch"] >= 1
    assert not out.with_name(f".{out.name}.work").exists()  # a finished run leaves no work directory


@pytest.mark.slow
def test_training_on_benchmark_replicas(tmp_path):
    """In-shop (query/gallery evaluation) decoded lazily with a loader process, CUB in memory."""
    inshop = write_replica("inshop", tmp_path / "inshop", classes=40, images_per_class=4)
    out = tmp_path / "inshop-run"
    args = ["--dataset", "inshop", "--data-root", str(inshop), "--epochs", "2", "--classes-per-batch", "8"]
    finish(
        start_training(
            out,
            *args,
            "--samples-per-class",
            "2",
            "--data-mode",
            "lazy",
            "--loader-workers",
            "1",
            "--ks",
            "1,10,20",
            base=(),
        )
    )
    results = json.loads((out / "results.json").read_text())
    assert set(results["trained"]["recall_at_k"]) == {"1", "10", "20"}
    assert "nmi" not in results["trained"]  # query/gallery protocol: recall only
    assert {p.name for p in (out / "splits").iterdir()} == {"train.csv", "val.csv", "query.csv", "gallery.csv"}
    assert (out / "similarity_histograms.png").stat().st_size > 0
    assert results["history"][-1]["skipped_images"] == 0
    log = output_of_run(out)
    assert "start (recipe scratch, before training) val_R@1=" in log and "epoch 2/2 loss=" in log
    # Ray Train's per-report narration and faiss's loader lines stay out of the log (no --verbose).
    assert "Reporting training result" not in log and "Checkpoint successfully created" not in log
    assert "Loading faiss" not in log

    cub = write_replica("cub", tmp_path / "cub", images_per_class=3)
    out = tmp_path / "cub-run"
    cub_args = ["--dataset", "cub", "--data-root", str(cub), "--epochs", "1", "--samples-per-class", "3"]
    finish(start_training(out, *cub_args, "--augment", "crop+flip", base=()))
    results = json.loads((out / "results.json").read_text())
    assert results["test_classes"] == 100 and 0 <= results["trained"]["nmi"] <= 1
    assert (out / "recall_per_epoch.png").stat().st_size > 0


@pytest.mark.slow
def test_a_catalog_of_items_is_scored_by_item_too(tmp_path):
    """A catalog whose rows name their item (the `item` column) gets item Recall@K beside the
    image-level figures, on the unseen classes."""
    import numpy as np
    from PIL import Image

    rows = ["id,path,label,item"]
    rng = np.random.default_rng(0)
    for cls in range(16):
        base = rng.integers(0, 256, (28, 28), dtype=np.uint8)
        for shot in range(4):
            noisy = np.clip(base.astype(int) + rng.integers(-20, 21, base.shape), 0, 255).astype(np.uint8)
            Image.fromarray(noisy).save(tmp_path / f"c{cls}-{shot}.png")
            rows.append(f"c{cls}-{shot},c{cls}-{shot}.png,c{cls},p{cls}")
    (tmp_path / "catalog.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "run"
    args = ["--catalog", str(tmp_path / "catalog.csv"), "--epochs", "1", "--classes-per-batch", "4"]
    finish(start_training(out, *args, "--samples-per-class", "2", "--val-fraction", "0", base=()))
    results = json.loads((out / "results.json").read_text())
    assert set(results["trained"]["item_recall_at_k"]) == set(results["trained"]["recall_at_k"])
    assert all(0 <= v <= 1 for v in results["trained"]["item_recall_at_k"].values())
