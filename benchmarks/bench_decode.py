"""Decoding large images: a model input made from every pixel (`reducing_gap` None, the fair
resample) against the reduced-scale path new models use (a JPEG decoded at 1/2, 1/4 or 1/8
scale in the DCT, any image first shrunk by whole factors; `InputContract.reducing_gap`).

Each photo is synthetic (a smooth colour field under mid-frequency texture, seeded), encoded
once, then decoded into the contract's model input both ways, alternately, `--repeats` times;
the figures are medians and the ratio is fair / reduced in the same run. Fidelity: the largest
and mean pixel difference of the two model inputs, and, with a model, the cosine between the
two embeddings.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import statistics
import time
from pathlib import Path

import numpy as np
from PIL import Image

from core.data.preprocess import DEFAULT_REDUCING_GAP, InputContract, decode, open_image
from index.embedder import OnnxEmbedder
from training.models.models import input_contract

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_MODEL = ROOT / "runs" / "bench-mobilenet_v2-224" / "model"


def photo(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    field = rng.integers(0, 256, (height // 64 + 1, width // 64 + 1, 3), dtype=np.uint8)
    texture = rng.integers(0, 256, (height // 4, width // 4, 3), dtype=np.uint8)
    smooth = Image.fromarray(field).resize((width, height), Image.Resampling.BICUBIC)
    return Image.blend(smooth, Image.fromarray(texture).resize((width, height), Image.Resampling.BILINEAR), 0.25)


def encode(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def timed(data: bytes, contract: InputContract) -> tuple[float, np.ndarray, tuple[int, int]]:
    started = time.perf_counter()
    image = open_image(data, load=False)
    array = decode(image, contract)
    return time.perf_counter() - started, array, image.size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", default="mobilenet_v2", help="whose input contract (default mobilenet_v2)")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=DEFAULT_MODEL if DEFAULT_MODEL.is_dir() else None,
        help="a model artifact to compare embeddings with (its input contract is used; default: "
        "runs/bench-mobilenet_v2-224/model where bench_serving --backbone mobilenet_v2 made it)",
    )
    parser.add_argument("--no-embeddings", action="store_true", help="compare pixels only, load no model")
    parser.add_argument("--sizes", nargs="+", default=["640x480", "1920x1080", "4032x3024", "6000x4000"])
    parser.add_argument(
        "--formats", nargs="+", default=["JPEG", "PNG"], choices=["JPEG", "PNG", "WEBP", "AVIF", "HEIF"]
    )
    parser.add_argument("--gaps", nargs="+", type=float, default=[DEFAULT_REDUCING_GAP, 3.0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    try:
        sizes = [tuple(int(v) for v in s.lower().split("x")) for s in args.sizes]
        if any(len(s) != 2 or min(s) <= 0 for s in sizes):
            raise ValueError
    except ValueError:
        parser.error(f"--sizes takes WIDTHxHEIGHT values, got {' '.join(args.sizes)}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if any(g < 1 for g in args.gaps):
        parser.error("--gaps must be at least 1")
    if args.model_dir is not None and not args.model_dir.is_dir():
        parser.error(f"--model-dir {args.model_dir} is not a directory")

    embedder = OnnxEmbedder(args.model_dir, provider="cpu") if args.model_dir and not args.no_embeddings else None
    base = embedder.contract if embedder else input_contract(args.backbone)
    fair = dataclasses.replace(base, reducing_gap=None)
    print(
        f"contract: {base.channels}x{base.height}x{base.width}, shorter side resized to {base.resize}; "
        f"medians of {args.repeats}; ratio = fair / reduced" + (f"; embeddings by {args.model_dir}" if embedder else "")
    )
    if base.resize is None:
        print("this contract resizes nothing: reduced-scale decoding never applies")
        return
    header = "| image | format | MB | fair ms | gap | decoded at | reduced ms | ratio | max diff | mean diff |"
    print(header + (" cosine |" if embedder else ""))
    print("|---" * (header.count("|") - 1 + bool(embedder)) + "|")
    for seed, (width, height) in enumerate(sizes):
        picture = photo(width, height, seed)
        for fmt in args.formats:
            data = encode(picture, fmt)
            contracts = [fair] + [dataclasses.replace(base, reducing_gap=g) for g in args.gaps]
            times: list[list[float]] = [[] for _ in contracts]
            outputs: list[tuple[np.ndarray, tuple[int, int]]] = []
            for repeat in range(args.repeats):
                for i, contract in enumerate(contracts):  # alternated: drift hits every path alike
                    seconds, array, decoded = timed(data, contract)
                    times[i].append(seconds)
                    if repeat == 0:
                        outputs.append((array, decoded))
            fair_ms = statistics.median(times[0]) * 1e3
            vectors = embedder.embed(np.stack([a for a, _ in outputs])) if embedder else None
            for i, gap in enumerate(args.gaps, start=1):
                array, decoded = outputs[i]
                reduced_ms = statistics.median(times[i]) * 1e3
                difference = np.abs(array - outputs[0][0]) / base.scale
                row = (
                    f"| {width}x{height} | {fmt} | {len(data) / 1e6:.2f} | {fair_ms:.1f} | {gap:g} | "
                    f"{decoded[0]}x{decoded[1]} | {reduced_ms:.1f} | {fair_ms / reduced_ms:.2f}x | "
                    f"{difference.max():.0f}/255 | {difference.mean():.2f}/255 |"
                )
                if vectors is not None:
                    row += f" {float(vectors[0] @ vectors[i]):.5f} |"
                print(row, flush=True)


if __name__ == "__main__":
    main()
