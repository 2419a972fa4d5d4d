"""An add's quality gate (issue 48, "gates on what changed"): it measures what the change made.
New rows in a Flat segment (every add below FLAT_SEGMENT_ROWS) are scanned exactly, and the
kept segments are the parent's, gated when made: nothing to search, so a small add to a large
IVF-PQ version costs its write and not a search of the version. Rows coded by the version's
trained quantizer (an add of FLAT_SEGMENT_ROWS or more) are measured against exact search,
and refused below the floor unless forced."""

from __future__ import annotations

import pytest

from core.data.items import ItemTable
from index.build.gate import GateThresholds, QualityGateError
from index.changes.add import add_vectors
from index.versions import segments
from index.versions.version import IndexVersion
from tests.support import shards as support

DIM, ITEMS = 16, 300


def _gate(min_ann_recall: float, force: bool = False) -> GateThresholds:
    return GateThresholds(
        ks=(1,), quality_sample=100, ann_k=10, min_ann_recall=min_ann_recall, min_probe_recall_at_1=0,
        max_recall_drop=None, force=force,
    )  # fmt: skip


def _rows(count: int, seed: int, first: int) -> tuple:
    vectors, table = support.catalog(count, DIM, ITEMS, seed=seed)
    ids = [f"new{first + i:06d}" for i in range(count)]
    return vectors, ItemTable(ids, None, list(table.paths), list(table.metadata))


@pytest.fixture
def ivf_root(tmp_path):
    """An IVF-PQ version searched at one list of 16: its ANN recall is far below 1."""
    data = support.catalog(2000, DIM, ITEMS)
    model = support.model(tmp_path / "model", DIM)
    support.publish(tmp_path / "index", data, model, 1, "IVF16,PQ4", {"nprobe": 1})
    return tmp_path / "index"


def test_a_small_add_is_passed_without_a_search_its_rows_being_scanned_exactly(ivf_root):
    vectors, items = _rows(10, seed=3, first=0)
    report = add_vectors(ivf_root, vectors, items, gate=_gate(min_ann_recall=0.999))
    gate = IndexVersion(report.version).manifest.quality_gate
    assert gate.passed and not gate.forced
    assert "searched exactly" in gate.reasons[0]


def test_rows_coded_by_the_trained_quantizer_are_measured_and_refused_below_the_floor(ivf_root):
    count = segments.FLAT_SEGMENT_ROWS  # the first size whose segment is IVF-PQ, not Flat
    vectors, items = _rows(count, seed=4, first=0)
    live_before = IndexVersion.open(ivf_root).name
    with pytest.raises(QualityGateError, match=r"ANN recall@10 of the new rows 0\.\d+ < 0\.999"):
        add_vectors(ivf_root, vectors, items, gate=_gate(min_ann_recall=0.999))
    assert IndexVersion.open(ivf_root).name == live_before  # nothing published
    report = add_vectors(ivf_root, vectors, items, gate=_gate(min_ann_recall=0.999, force=True))
    gate = IndexVersion(report.version).manifest.quality_gate
    assert gate.forced and not gate.passed
    # The same rows pass a floor their measured recall reaches.
    vectors, items = _rows(count, seed=5, first=count)
    report = add_vectors(ivf_root, vectors, items, gate=_gate(min_ann_recall=0.0))
    assert IndexVersion(report.version).manifest.quality_gate.passed
