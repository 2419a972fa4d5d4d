"""The quality gate: what a new index version measures (ANN recall against exact search, probe
and item Recall@K) and the floors it must meet to be published, all passed in as arguments; and
an add's gate on what it changed (`gate_change`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from core.artifacts.index_manifest import IndexManifest, QualityGate, QualityReport, SegmentEntry
from core.data.catalog import read_probe_catalog
from core.data.items import string_hashes
from core.retrieval.metrics import recall_at_k, recall_from_neighbor_labels, stable_sample, wilson_interval
from core.retrieval.vectors import exact_search
from index.build.embed import embed_catalog
from index.embedder import OnnxEmbedder
from index.search.ann_recall import ann_recall, recall_against
from index.search.faiss_index import empty_index
from index.search.faiss_search import search, search_leaving_out_self
from index.search.grouping import Groups, item_recall_at_k
from index.versions.segments import flat_until_compaction
from index.versions.version import IndexVersion


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


# -- what an add changed, gated -----------------------------------------------------------------

GATE_QUERIES = 200  # an add's gate: at most this many new rows query the new version, and half as many kept rows


def gate_change(
    version: IndexVersion, new_rows: np.ndarray, ann_k: int, min_ann_recall: float, force: bool
) -> tuple[float | None, QualityGate]:
    """An add's gate on what changed: ANN recall@`ann_k` of the new version's search against
    exact search, queried by (at most GATE_QUERIES of) the new rows and half as many kept rows,
    each unit (version or shard) searched on its own — the merge over units is exact — and
    its exact search read segment by segment where the vectors lie, never gathered whole.
    None (and passed) when what changed searches exactly: a Flat index, or new rows that all
    lie in Flat segments (`flat_until_compaction`)."""
    recalls = []
    for part in version.units():
        unit, local = version.unit(part.number), part.own(new_rows)
        if not len(local):
            continue
        if isinstance(empty_index(unit.manifest.dimension, unit.manifest.factory), faiss.IndexFlat):
            continue  # exact search: its recall is 1 by construction
        if all(flat_until_compaction(unit.manifest, entry.rows) for entry in _segments_holding(unit, local)):
            # The new rows are scanned exactly and the kept segments are the parent's, gated when
            # they were made: nothing this change made can miss. (Compaction codes them later.)
            continue
        searched = unit.searchable()
        picked_new = _sample_rows(unit, local, GATE_QUERIES)
        picked_old = _sample_rows(unit, np.setdiff1d(np.arange(len(unit.items)), local), GATE_QUERIES // 2)
        queries = np.asarray(unit.vectors[np.sort(np.concatenate([picked_new, picked_old]))], dtype=np.float32)
        k = min(ann_k, len(unit.items))
        _, exact_rows = exact_search(unit.vectors, queries, k, unit.live_mask)  # segment by segment, where they lie
        recalls.append(recall_against(search(searched, queries, k)[1], exact_rows, unit.vectors, queries))
    if not recalls:
        why = "the new rows are searched exactly (Flat segments until compaction), the kept segments as gated before"
        return None, QualityGate(passed=True, reasons=[f"gated on the new rows: {why}"])
    recall = min(recalls)
    reasons = (
        [] if recall >= min_ann_recall else [f"ANN recall@{ann_k} of the new rows {recall:.4f} < {min_ann_recall}"]
    )
    if reasons and not force:
        raise QualityGateError("quality gate refused to publish: " + "; ".join(reasons))
    return recall, QualityGate(passed=not reasons, forced=bool(reasons), reasons=reasons)


def _segments_holding(unit: IndexVersion, rows: np.ndarray) -> list[SegmentEntry]:
    """The unit's segments that hold any of `rows` (its own rows)."""
    return [e for e in unit.segment_entries if np.any((rows >= e.row_offset) & (rows < e.row_offset + e.rows))]


def _sample_rows(unit: IndexVersion, rows: np.ndarray, count: int) -> np.ndarray:
    """`count` of `rows`, chosen by their ids (`stable_sample`), among the 4×count whose ids hash
    lowest (`string_hashes`, over the Arrow column at once): the same rows whatever their order,
    without hashing a million ids one by one in Python."""
    if len(rows) > 4 * count:
        hashes = string_hashes(unit.items.ids.array)[rows]
        rows = np.sort(rows[np.argpartition(hashes, 4 * count)[: 4 * count]])
    ids = unit.items.ids
    return rows[stable_sample([ids[int(r)] for r in rows], count, seed=2)]
