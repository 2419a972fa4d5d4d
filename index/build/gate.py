"""The quality gate: what a new index version measures (ANN recall against exact search, probe
and item Recall@K) and the floors it must meet to be published, all passed in as arguments."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.catalog import read_probe_catalog
from core.index_manifest import IndexManifest, QualityReport
from core.metrics import recall_at_k, recall_from_neighbor_labels, stable_sample, wilson_interval
from index.build.embed import embed_catalog
from index.embedder import OnnxEmbedder
from index.search.ann_recall import ann_recall
from index.search.faiss_search import search, search_leaving_out_self
from index.search.grouping import Groups, item_recall_at_k


class QualityGateError(ValueError):
    """The new index is worse than allowed; it was not published."""


NO_PROBE = "none: the catalog has no labels and no --probe-catalog was given"


@dataclass(frozen=True)
class GateThresholds:
    """What the gate measures and the floors it holds a new version to."""

    ks: tuple[int, ...]  # K values of probe and item Recall@K
    quality_sample: int  # catalog rows sampled as queries
    ann_k: int  # k of the ANN recall measurement
    min_ann_recall: float
    min_probe_recall_at_1: float
    max_recall_drop: float | None  # most probe Recall@1 may fall below the live version's (None: any)
    force: bool = False  # publish even when the gate refuses


@dataclass(frozen=True)
class ProbeCatalog:
    """Held-out labelled images, and how to embed them (the index's model)."""

    path: str
    model: str
    provider: str
    batch_size: int
    decode_threads: int
    max_pixels: int


def probe_catalog_recall(
    index, labels: list[str] | None, probe_catalog: ProbeCatalog, ks: tuple[int, ...]
) -> tuple[dict[str, float], str, int]:
    """Recall@K of held-out labelled images querying the built index (nothing to exclude),
    where it comes from and how many images queried. An index without labels cannot say which
    answers are right: the probe images then query each other (leave-one-out), which measures
    the model alone."""
    embedder = OnnxEmbedder(probe_catalog.model, provider=probe_catalog.provider)
    probe = read_probe_catalog(probe_catalog.path)
    vectors, kept, _ = embed_catalog(
        probe, embedder, probe_catalog.batch_size, probe_catalog.decode_threads, probe_catalog.max_pixels, False
    )
    if not kept:
        raise ValueError(f"no image of the probe catalog {probe_catalog.path} could be read")
    source = str(Path(probe_catalog.path).resolve())
    if labels is None:
        within = [kk for kk in ks if kk < len(kept)]
        recall = recall_at_k(vectors, [probe.labels[r] for r in kept], within) if within else {}
        source += " (leave-one-out among its images: the catalog has no labels)"
        return {str(kk): v for kk, v in recall.items()}, source, len(kept)
    k = min(max(ks), index.ntotal)
    _, rows = search(index, vectors, k)
    label_array = np.asarray(labels, dtype=object)
    neighbor_labels = np.where(rows >= 0, label_array[np.maximum(rows, 0)], None)
    query_labels = np.asarray([probe.labels[r] for r in kept], dtype=object)
    within = [kk for kk in ks if kk <= k]
    recall = recall_from_neighbor_labels(neighbor_labels, query_labels, within)
    return {str(kk): v for kk, v in recall.items()}, source, len(kept)


def quality_figures(
    index,
    embeddings: np.ndarray,
    ids: Sequence[str],
    labels: list[str] | None,
    thresholds: GateThresholds,
    items: Groups | None = None,
    probe_catalog: ProbeCatalog | None = None,
) -> QualityReport:
    """ANN recall vs exact search, and probe Recall@K with its 95% interval, on a fixed sample
    of the catalog, chosen by the rows' `ids` (the same items whatever the row order, so two
    builds of one catalog compare). Without labels (`labels` None) the probe comes from
    `probe_catalog` or is absent. With `items` (the rows grouped by the item field), item
    Recall@K of the same sample too."""
    n = len(embeddings)
    sample = stable_sample(ids, thresholds.quality_sample, seed=0)
    ann_k = min(thresholds.ann_k, n)
    report = QualityReport(
        sample_size=int(len(sample)),
        ann_k=ann_k,
        ann_recall_at_k=ann_recall(index, embeddings, embeddings[sample], ann_k),
        labelled=labels is not None,
    )
    if items is not None:
        item_recall = item_recall_at_k(index, embeddings, items, sample, thresholds.ks)
        report.item_recall_at_k = None if item_recall is None else {str(k): v for k, v in item_recall.items()}
    if probe_catalog is not None:
        report.probe_recall_at_k, report.probe_source, report.probe_queries = probe_catalog_recall(
            index, labels, probe_catalog, thresholds.ks
        )
    if labels is None:
        report.probe_source = report.probe_source or NO_PROBE
        return _with_probe_interval(report)
    label_array = np.asarray(labels)
    depth = min(max(thresholds.ks), n - 1)
    ks = [kk for kk in thresholds.ks if kk <= depth]
    if probe_catalog is None and ks:
        # Probe: sampled items query the built index itself, excluding their own row.
        _, rows = search_leaving_out_self(index, embeddings, sample, depth)
        neighbor_labels = np.where(rows >= 0, label_array.astype(object)[np.maximum(rows, 0)], None)
        report.probe_source = "leave-one-out sample of the catalog"
        report.probe_recall_at_k = {
            str(kk): v for kk, v in recall_from_neighbor_labels(neighbor_labels, label_array[sample], ks).items()
        }
        report.probe_queries = len(sample)
    if n <= 20000:
        report.exact_recall_at_k = {str(kk): v for kk, v in recall_at_k(embeddings, labels, ks).items()} if ks else {}
    return _with_probe_interval(report)


def _with_probe_interval(report: QualityReport) -> QualityReport:
    """`report` with the 95% Wilson interval of each probe Recall@K over its `probe_queries`:
    a sample of 1,000 leaves R@1 near 0.33 uncertain by ±0.03, what two builds of one catalog
    differed by while the sample followed row order."""
    if report.probe_recall_at_k and report.probe_queries:
        report.probe_interval_at_k = {
            k: list(wilson_interval(v, report.probe_queries)) for k, v in report.probe_recall_at_k.items()
        }
    return report


def describe_quality(figures: QualityReport) -> str:
    """The quality figures in one line, as the build logs them."""
    line = (
        f"ANN recall@{figures.ann_k} {figures.ann_recall_at_k:.4f} against exact search ({figures.sample_size} queries)"
    )
    if figures.probe_recall_at_k:
        intervals = figures.probe_interval_at_k or {}
        recall = ", ".join(
            f"R@{k} {v:.4f}" + (" [{:.4f}, {:.4f}]".format(*intervals[k]) if k in intervals else "")
            for k, v in figures.probe_recall_at_k.items()
        )
        over = f"{figures.probe_queries} queries, 95% intervals; " if intervals else ""
        line += f"; probe {recall} ({over}{figures.probe_source})"
    else:
        line += f"; probe Recall@K {figures.probe_source or NO_PROBE}"
    if figures.item_recall_at_k:
        line += "; item " + ", ".join(f"R@{k} {v:.4f}" for k, v in figures.item_recall_at_k.items())
    return line


def check_quality(figures: QualityReport, thresholds: GateThresholds, live: IndexManifest | None) -> list[str]:
    """Reasons to refuse publishing (empty when the gate passes)."""
    reasons = []
    if figures.ann_recall_at_k < thresholds.min_ann_recall:
        reasons.append(
            f"ANN recall@{figures.ann_k} {figures.ann_recall_at_k:.4f} < floor {thresholds.min_ann_recall} "
            "(search harder: --nprobe, or efSearch in --search-params; or a finer index)"
        )
    probe = figures.probe_recall_at_1
    floor = thresholds.min_probe_recall_at_1
    if probe is None and floor > 0:
        reasons.append(f"a probe Recall@1 floor is set ({floor}) but there is no probe: {NO_PROBE}")
    if probe is not None and probe < floor:
        reasons.append(f"probe Recall@1 {probe:.4f} < floor {floor}")
    drop = thresholds.max_recall_drop
    if drop is not None and live is not None and probe is not None:
        live_probe = live.quality.probe_recall_at_1 if live.quality is not None else None
        if live_probe is not None and probe < live_probe - drop:
            reasons.append(f"probe Recall@1 {probe:.4f} is more than {drop} below the live version's {live_probe:.4f}")
    return reasons
