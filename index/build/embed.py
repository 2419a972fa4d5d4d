"""Embedding a catalog in this process: decode threads, the ONNX model, rows skipped and why."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from core.data.catalog import Catalog, CatalogError
from core.data.preprocess import DEFAULT_MAX_PIXELS, ImageDecodeError, RegionError, load_image
from core.progress import FIRST_ESTIMATE_S, Progress
from index.embedder import OnnxEmbedder

log = logging.getLogger(__name__)


def embed_catalog(
    catalog: Catalog,
    embedder: OnnxEmbedder,
    batch_size: int = 256,
    threads: int = 4,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    progress: bool = True,
    desc: str = "embed",
) -> tuple[np.ndarray, list[int], dict[str, int]]:
    """Embeddings of every decodable row, the rows kept, and counts of skipped rows by reason
    (`desc`: what the progress lines call the work)."""
    skipped: dict[str, int] = {}
    bad_regions: list[tuple[int, str]] = []
    counting = threading.Lock()  # decode threads skip rows at once: a get-then-set could lose one
    regions = catalog.regions

    def decode(row: int) -> np.ndarray | None:
        path = catalog.paths[row]
        try:
            return load_image(path, embedder.contract, max_pixels, regions[row])
        except RegionError as exc:  # the catalog's own mistake, not an unreadable file: refused below
            with counting:
                bad_regions.append((row + 1, str(exc)))
            return None
        except ImageDecodeError as exc:
            with counting:
                skipped[exc.reason] = skipped.get(exc.reason, 0) + 1
            log.warning("skipping %s: %s", path, exc)
            return None

    parts, kept = [], []
    with (
        ThreadPoolExecutor(max_workers=threads) as pool,
        Progress(len(catalog), desc, "img", "auto" if progress else "off", first_s=FIRST_ESTIMATE_S) as bar,
    ):
        for start in range(0, len(catalog), batch_size):
            rows = range(start, min(start + batch_size, len(catalog)))
            arrays = list(pool.map(decode, rows))
            good = [(r, a) for r, a in zip(rows, arrays, strict=True) if a is not None]
            if good:
                parts.append(embedder.embed(np.stack([a for _, a in good])))
                kept.extend(r for r, _ in good)
            bar.update(len(rows))
    if bad_regions:
        bad_regions.sort()
        shown = "; ".join(f"row {n}: {why}" for n, why in bad_regions[:5]) + (" ..." if len(bad_regions) > 5 else "")
        raise CatalogError(f"{catalog.source}: {len(bad_regions)} row(s) whose bbox does not fit the image ({shown})")
    embeddings = np.concatenate(parts) if parts else np.zeros((0, embedder.dim), np.float32)
    return embeddings, kept, skipped


def check_bad_rows(total: int, kept: int, skipped: dict[str, int], max_bad_fraction: float) -> None:
    bad = total - kept
    if total and bad / total > max_bad_fraction:
        raise ValueError(
            f"{bad} of {total} catalog rows could not be embedded ({skipped}), over the "
            f"allowed fraction {max_bad_fraction}"
        )
