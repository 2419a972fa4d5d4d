"""Embedding throughput: Ray Data rebuild with 1 and 2 CPU workers vs a plain single-process loop
over the same images, and ONNX Runtime vs PyTorch eager on the same model and batch sizes.

Needs the demo's artifacts (runs/demo: train/, model/), built by scripts/demo.py if missing.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from core.data.catalog import Catalog, read_catalog
from core.data.preprocess import load_batch
from index.build.embed import embed_catalog
from index.build.rebuild import embed_with_ray_data
from index.embedder import OnnxEmbedder

ROOT = Path(__file__).resolve().parents[1]


def grown_catalog(base: Catalog, rows: int, path: Path) -> Path:
    copies = -(-rows // len(base))
    grown = Catalog(
        ids=[f"{i}#{c}" for c in range(copies) for i in base.ids][:rows],
        paths=[p for _ in range(copies) for p in base.paths][:rows],
        labels=[label for _ in range(copies) for label in base.labels][:rows],
        source="bench",
    )
    return grown.write(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run", default="runs/demo")
    parser.add_argument("--rows", type=int, help="images to embed (default 20000, quick 2000)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    run = ROOT / args.run
    if not (run / "model" / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "scripts.demo", "--out", str(run)], check=True, cwd=ROOT)
    rows = args.rows or (2000 if args.quick else 20000)
    tmp = Path(tempfile.mkdtemp(prefix="bench-rebuild-"))
    try:
        catalog_path = grown_catalog(read_catalog(run / "train" / "splits" / "test.csv"), rows, tmp / "catalog.csv")
        catalog = read_catalog(catalog_path)
        embedder = OnnxEmbedder(run / "model", provider="cpu", intra_op_threads=1)
        started = time.perf_counter()
        embed_catalog(catalog, embedder, batch_size=256, threads=1, progress=False)
        plain = rows / (time.perf_counter() - started)

        import ray

        ray.init(include_dashboard=False, log_to_driver=False)
        ray_rates = {}
        for workers in (1, 2):
            work = tmp / f"ray{workers}"
            work.mkdir()
            started = time.perf_counter()
            embed_with_ray_data(catalog_path, run / "model", work, workers, 256, "cpu", 40_000_000, False)
            ray_rates[workers] = rows / (time.perf_counter() - started)
        ray.shutdown()

        print(f"\nEmbedding {rows} catalog images (decode + ONNX Runtime), {run / 'model'}:")
        print(f"  plain single-process loop : {plain:8.0f} images/s  (1.00×)")
        for workers, rate in ray_rates.items():
            print(f"  Ray Data, {workers} CPU worker(s) : {rate:8.0f} images/s  ({rate / plain:.2f}×)")

        import torch

        from training.export.export import load_trained_model

        model, _, contract = load_trained_model(run / "train")
        torch.set_num_threads(2)
        session = OnnxEmbedder(run / "model", provider="cpu")
        images = load_batch(list(catalog.paths[:256]), contract)
        print("\nONNX Runtime vs PyTorch eager (same model, CPU):")
        print(f"  {'batch':>5} {'torch img/s':>12} {'ORT img/s':>10} {'ratio':>6}")
        for batch in (1, 32, 256):
            x = images[:batch]
            tensor = torch.from_numpy(x)
            timings = {"torch": [], "ort": []}
            with torch.no_grad():
                for _ in range(3):
                    model(tensor)
                    session.embed(x)
                for _ in range(5 if args.quick else 20):
                    t = time.perf_counter()
                    model(tensor)
                    timings["torch"].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    session.embed(x)
                    timings["ort"].append(time.perf_counter() - t)
            torch_rate = batch / statistics.median(timings["torch"])
            ort_rate = batch / statistics.median(timings["ort"])
            print(f"  {batch:>5} {torch_rate:12.0f} {ort_rate:10.0f} {ort_rate / torch_rate:5.2f}×")
        _ = np  # numpy is used through the project's modules
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
