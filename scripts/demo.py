"""The whole chain on the embedded glyph set: train → export → index → serve → query → report,
and search by words: a text tower trained against the locked image model (LiT, `train-text`) on
the training classes' names, exported and indexed beside the image model, measured text → image
on held-out fonts of those classes and, apart, on the unseen classes — those also by words over
gRPC, each class's name one query.

Each stage runs as its own command (`python -m training …`, `python -m index …`,
`python -m serving …`), exactly as an operator would run them; the queries go through the
project's gRPC client, once per test image, and Recall@K is computed from what the server
answered.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from core.artifacts import layout as artifacts
from core.data.catalog import read_catalog
from core.retrieval.metrics import recall_from_neighbor_labels
from serving.client import SearchClient

KS = (1, 2, 4, 8)
TEXT_KS = (1, 5)
# A small tower — 58 class names of a few tokens each — so words add about a minute to the demo.
TEXT_TOWER = ("--tower-width", "128", "--tower-layers", "2", "--context-length", "16")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stage(title: str, *args: str) -> float:
    """Run one stage's command; its log and progress (stderr) show, its JSON summary (stdout)
    goes only to the screen's last line, so the whole demo fits on one screen."""
    print(f"\n=== {title}: python {' '.join(args)}", flush=True)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, *args], check=True, stdout=subprocess.PIPE, text=True)
    lines = done.stdout.strip().splitlines()
    if lines and not lines[0].startswith("{"):
        print(lines[-1])  # a stage that prints its artifact's path
    return time.perf_counter() - started


def query_server(target: str, catalog_path: Path, ks=KS, threads: int = 8) -> dict[int, float]:
    """Every test image queries the server once (itself excluded); Recall@K from the answers."""
    catalog = read_catalog(catalog_path)
    k = max(ks)
    with SearchClient(target, timeout=30.0) as client:
        client.wait_ready(60)
        for _ in range(300):
            if client.healthy():
                break
            time.sleep(0.2)
        else:
            raise RuntimeError("server never became healthy")

        def ask(row: int) -> list[str]:
            response = client.search_image(
                catalog.paths[row], k=k, exclude_ids=[catalog.ids[row]], label=catalog.labels[row]
            )
            return [n.label for n in response.neighbors]

        with ThreadPoolExecutor(threads) as pool:
            answers = list(pool.map(ask, range(len(catalog))))
    width = max(len(a) for a in answers)
    labels = np.array([a + [None] * (width - len(a)) for a in answers], dtype=object)
    return recall_from_neighbor_labels(labels, np.array(catalog.labels, dtype=object), ks)


def query_server_text(target: str, captions_path: Path, ks=TEXT_KS) -> dict[int, float]:
    """Each class's caption queries the server once, by words (its text model); Recall@K from
    the answers: a hit is an image of the caption's class among the K nearest."""
    catalog = read_catalog(captions_path)
    captions = {label: meta["caption"] for label, meta in zip(catalog.labels, catalog.metadata, strict=True)}
    with SearchClient(target, timeout=30.0) as client:
        answers = [[n.label for n in client.search_text(text, k=max(ks)).neighbors] for text in captions.values()]
    width = max(ks)
    labels = np.array([a + [None] * (width - len(a)) for a in answers], dtype=object)
    return recall_from_neighbor_labels(labels, np.array(list(captions), dtype=object), ks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="runs/demo", help="where model/, index/ and report.json go")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--max-classes", type=int, help="use a slice of the glyph classes (quick runs)")
    parser.add_argument("--max-per-class", type=int, help="use at most N faces per class")
    parser.add_argument("--classes-per-batch", type=int, default=20)
    parser.add_argument("--loss", default="raw_vthm")
    parser.add_argument("--text-epochs", type=int, default=2, help="epochs of the text tower (train-text)")
    args = parser.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    slice_args = []
    if args.max_classes:
        slice_args += ["--max-classes", str(args.max_classes)]
    if args.max_per_class:
        slice_args += ["--max-per-class", str(args.max_per_class)]
    times = {}
    times["train"] = stage(
        "train (Ray Train)",
        "-m",
        "training",
        "train",
        "--out",
        str(out / "train"),
        "--loss",
        args.loss,
        "--epochs",
        str(args.epochs),
        "--classes-per-batch",
        str(args.classes_per_batch),
        *slice_args,
    )
    times["export"] = stage(
        "export (ONNX)", "-m", "training", "export", "--run", str(out / "train"), "--out", str(out / "model")
    )
    times["train-text"] = stage(
        "train-text (LiT: a text tower against the locked image model, Ray Train)",
        "-m",
        "training",
        "train-text",
        "--model",
        str(out / "model"),
        "--out",
        str(out / "text"),
        "--epochs",
        str(args.text_epochs),
        *TEXT_TOWER,
    )
    times["export-text"] = stage(
        "export text (ONNX)",
        "-m",
        "training",
        "export",
        "--text",
        "--run",
        str(out / "text"),
        "--out",
        str(out / "text-model"),
    )
    times["index"] = stage(
        "index (faiss)",
        "-m",
        "index",
        "build",
        "--model",
        str(out / "model"),
        "--text-model",
        str(out / "text-model"),
        "--index-root",
        str(out / "index"),
        "--no-progress",
    )

    port, metrics_port = free_port(), free_port()
    print(
        f"\n=== serve: python -m serving serve --index-root {out / 'index'} "
        f"--port {port} --metrics-port {metrics_port}",
        flush=True,
    )
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "serving",
            "serve",
            "--index-root",
            str(out / "index"),
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--processes",
            "1",  # the demo's few queries need one process, loaded once
        ],
    )
    try:
        t = time.perf_counter()
        served = query_server(f"127.0.0.1:{port}", out / "train" / "splits" / "test.csv")
        served_text = query_server_text(f"127.0.0.1:{port}", out / "text" / "captions" / "unseen.csv")
        times["query"] = time.perf_counter() - t
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)

    results = json.loads((out / "train" / "results.json").read_text())
    report = {
        "untrained_recall_at_k": {str(k): results["untrained"]["recall_at_k"][str(k)] for k in KS},
        "trained_recall_at_k": {str(k): results["trained"]["recall_at_k"][str(k)] for k in KS},
        "served_recall_at_k": {str(k): served[k] for k in KS},
        "test_images": results["test_images"],
        "test_classes": results["test_classes"],
        "seconds": {**times, "total": time.perf_counter() - started},
        "machine": {"cpus": os.cpu_count()},
        "neighbours": str(artifacts.version_dir(out / "index") / artifacts.NEIGHBOURS_FILE),
        "text_to_image": {
            **text_figures(out / "text"),
            "served_unseen": {"recall_at_k": {str(k): served_text[k] for k in TEXT_KS}},
        },
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nRecall@K on {report['test_classes']} unseen classes ({report['test_images']} images):")
    print(f"{'':<28}" + "".join(f"{'R@' + str(k):>8}" for k in KS))
    for name, key in (
        ("untrained network", "untrained_recall_at_k"),
        ("trained (in-process)", "trained_recall_at_k"),
        ("served (gRPC, ONNX+faiss)", "served_recall_at_k"),
    ):
        print(f"{name:<28}" + "".join(f"{100 * report[key][str(k)]:8.2f}" for k in KS))
    print_text_figures(report["text_to_image"])
    print(f"\nwall time {report['seconds']['total']:.0f} s; report: {out / 'report.json'}")
    print(f"sample queries and their neighbours: {report['neighbours']}")
    return 0


def text_figures(run: Path) -> dict[str, dict]:
    """train-text's text → image Recall@K (the tower in PyTorch): seen classes' held-out fonts,
    and the unseen classes, each with what a random ranking scores."""
    evaluation = json.loads((run / "results.json").read_text())["evaluation"]
    return {
        name: {
            "recall_at_k": {str(k): figures["recall_at_k"][str(k)] for k in TEXT_KS},
            "chance_recall_at_k": {str(k): figures["chance_recall_at_k"][str(k)] for k in TEXT_KS},
            "captions": figures["captions"],
            "images": figures["images"],
        }
        for name, figures in evaluation.items()
    }


def print_text_figures(figures: dict[str, dict]) -> None:
    # A class's Unicode name ("LATIN SMALL LETTER A") queries its glyphs.
    title = "Text → image: a class's Unicode name as query"
    print(f"{title:<56}" + "".join(f"{'R@' + str(k):>8}" for k in TEXT_KS) + f"{'chance R@1':>12}")
    titles = {"seen": "seen classes, held-out fonts", "unseen": "unseen classes, names never read"}
    for name, row in figures.items():
        recall = "".join(f"{100 * row['recall_at_k'][str(k)]:8.2f}" for k in TEXT_KS)
        if name in titles:
            title = f"{titles[name]} ({row['captions']} names, {row['images']} img)"
            print(f"{title:<56}{recall}{100 * row['chance_recall_at_k']['1']:12.2f}")
        else:
            print(f"{'  served (gRPC, text.onnx + faiss)':<56}{recall}")


if __name__ == "__main__":
    sys.exit(main())
