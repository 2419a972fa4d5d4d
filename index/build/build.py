"""`index build`: embed a catalog in this process with the model artifact, then build, gate and
publish a new index version (`index.build.publish`)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from core.artifacts.model_manifests import ModelManifest
from core.data.catalog import read_catalog
from index.build.config import DEFAULT_MODEL, BuildConfig, default_catalog
from index.build.embed import check_bad_rows, embed_catalog
from index.build.publish import NewVersion
from index.embedder import OnnxEmbedder


def run_build(cfg: BuildConfig, progress: bool = True) -> Path:
    """Embed a catalog in this process, build a new index and publish it; returns its directory."""
    cfg = dataclasses.replace(cfg, model=cfg.model or DEFAULT_MODEL)
    cfg.check_inputs()
    started = time.perf_counter()
    catalog_path = cfg.catalog or default_catalog(ModelManifest.read(cfg.model))
    catalog = read_catalog(catalog_path)
    cfg = cfg.with_item_field(catalog)
    cfg.check_catalog(catalog)  # before the model's session is even loaded
    embedder = OnnxEmbedder(cfg.model, provider=cfg.provider)
    embeddings, kept, skipped = embed_catalog(
        catalog, embedder, cfg.batch_size, cfg.decode_threads, cfg.max_pixels, progress
    )
    check_bad_rows(len(catalog), len(kept), skipped, cfg.max_bad_fraction)
    seconds = time.perf_counter() - started
    new = NewVersion.of_catalog(embedder.model_id, catalog_path, catalog, embeddings, kept, skipped, started, seconds)
    return cfg.publish(new)
